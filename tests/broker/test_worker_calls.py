"""The worker's device calls under hostile clients (issue 30), through the in-process worker
(devtools/inproc.py: the real transport, service and device tools on a real mosquitto, the
fake engine writing the model's calls, which vLLM's hermes parser reads) and the simulated
devices (devtools/devices.py), which deduplicate by ``toolCallId`` as docs/tools.md asks of
real devices:

- two users, and two sessions of one user, send the same ``requestId`` at the same moment:
  each call reaches its device once, with an id of its own, and each user gets only their own
  result (the ids were derived from the requestId alone: the device answered the lamp's
  calls with the sensor's reading, and the lamp never switched);
- a cancel while a device call is out: the call's result is waited for, nothing more is
  generated, the reply is ``cancelled``, and the turn is stored as far as it came (the device
  did act), so a redelivery gets that same reply and the device is not called again."""

from __future__ import annotations

import functools
import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from loguru import logger

from devtools.devices import SENSOR, SimulatedDevices
from devtools.fakes import FakeEngine
from devtools.inproc import LiveWorker
from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import Client
from worker.engine.tokenizer import ChatTokenizer
from worker.engine.vllm import tool_support

LAMP = {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}


def call(name: str, arguments: dict[str, Any] | None = None) -> str:
    """A call as the model writes it (Hermes style)."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments or {})}}}\n</tool_call>'


@pytest.fixture
def devices(broker: Mosquitto) -> Iterator[SimulatedDevices]:
    # Held: each device answers only once the test releases it, so that every call is out at once.
    sim = SimulatedDevices(port=broker.port, prefix=f"d{uuid.uuid4().hex[:8]}", held=["lamp/set", "sensor/read"])
    sim.start()
    yield sim
    sim.stop()


@pytest.fixture
def live(broker: Mosquitto, tokenizer: ChatTokenizer, devices: SimulatedDevices) -> Iterator[LiveWorker]:
    tools = {
        "mqtt": [
            {"name": "sensor_read", "topic": f"{devices.prefix}/sensor/read", "users": ["*"]},
            {"name": "lamp_set", "topic": f"{devices.prefix}/lamp/set", "parameters": LAMP, "users": ["*"]},
        ]
    }
    worker = LiveWorker(
        broker.port, engine=FakeEngine(), tool_support=tool_support("auto", tokenizer, "tiny"), tools=tools
    )
    yield worker
    worker.close()


def test_the_same_request_id_from_two_users_and_two_sessions_runs_each_call_once(
    broker: Mosquitto, devices: SimulatedDevices, live: LiveWorker
) -> None:
    # (user, session) -> the model's call in that session, and the result only that call may get.
    asked = {
        ("alice", "s1"): ("sensor_read", {}, SENSOR),
        ("alice", "s2"): ("lamp_set", {"on": True}, {"on": True}),
        ("bob", "s1"): ("lamp_set", {"on": False}, {"on": False}),
        ("bob", "s2"): ("sensor_read", {}, SENSOR),
    }
    for (user, session), (name, arguments, _) in asked.items():
        # The fake engine plays a session's rounds by its part of the engine request id.
        live.engine.rounds[f"{user}/{session}/"] = [call(name, arguments), f"done in {user}/{session}"]
    frontend = Client(broker.port, [f"{live.prefix}/+/+/reply"])
    try:
        for user, session in asked:
            frontend.publish(
                live.topic(user, session), {"requestId": "h1", "message": "Go", "workerTools": ["*"]}, qos=1
            )
        # All four calls are out at the same moment (the devices hold their answers).
        devices.wait_until(lambda: len(devices.calls) == len(asked), 30)
        devices.release("lamp/set")
        devices.release("sensor/read")
        replies = {}
        for _ in asked:
            got = frontend.wait_for(lambda m: m.topic.endswith("/reply"), 30)
            user, session = got.topic.split("/")[1:3]
            replies[(user, session)] = got.json()
    finally:
        frontend.close()

    # Each call reached its device once, under an id of its own: nothing was answered from
    # another call's stored answer.
    assert not [c for c in devices.calls if c["duplicate"]], devices.calls
    ids = [c["toolCallId"] for c in devices.calls]
    assert len(set(ids)) == len(asked), ids
    assert all(c["requestId"] == "h1" for c in devices.calls)
    for (user, session), (name, arguments, result) in asked.items():
        reply = replies[(user, session)]
        assert reply["requestId"] == "h1" and reply["reply"] == f"done in {user}/{session}", reply
        (worker_call,) = reply["workerCalls"]
        assert (worker_call["name"], worker_call["outcome"]) == (name, "ok")
        assert json.loads(worker_call["result"]) == result, (user, session, worker_call)
        # The device got this session's arguments under this session's id.
        (seen,) = [c for c in devices.calls if c["toolCallId"] == worker_call["id"]]
        assert json.loads(seen["payload"]) == arguments
        (turn,) = live.call(functools.partial(live.service.sessions.get, f"{user}/{session}")).turns
        assert json.loads(turn.messages[2]["content"]) == result
    assert devices.lamp_on in (True, False) and 1 <= devices.actuations <= 2  # both switches ran


def test_a_cancel_during_a_device_call_keeps_what_the_device_did(
    broker: Mosquitto, devices: SimulatedDevices, live: LiveWorker
) -> None:
    cancelled = threading.Event()
    sink = logger.add(lambda m: cancelled.set(), level="INFO", filter=lambda r: "Cancelling" in r["message"])
    live.engine.rounds["carol/c1/"] = [call("lamp_set", {"on": True}), "never generated"]
    frontend = Client(broker.port, [f"{live.prefix}/+/+/reply"])
    request = {"requestId": "c1", "message": "Lamp on", "workerTools": ["*"]}
    try:
        frontend.publish(live.topic("carol", "c1"), request)
        devices.wait_until(lambda: len(devices.calls) == 1, 30)  # the call is out
        frontend.publish(live.topic("carol", "c1", "control"), {"action": "cancel", "requestId": "c1"})
        assert cancelled.wait(30)
        devices.release("lamp/set")
        reply = frontend.wait_topic(live.topic("carol", "c1", "reply"), 30).json()
        # The reply says it was cancelled, and what the device did.
        assert reply["finishReason"] == "cancelled" and reply["reply"] == ""
        (done,) = reply["workerCalls"]
        assert (done["name"], done["outcome"], json.loads(done["result"])) == ("lamp_set", "ok", {"on": True})
        # Nothing generated after the cancel.
        assert live.engine.rounds["carol/c1/"] == ["never generated"]
        # The turn is stored as far as it came: the model is never told the lamp is still off.
        (turn,) = live.call(lambda: live.service.sessions.get("carol/c1").turns)
        assert [m["role"] for m in turn.messages] == ["user", "assistant", "tool", "assistant"]
        assert json.loads(turn.messages[2]["content"]) == {"on": True} and turn.messages[3]["content"] == ""
        assert live.call(lambda: live.service.sessions.store.load_progress("carol/c1", "c1")) is None
        # A redelivery of the request (the client sends it again): the stored reply, no new call.
        frontend.publish(live.topic("carol", "c1"), request)
        again = frontend.wait_topic(live.topic("carol", "c1", "reply"), 30).json()
        assert again == reply
        assert len(devices.calls) == 1 and devices.actuations == 1
    finally:
        logger.remove(sink)
        frontend.close()
