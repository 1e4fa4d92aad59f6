"""What a client sees of the delivery rules, on a real mosquitto with the in-process worker
(the real MQTT transport, devtools.fakes' FakeEngine): a retained request is never run, also
while the worker is online and also from an MQTT 3.1.1 publisher; the same text sent twice
without a requestId is two turns; after a reset, a message without a requestId is a new turn
and an old requestId gets duplicate_request; and no text a client chose reaches the log at
INFO or above."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from loguru import logger

from devtools.inproc import LiveWorker
from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import Client

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def live(broker: Mosquitto) -> Iterator[LiveWorker]:
    worker = LiveWorker(broker.port, generation={"max_tokens": 3})
    yield worker
    worker.close()


def mosquitto_pub() -> str:
    found = shutil.which("mosquitto_pub")
    assert found, "mosquitto_pub (Debian's mosquitto-clients) is needed"
    return found


@pytest.mark.parametrize("publisher", ["MQTT 5", "MQTT 3.1.1"])
def test_a_retained_request_is_not_run_while_the_worker_is_online(
    broker: Mosquitto, live: LiveWorker, publisher: str
) -> None:
    topic = live.topic("ann", "s1")
    client = Client(broker.port, [live.topic("ann", "s1", "reply")])
    try:
        retained = '{"message": "replayed to every subscriber", "requestId": "retained"}'
        version = "mqttv5" if publisher == "MQTT 5" else "mqttv311"
        subprocess.run(
            [mosquitto_pub(), "-p", str(broker.port), "-V", version, "-q", "1", "-r", "-t", topic, "-m", retained],
            check=True,
            timeout=10,
        )
        live.wait_acked(1)  # taken and acknowledged, not answered
        client.publish(topic, {"message": "hello", "requestId": "live"})
        assert client.wait_topic(live.topic("ann", "s1", "reply")).json()["requestId"] == "live"
        # The retained message came first, in the same session, whose turns run in order: an
        # answer to it would have come before this one.
        assert client.received(lambda m: m.topic.endswith("/reply")) == []
        assert len(live.engine.started) == 1
    finally:
        # Clear the retained message: nothing else on this broker should get it.
        subprocess.run([mosquitto_pub(), "-p", str(broker.port), "-r", "-n", "-t", topic], check=False, timeout=10)
        client.close()


def replies(client: Client, live: LiveWorker, session: str, count: int) -> list[dict[str, Any]]:
    return [client.wait_topic(live.topic("bo", session, "reply")).json() for _ in range(count)]


def test_the_same_message_sent_twice_without_request_id_is_two_turns(broker: Mosquitto, live: LiveWorker) -> None:
    client = Client(broker.port, [live.topic("bo", "s1", "reply")])
    try:
        for _ in range(2):
            client.publish(live.topic("bo", "s1"), {"message": "continue"})
            replies(client, live, "s1", 1)
        assert len(live.engine.started) == 2
        turns = live.call(lambda: live.service.sessions.get("bo/s1").turns)
        assert [t.user for t in turns] == ["continue", "continue"]
    finally:
        client.close()


def test_after_a_reset_a_message_is_a_new_turn_and_an_old_request_id_is_told_to_change(
    broker: Mosquitto, live: LiveWorker
) -> None:
    client = Client(broker.port, [live.topic("bo", "s2", "reply")])
    try:
        client.publish(live.topic("bo", "s2"), {"message": "hi"})
        client.publish(live.topic("bo", "s2"), {"message": "with an id", "requestId": "r1"})
        client.publish(live.topic("bo", "s2", "control"), {"action": "reset"})
        first, second, reset = replies(client, live, "s2", 3)
        client.publish(live.topic("bo", "s2"), {"message": "hi"})  # the same payload again
        client.publish(live.topic("bo", "s2"), {"message": "a new question", "requestId": "r1"})
        # The duplicate is answered at once, the new turn after its generation.
        duplicate, again = sorted(replies(client, live, "s2", 2), key=lambda r: r["requestId"] != "r1")
        assert "reply" in first and second["requestId"] == "r1" and reset["action"] == "reset"
        assert "reply" in again and again["requestId"] != first["requestId"]  # generated anew
        assert duplicate["requestId"] == "r1" and duplicate["error"]["code"] == "duplicate_request"
        assert len(live.engine.started) == 3
    finally:
        client.close()


MARKER = "Zq7Marker"  # text a client wrote: never at INFO or above
NAME = "Nm4Name"  # in ids and topics a client chose: logged, escaped and cut


def test_no_text_a_client_chose_reaches_the_log_at_info_or_above(broker: Mosquitto) -> None:
    """Except the names the log finds a request by: its requestId and the topic of a message
    on an invalid topic, escaped (a line break in them cannot start a log line of its own)."""
    lines: list[str] = []
    sink = logger.add(lambda message: lines.append(str(message)), level="INFO", format="{level} {message}")
    live = LiveWorker(
        broker.port,
        generation={"max_tokens": 3},
        limits={"max_requests_per_user_per_minute": 1000},
    )
    client = Client(broker.port, [f"{live.prefix}/#"])
    forged = f"{NAME}\nERROR forged line"
    try:
        topic = live.topic("eve", "s1")
        sent = [
            (topic, {"message": MARKER, "systemPrompt": MARKER, "requestId": f"id-{NAME}"}),
            (topic, {"message": "x", f"field{MARKER}": 1}),  # an unknown field's name
            (topic, {"message": "x", "sessionId": f"other{MARKER}"}),  # a mismatched sessionId
            (topic, {"message": "x", "maxTokens": f"{MARKER}"}),  # a wrong type's value
            (
                topic,
                {"message": "x", "responseFormat": {"type": "json_schema", "schema": {"$ref": f"https://{MARKER}"}}},
            ),
            (topic, {"message": "x", "responseFormat": {"type": "json_schema", "schema": {"type": MARKER}}}),
            (topic, {"message": "x", "requestId": f"again-{NAME}", "maxTokens": 500, "stream": True}),
            (topic, {"message": "x", "requestId": forged}),
            (live.topic("eve", "s1", "control"), {"action": MARKER}),
            (live.topic("eve", "s1", "control"), {"action": "cancel", "requestId": f"again-{NAME}"}),
            (live.topic("eve", "s1", "control"), {"action": "cancel", "requestId": f"nothing-{NAME}"}),
            (f"{live.prefix}/eve/bad{NAME}!/request", {"message": "x"}),  # an invalid topic part
            (f"{live.prefix}/eve/s1/{MARKER}", {"message": "x"}),  # an unknown kind
            (live.topic("eve", "s1"), f"not json {MARKER}".encode()),
        ]
        for where, payload in sent:
            client.publish(where, payload)
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
        props.ResponseTopic = f"elsewhere/{MARKER}"
        client.publish(topic, {"message": "x", "requestId": "rt"}, properties=props)
        live.wait_acked(len(sent))  # every one but the unknown kind's (not subscribed)
        live.wait_idle()
    finally:
        client.close()
        live.close()
        logger.remove(sink)
    leaked = [line for line in lines if MARKER in line]
    assert not leaked, leaked
    assert any("refused" in line for line in lines)  # the log did speak of these requests
    named = "\n".join(line for line in lines if NAME in line)
    for name in (f"id-{NAME}", f"again-{NAME}", f"nothing-{NAME}", f"'{live.prefix}/eve/bad{NAME}!/request'"):
        assert name in named, (name, named)
    assert repr(forged) in named and not any(line.startswith("ERROR forged") for line in "".join(lines).splitlines())


def test_a_publish_the_broker_does_not_take_is_a_typed_failure(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The transport's publish future fails instead of succeeding when nothing was taken:
    PublishRefused for a topic the broker's ACL refuses (its PUBACK says Not authorized) and
    for a payload over its maximum packet size; PublishNotSent for what was still waiting for
    a PUBACK when the client closed."""
    import asyncio

    from devtools.net import free_port
    from worker.transport.mqtt import MqttSettings, MqttTransport
    from worker.transport.port import PublishNotSent, PublishRefused

    workdir = tmp_path_factory.mktemp("acl-broker")
    (workdir / "acl").write_text("topic readwrite allowed/#\n")
    broker = Mosquitto(workdir, f"acl_file {workdir / 'acl'}\nmax_packet_size 2000\n", keep_root=True)
    broker.start()

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        settings = MqttSettings(
            "127.0.0.1", broker.port, f"typed-{free_port()}", None, None, 30, 1, 2, 0, ("allowed/in",), "allowed/status"
        )
        transport = MqttTransport(settings, loop)
        transport.start()
        await asyncio.wait_for(transport.wait_connected(), 10)
        await asyncio.wait_for(transport.publish("allowed/ok", b"taken"), 10)
        with pytest.raises(PublishRefused, match="Not authorized"):
            await asyncio.wait_for(transport.publish("denied/x", b"refused"), 10)
        with pytest.raises(PublishRefused, match="maximum packet size"):
            await transport.publish("allowed/big", b"x" * 5000)
        broker.pause()  # no PUBACK can come
        try:
            waiting = transport.publish("allowed/late", b"never acknowledged")
            await asyncio.sleep(0.2)
            await transport.close(timeout=0.5)
            with pytest.raises(PublishNotSent):
                await waiting
        finally:
            broker.resume()

    try:
        asyncio.run(scenario())
    finally:
        broker.stop()
