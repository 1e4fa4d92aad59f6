"""Never actuate twice (docs/reliability.md, "Worker tools: at most once"), proven on the real
worker process, vLLM's CPU engine, mosquitto and simulated devices that count every call they
receive (duplicates included):

- session A's device call is outstanding (the lamp answers only minutes later) and
- session B's device call was answered and stored, and B's answer is being generated (the
  engine core is frozen from the moment the device got the call, so the answer cannot end),

when the worker is killed with SIGKILL (its whole process group: a crash). The next start is
delivered both requests again: each device has seen each call exactly once, each client gets
exactly one answer; A's call is listed with the outcome ``unknown`` (never sent again), B's
with the device's stored result. Then, on the same worker, a normal device round: the answer's
generation finds the whole prompt before the call in the prefix cache, and the worker's
overhead per round beyond generation is reported (issue 23's CPU measurement; no speed is
asserted: targets live in the benchmark, bench/tools.py --phases loop).

Two engine starts in all (~50 s each)."""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devtools.devices import SENSOR, SimulatedDevices
from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import Client
from devtools.worker_process import BLOCK_SIZE, WorkerProcess, engine_args

pytestmark = pytest.mark.e2e
WORKER_ID = "tools"
LAMP = {
    "name": "lamp_set",
    "description": "Switch the lamp",
    "parameters": {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]},
    "topic": "slow/lamp/set",
    "users": ["*"],
    "timeout": 600,
}
SENSOR_TOOL = {"name": "sensor_read", "description": "Read the room", "topic": "fast/sensor/read", "users": ["*"]}


def forced(name: str, request_id: str, message: str, max_tokens: int) -> dict[str, Any]:
    return {
        "message": message,
        "requestId": request_id,
        "workerTools": ["*"],
        "toolChoice": {"type": "function", "function": {"name": name}},
        "maxTokens": max_tokens,
    }


def start(model: Path, broker: Mosquitto, workdir: Path, name: str) -> WorkerProcess:
    worker = WorkerProcess(
        [
            *engine_args(model),
            "--mqtt-port",
            str(broker.port),
            "--worker-id",
            WORKER_ID,
            "--state-dir",
            str(workdir / "state"),
            "--tools-mqtt",
            json.dumps(LAMP),
            "--tools-mqtt",
            json.dumps(SENSOR_TOOL),
            "--stats-interval",
            "0",
        ],
        workdir / f"{name}.log",
        status=(broker.port, f"chat/_worker/{WORKER_ID}/status"),
    )
    worker.wait_online(300)
    return worker


@pytest.fixture(scope="module")
def devices(broker: Mosquitto) -> Iterator[tuple[SimulatedDevices, SimulatedDevices]]:
    # The lamp answers after 10 minutes: its call stays outstanding through the kill and
    # the restart (its late answer, if any, has correlation data no pending call has).
    slow = SimulatedDevices(port=broker.port, prefix="slow", delay_ms=600_000)
    fast = SimulatedDevices(port=broker.port, prefix="fast")
    slow.start()
    fast.start()
    yield slow, fast
    slow.stop()
    fast.stop()


def wait_until(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def replies(client: Client, session: str, request_id: str, settle: float) -> list[dict[str, Any]]:
    """Every reply on the session's topic: the first must come; more are looked for during settle."""
    topic = f"chat/u/{session}/reply"
    found = [client.wait_for(lambda m: m.topic == topic, timeout=300).json()]
    deadline = time.monotonic() + settle
    while (left := deadline - time.monotonic()) > 0:
        try:
            found.append(client.wait_for(lambda m: m.topic == topic, timeout=left).json())
        except TimeoutError:
            break
    assert all(r.get("requestId") == request_id for r in found), found
    return found


def test_a_crash_mid_loop_never_calls_a_device_twice(
    tiny_model: Path,
    broker: Mosquitto,
    devices: tuple[SimulatedDevices, SimulatedDevices],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    slow, fast = devices
    workdir = tmp_path_factory.mktemp("tool-faults")
    client = Client(broker.port, ["chat/u/+/reply"])
    worker = start(tiny_model, broker, workdir, "first")
    try:
        client.publish("chat/u/a/request", forced("lamp_set", "a-1", "Switch the lamp off.", 64))
        wait_until(lambda: len(slow.calls) == 1, 120, "the lamp's call")
        client.publish("chat/u/b/request", forced("sensor_read", "b-1", "Is anyone in?", 1000))
        # The engine stops the moment the sensor got its call: the worker stores the answer and
        # hands the next generation to an engine that cannot end it.
        wait_until(lambda: len(fast.calls) == 1, 120, "the sensor's call")
        for core in worker.engine_cores():
            core.suspend()
        b_call = fast.calls[0]["toolCallId"]
        wait_until(lambda: re.search(rf"worker call sensor_read \({b_call}\) ok", worker.log()), 60, "B's result")
    finally:
        worker.signal_group(signal.SIGKILL)  # the engine core with it: a crash
        worker.proc.wait(30)
    assert not [m for m in client.seen if m.topic.endswith("/reply")] and client.messages.empty()

    restarted = start(tiny_model, broker, workdir, "restarted")
    try:
        (a,) = replies(client, "a", "a-1", settle=0)
        (b,) = replies(client, "b", "b-1", settle=3)
        assert "error" not in a and "error" not in b, (a, b)
        assert [(c["name"], c["outcome"]) for c in a["workerCalls"]] == [("lamp_set", "unknown")]
        assert [(c["name"], c["outcome"]) for c in b["workerCalls"]] == [("sensor_read", "ok")]
        assert json.loads(b["workerCalls"][0]["result"]) == SENSOR
        assert a["workerCalls"][0]["id"] == slow.calls[0]["toolCallId"]
        assert b["workerCalls"][0]["id"] == b_call
        # Each device saw each call once, duplicates included, across both lives.
        assert [c["toolCallId"] for c in slow.calls] == [a["workerCalls"][0]["id"]]
        assert [c["toolCallId"] for c in fast.calls] == [b_call]
        assert slow.calls[0]["requestId"] == "a-1" and fast.calls[0]["requestId"] == "b-1"
        log = restarted.log()
        assert "going on from its stored tool-loop progress" in log
        assert f"call {a['workerCalls'][0]['id']} to lamp_set may have been sent" in log

        # A normal device round on the restarted worker.
        overheads = []
        for turn in range(3):
            client.publish("chat/u/c/request", forced("sensor_read", f"c-{turn}", f"Anyone in? ({turn})", 64))
            (reply,) = replies(client, "c", f"c-{turn}", settle=0)
            assert [c["outcome"] for c in reply["workerCalls"]] == ["ok"], reply
            call, answer = reply["rounds"]
            before_call = call["promptTokens"] + call["completionTokens"]
            assert answer["cachedTokens"] >= before_call // BLOCK_SIZE * BLOCK_SIZE, reply["rounds"]
            latency = reply["latency"]
            overheads.append(latency["totalMs"] - latency["queueMs"] - call["ms"] - answer["ms"])
        print(f"worker overhead per device round beyond generation (CPU, ms): {overheads}")
        assert len(fast.calls) == 4
        # No second answer to A or B came meanwhile.
        late = [m for m in client.seen if m.topic in ("chat/u/a/reply", "chat/u/b/reply")]
        while not client.messages.empty():
            message = client.messages.get_nowait()
            late += [message] if message.topic in ("chat/u/a/reply", "chat/u/b/reply") else []
        assert not late, [m.payload[:200] for m in late]
    finally:
        restarted.stop()
        client.close()
