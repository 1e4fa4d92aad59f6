"""Device tools (issue 23): the worker's MqttTransport (Messaging: send with MQTT 5 properties,
watch) and DeviceTools calling the simulated devices of devtools/devices.py through a real
mosquitto: a round trip with its properties, the door camera's snapshot as an image result,
timeouts, late answers, a publish the broker's ACL refuses, the response topic after a broker
restart, concurrent calls, an answer published retained."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from loguru import logger

from devtools.acl import PASSWORDS, documented_acl_broker
from devtools.devices import SENSOR, SimulatedDevices, door_snapshot
from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import Client, asking, connect, transport_on
from devtools.waiting import PATIENCE
from worker.config.models import MqttToolConfig
from worker.tools.mqtt import DeviceTools, response_topic_for
from worker.tools.port import CallContext
from worker.transport.mqtt import MqttTransport


def prefix() -> str:
    """Topics of their own for each test: the session's broker is shared."""
    return f"t{uuid.uuid4().hex[:8]}"


def tool(name: str, topic: str, timeout: float = 10.0) -> MqttToolConfig:
    return MqttToolConfig(name=name, topic=topic, users=["*"], timeout=timeout)


def context(n: int | str) -> CallContext:
    return CallContext(request_id=f"req-{n}", tool_call_id=f"call-{n}", session="alice/s1")


@contextlib.asynccontextmanager
async def device_tools(transport: MqttTransport, configs: list[MqttToolConfig]) -> AsyncIterator[DeviceTools]:
    tools = DeviceTools(configs, transport, response_topic_for("chat", "gpu-1"))
    await tools.start()
    try:
        yield tools
    finally:
        await tools.close()


@contextlib.contextmanager
def devices_on(port: int, **options: Any) -> Any:
    devices = SimulatedDevices(port=port, **options)
    devices.start()
    try:
        yield devices
    finally:
        devices.stop()


def test_a_call_goes_out_with_its_properties_and_its_answer_comes_back(broker: Mosquitto, tmp_path: Path) -> None:
    p = prefix()
    log = tmp_path / "calls.jsonl"
    listener = Client(broker.port, [f"{p}/#"])  # sees the call as the broker delivers it

    async def run() -> None:
        # Requests on a filter that covers the response topic too: answers still reach only the tools.
        async with (
            transport_on(broker.port, subscriptions=("chat/#",)) as transport,
            device_tools(transport, [tool("lamp_set", f"{p}/lamp/set"), tool("sensor", f"{p}/sensor/read")]) as tools,
        ):
            with devices_on(broker.port, prefix=p, log=log) as devices:
                outcome = await tools.call("lamp_set", {"on": True}, context(1))
                assert outcome.ok, outcome
                assert json.loads(outcome.content) == {"on": True}
                assert devices.actuations == 1

                call = listener.wait_topic(f"{p}/lamp/set", 10)
                assert call.payload == b'{"on":true}'  # compact JSON
                props = call.properties
                assert props.ResponseTopic == tools.response_topic
                assert props.ResponseTopic.startswith("chat/_tools/gpu-1/")
                assert len(props.CorrelationData) == 16
                assert ("requestId", "req-1") in props.UserProperty
                assert ("toolCallId", "call-1") in props.UserProperty
                assert props.ContentType == "application/json"
                assert 1 <= props.MessageExpiryInterval <= 10

                # The same toolCallId again (a redelivered request): the device answers as
                # before and does not switch the lamp again.
                again = await tools.call("lamp_set", {"on": True}, context(1))
                assert json.loads(again.content) == {"on": True}
                assert devices.actuations == 1
                reading = await tools.call("sensor", {}, context(2))
                assert json.loads(reading.content) == SENSOR

                assert tools.pending == 0
                # Each call reached its device once (the second lamp_set as a duplicate).
                assert [c["topic"] for c in devices.calls] == [f"{p}/lamp/set", f"{p}/lamp/set", f"{p}/sensor/read"]
                # Answers are the tools', never requests for the service.
                assert transport.inbox.empty()

    try:
        asyncio.run(run())
    finally:
        listener.close()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["topic"], r["toolCallId"], r["requestId"], r["duplicate"]) for r in records] == [
        (f"{p}/lamp/set", "call-1", "req-1", False),
        (f"{p}/lamp/set", "call-1", "req-1", True),
        (f"{p}/sensor/read", "call-2", "req-2", False),
    ]


def test_the_door_cameras_snapshot_is_an_image_result(broker: Mosquitto) -> None:
    """The tools demo's camera (scripts/tools-demo.sh door_camera) answers with its JPEG and the
    Content Type image/jpeg: the call's result carries the picture's bytes (what a vision model
    sees) and, as its text, what a model without vision gets."""
    p = prefix()
    listener = Client(broker.port, [response_topic_for("chat", "gpu-1")])  # sees the answer

    async def run() -> None:
        async with (
            transport_on(broker.port) as transport,
            device_tools(transport, [tool("door_camera", f"{p}/camera/snapshot")]) as tools,
        ):
            with devices_on(broker.port, prefix=p) as devices:
                outcome = await tools.call("door_camera", {}, context(1))
                jpeg = door_snapshot()
                assert outcome.ok and outcome.images == ((jpeg, "image/jpeg"),), outcome
                assert outcome.content == f"[image/jpeg, {len(jpeg)} bytes]"
                assert jpeg[:3] == b"\xff\xd8\xff" and 2000 < len(jpeg) < 20000  # a real JPEG, small
                answer = listener.wait_for(lambda m: m.payload == jpeg, 10)
                assert answer.properties.ContentType == "image/jpeg" and answer.payload == jpeg
                assert devices.answered[0]["payload"] == f"[image/jpeg, {len(jpeg)} bytes]"

    try:
        asyncio.run(run())
    finally:
        listener.close()


def test_a_device_that_does_not_answer_is_a_timeout(broker: Mosquitto) -> None:
    async def run() -> None:
        async with (
            transport_on(broker.port) as transport,
            device_tools(transport, [tool("nobody", f"{prefix()}/nobody/home", timeout=0.5)]) as tools,
        ):
            outcome = await tools.call("nobody", {"x": 1}, context(1))
            assert (outcome.outcome, outcome.content) == ("timeout", "Error: the device did not answer within 0.5 s.")
            assert tools.pending == 0

    asyncio.run(run())


def test_a_late_answer_is_dropped_and_never_taken_for_another_call(broker: Mosquitto) -> None:
    """The lamp answers after its call's 0.5 s timeout, while a sensor call waits: the sensor
    call gets its own answer, not the lamp's. The devices are held and released by the test,
    so the order (lamp's late answer, then the sensor's) is the test's, not the machine's."""
    p = prefix()
    dropped: list[str] = []
    sink = logger.add(
        lambda m: dropped.append(m.record["message"]), level="DEBUG", filter=lambda r: "Dropping" in r["message"]
    )

    async def run() -> None:
        async with (
            transport_on(broker.port) as transport,
            device_tools(
                transport, [tool("lamp_set", f"{p}/lamp/set", timeout=0.5), tool("sensor", f"{p}/sensor/read")]
            ) as tools,
        ):
            with devices_on(broker.port, prefix=p, held=["lamp/set", "sensor/read"]) as devices:
                late = await tools.call("lamp_set", {"on": True}, context(1))
                assert late.outcome == "timeout"
                assert tools.pending == 0
                reading = asyncio.ensure_future(tools.call("sensor", {}, context(2)))
                await asyncio.to_thread(devices.wait_until, lambda: len(devices.calls) == 2, PATIENCE)
                devices.release("lamp/set")  # its answer comes now, while the sensor call waits
                while not dropped and not reading.done():  # dropped, or (wrongly) taken
                    await asyncio.sleep(0.02)
                assert dropped and not reading.done() and tools.pending == 1, reading
                devices.release("sensor/read")
                outcome = await reading
                assert outcome.ok and json.loads(outcome.content) == SENSOR, outcome
                assert tools.pending == 0
                assert transport.inbox.empty()

    try:
        asyncio.run(run())
    finally:
        logger.remove(sink)


def test_concurrent_calls_get_their_own_answers(broker: Mosquitto) -> None:
    p = prefix()

    async def run() -> None:
        async with (
            transport_on(broker.port) as transport,
            device_tools(transport, [tool("lamp_get", f"{p}/lamp/get"), tool("sensor", f"{p}/sensor/read")]) as tools,
        ):
            with devices_on(broker.port, prefix=p, delay_ms=200):
                names = ["lamp_get", "sensor"] * 4
                outcomes = await asyncio.gather(*(tools.call(n, {}, context(i)) for i, n in enumerate(names)))
                for name, outcome in zip(names, outcomes, strict=True):
                    assert outcome.ok, outcome
                    assert json.loads(outcome.content) == ({"on": False} if name == "lamp_get" else SENSOR)
                assert tools.pending == 0

    asyncio.run(run())


def test_the_response_topic_works_again_after_the_broker_lost_everything(tmp_path: Path) -> None:
    """Killed, and without persistence: the broker forgets the worker's session and its
    subscription. The transport subscribes its watched topics again on the reconnect."""
    lost = Mosquitto(tmp_path, persistence=False)
    lost.start()
    p = prefix()

    async def run() -> None:
        async with (
            transport_on(lost.port, session_expiry=3600) as transport,
            device_tools(transport, [tool("sensor", f"{p}/sensor/read")]) as tools,
        ):
            with devices_on(lost.port, prefix=p):
                assert (await tools.call("sensor", {}, context(1))).ok
            lost.kill()
            while transport.connected:
                await asyncio.sleep(0.05)
            lost.restart()
            await asyncio.wait_for(transport.wait_connected(), PATIENCE)
            with devices_on(lost.port, prefix=p):
                outcome = await tools.call("sensor", {}, context(2))
                assert outcome.ok, outcome
                assert json.loads(outcome.content) == SENSOR

    try:
        asyncio.run(run())
    finally:
        lost.stop()


def test_a_device_topic_the_broker_refuses_is_unavailable(tmp_path: Path) -> None:
    """With the documented ACL (docs/security.md), the worker may call devices/lamp/set but not
    devices/garage/open: the broker's PUBACK says not authorized."""
    acl_broker = documented_acl_broker(tmp_path, devices=True)
    login = {"username": "worker", "password": PASSWORDS["worker"], "status_topic": "chat/_worker/gpu-1/status"}

    configs = [tool("garage", "devices/garage/open"), tool("lamp_set", "devices/lamp/set")]

    async def run() -> None:
        async with transport_on(acl_broker.port, **login) as transport, device_tools(transport, configs) as tools:
            with devices_on(acl_broker.port, login=("devices", PASSWORDS["devices"])) as devices:
                refused = await tools.call("garage", {"open": True}, context(1))
                assert refused.outcome == "unavailable", refused
                assert "not sent" in refused.content
                granted = await tools.call("lamp_set", {"on": True}, context(2))
                assert granted.ok and json.loads(granted.content) == {"on": True}, granted
                assert [c["topic"] for c in devices.calls] == ["devices/lamp/set"]
                assert tools.pending == 0

    try:
        asyncio.run(run())
    finally:
        acl_broker.stop()


def test_answers_are_acknowledged_by_the_transport_at_once(broker: Mosquitto) -> None:
    """With Receive Maximum 1 the broker sends the worker one unacknowledged QoS 1 message at a
    time: an answer left unacknowledged (for the service, which never sees it) would hold back
    every later answer, and the second call would time out."""
    p = prefix()

    async def run() -> None:
        async with (
            transport_on(broker.port, receive_maximum=1) as transport,
            device_tools(transport, [tool("sensor", f"{p}/sensor/read", timeout=5)]) as tools,
        ):
            with devices_on(broker.port, prefix=p):
                for n in range(3):
                    outcome = await tools.call("sensor", {}, context(n))
                    assert outcome.ok, (n, outcome)
                assert transport.inbox.empty()

    asyncio.run(run())


def test_a_retained_answer_is_refused_live_and_dropped_when_replayed(broker: Mosquitto) -> None:
    """A device that publishes its answer retained: the broker would keep it and replay it to
    every later subscription of the response topic. The live answer ends its call as an error
    at once (with a WARNING that quotes none of it); the replay a new subscription gets names
    no pending call and is dropped."""
    p = prefix()
    response_topic = f"{p}/_tools/gpu-1/responses"  # its own: the retained answer stays there
    warnings: list[str] = []
    dropped: list[str] = []
    sinks = [
        logger.add(lambda m: warnings.append(m.record["message"]), level="WARNING"),
        logger.add(lambda m: dropped.append(m), level="DEBUG", filter=lambda r: "Dropping" in r["message"]),
    ]

    def answer_retained(message: Any) -> None:
        props = asking(message.properties.ResponseTopic, message.properties.CorrelationData)
        device.publish(message.properties.ResponseTopic, b'{"secret": "kept on the broker"}', 1, True, props)

    device = connect(broker.port, [f"{p}/lamp/get"], on_message=answer_retained)

    async def run() -> None:
        async with transport_on(broker.port) as transport:
            tools = DeviceTools([tool("lamp_get", f"{p}/lamp/get", timeout=20)], transport, response_topic)
            await tools.start()
            try:
                outcome = await tools.call("lamp_get", {}, context(1))  # "error": not its 20 s timeout
                assert outcome.outcome == "error" and "retain" in outcome.content, outcome
                assert "secret" not in outcome.content
                assert tools.pending == 0
            finally:
                await tools.close()
        # A later subscription (another start) gets the retained answer replayed: dropped.
        async with transport_on(broker.port) as transport:
            tools = DeviceTools([tool("lamp_get", f"{p}/lamp/get")], transport, response_topic)
            await tools.start()
            try:
                while not dropped:
                    await asyncio.sleep(0.02)
                assert tools.pending == 0 and transport.inbox.empty()
            finally:
                await tools.close()

    try:
        asyncio.run(asyncio.wait_for(run(), PATIENCE))
    finally:
        device.publish(response_topic, b"", 1, True).wait_for_publish(5)  # clear it
        device.disconnect()
        device.loop_stop()
        for sink in sinks:
            logger.remove(sink)
    refused = [w for w in warnings if "retained" in w]
    assert len(refused) == 1 and "secret" not in refused[0], warnings
