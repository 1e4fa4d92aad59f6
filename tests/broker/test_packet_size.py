"""Oversized replies (issue 4, point 10): the broker's Maximum Packet Size from CONNACK is
respected. paho ignores it: a larger packet gets the worker disconnected, and paho sends it
again after every reconnect. A reply is cut to fit (finishReason truncated), or replaced by a
too_large error; stream deltas are split."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from devtools.inproc import LiveWorker
from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import Client
from devtools.waiting import PATIENCE
from worker.protocol.messages import ChatReply, Latency, Usage
from worker.protocol.packets import fit_answer, split_to_fit
from worker.transport.mqtt import publish_packet_size

MAX_PACKET = 2048
# Multi-byte characters (2, 3 and 4 bytes in UTF-8) and characters JSON escapes.
LONG_TEXT = "".join(f'w{i} héllo €uro 😀 "q" \\ \n' for i in range(200))


@pytest.fixture(scope="module")
def small_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    broker = Mosquitto(tmp_path_factory.mktemp("small-broker"), extra_config=f"max_packet_size {MAX_PACKET}\n")
    broker.start()
    yield broker
    broker.stop()


def reply_payload(text: str) -> bytes:
    return ChatReply(
        session_id="s1",
        request_id="r1",
        reply=text,
        finish_reason="length",
        usage=Usage(prompt_tokens=1, completion_tokens=2, cached_tokens=0),
        latency=Latency(queue_ms=0.1, ttft_ms=1.0, total_ms=2.0),
    ).to_json()


def test_a_reply_over_the_limit_is_cut_on_a_character_boundary_to_the_longest_that_fits() -> None:
    payload = reply_payload(LONG_TEXT)
    assert fit_answer(payload, None) is payload and fit_answer(payload, len(payload)) is payload
    for limit in range(300, 420):  # every cut position across multi-byte characters and escapes
        fitted = fit_answer(payload, limit)
        assert fitted is not None and len(fitted) <= limit
        data = json.loads(fitted.decode("utf-8"))
        assert data["finishReason"] == "truncated" and LONG_TEXT.startswith(data["reply"])
        one_more = LONG_TEXT[: len(data["reply"]) + 1]
        assert len(reply_payload(one_more).replace(b'"length"', b'"truncated"')) > limit  # the longest


def test_when_not_even_an_empty_reply_fits_the_answer_is_an_error_or_nothing() -> None:
    payload = reply_payload(LONG_TEXT)
    empty = len(reply_payload("").replace(b'"length"', b'"truncated"'))
    error = json.loads(fit_answer(payload, empty - 1) or b"null")
    assert error["error"]["code"] == "too_large" and error["requestId"] == "r1" and error["sessionId"] == "s1"
    assert fit_answer(payload, 60) is None


def test_stream_deltas_are_split_to_fit() -> None:
    def build(seq: int, text: str) -> bytes:
        return json.dumps({"requestId": "r1", "seq": seq, "delta": text}, ensure_ascii=False).encode()

    assert split_to_fit(LONG_TEXT, build, 3, None) == [build(3, LONG_TEXT)]
    pieces = split_to_fit(LONG_TEXT, build, 3, 200)
    decoded = [json.loads(p) for p in pieces]
    assert all(len(p) <= 200 for p in pieces) and len(pieces) > 10
    assert [d["seq"] for d in decoded] == list(range(3, 3 + len(pieces)))
    assert "".join(d["delta"] for d in decoded) == LONG_TEXT
    assert split_to_fit(LONG_TEXT, build, 0, 30) == []  # not even one character fits


def test_the_worker_respects_the_brokers_maximum_packet_size(small_broker: Mosquitto) -> None:
    live = LiveWorker(small_broker.port, generation={"stream_interval_ms": 1000})
    live.engine.script = {"long": [LONG_TEXT[i : i + 100] for i in range(0, len(LONG_TEXT), 100)]}
    client = Client(small_broker.port, [f"{live.prefix}/#"])
    try:
        assert live.transport.max_packet_size == MAX_PACKET  # read from the CONNACK
        client.publish(live.topic("ann", "s1"), {"message": "x", "requestId": "long", "stream": True})
        reply_message = client.wait_topic(live.topic("ann", "s1", "reply"), timeout=PATIENCE)
        reply = reply_message.json()
        assert reply["finishReason"] == "truncated" and LONG_TEXT.startswith(reply["reply"])
        size = publish_packet_size(reply_message.topic, len(reply_message.payload), 1, 1)
        assert MAX_PACKET - 16 <= size <= MAX_PACKET  # as much of the text as fits
        deltas = [m.json() for m in client.seen if m.topic == live.topic("ann", "s1", "stream")]
        assert "".join(d["delta"] for d in deltas) == LONG_TEXT  # split, not cut
        assert [d["seq"] for d in deltas] == list(range(len(deltas)))

        # Correlation data takes room too: here so much that only the error fits.
        reply_topic = live.topic("ann", "s2", "reply")
        room = live.call(lambda: live.transport.payload_limit(reply_topic, correlation_data=b"c" * 1800))
        properties = Properties(PacketTypes.PUBLISH)
        properties.CorrelationData = b"c" * (1800 + (room or 0) - 180)  # 180 bytes left for the payload
        client.publish(live.topic("ann", "s2"), {"message": "x", "requestId": "long"}, properties=properties)
        error = client.wait_topic(live.topic("ann", "s2", "reply"), timeout=PATIENCE).json()
        assert error["error"]["code"] == "too_large" and error["requestId"] == "long"

        # Still connected, never reconnected; other sessions are served.
        client.publish(live.topic("ann", "s3"), {"message": "hello", "requestId": "short"})
        assert client.wait_topic(live.topic("ann", "s3", "reply"), timeout=PATIENCE).json()["requestId"] == "short"
        # One more round trip: the broker handles a connection's packets in order, so had
        # anything before made it drop the worker, this answer would come over a new connection.
        client.publish(live.topic("ann", "s4"), {"message": "hello", "requestId": "after"})
        assert client.wait_topic(live.topic("ann", "s4", "reply"), timeout=PATIENCE).json()["requestId"] == "after"
        assert live.transport.connects == 1 and live.transport.connected
        # Each connect publishes "online": the client saw one (the retained one, on subscribing).
        status = live.call(lambda: live.transport.settings.status_topic)
        assert [m.payload for m in client.seen if m.topic == status] == [b"online"]
    finally:
        client.close()
        live.close()
