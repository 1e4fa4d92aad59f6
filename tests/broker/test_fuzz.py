"""Property-based fuzzing of request payloads (issue 4, point 9), through the real broker:
whatever a client sends, it gets exactly one well-formed answer (a reply, or an error with a
known code), and the worker keeps serving."""

from __future__ import annotations

import itertools
import json
import math
import threading
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from paho.mqtt.enums import CallbackAPIVersion

from devtools.inproc import LiveWorker
from devtools.mosquitto import Mosquitto
from devtools.waiting import PATIENCE
from worker.protocol.messages import ErrorCode

PAYLOAD_LIMIT = 2048
CODES = {code.value for code in ErrorCode}
FINISH_REASONS = {"stop", "length", "cancelled", "truncated"}

# Strings with anything in them: control characters, NUL, astral characters, and lone
# surrogates (which json.dumps writes as "\ud800" escapes).
tricky = st.sampled_from(["a", " ", "\x00", "\n", '"', "\\", "é", "€", "😀", "\ud800", "\udfff", "\ufeff"])
any_text = st.text(st.characters(exclude_categories=()), max_size=40) | st.text(tricky, max_size=12)
scalars = st.none() | st.booleans() | st.integers() | st.floats() | any_text
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4), max_leaves=12
)


def field(plausible: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A field's value: mostly of its own kind (boundaries included), sometimes anything."""
    return st.one_of(plausible, plausible, json_values)


REQUEST_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "message": field(any_text | st.just("hello")),
    "sessionId": field(st.sampled_from(["SESSION", "other", ""])),
    "maxTokens": field(st.integers(min_value=-2, max_value=6) | st.integers() | st.floats(0, 10)),
    "temperature": field(st.floats(-1, 3) | st.sampled_from([0, 2, math.nan, math.inf])),
    "topP": field(st.floats(-0.5, 1.5) | st.sampled_from([0, 1, math.nan])),
    "systemPrompt": field(any_text),
    "requestId": field(any_text | st.text(min_size=120, max_size=140)),
    "stream": field(st.booleans()),
    "responseFormat": field(
        st.sampled_from(
            [
                {"type": "json_object"},
                {"type": "json_schema", "schema": {"type": "object"}},
                {"type": "json_schema", "schema": {"type": "objekt"}},
                {"type": "json_schema"},
                {"type": "xml"},
            ]
        )
    ),
    "max_tokens": json_values,  # an unknown field
}

request_objects = st.fixed_dictionaries({}, optional=REQUEST_FIELDS)


def encode(value: Any) -> bytes:
    return json.dumps(value).encode()  # NaN and Infinity as Python writes them


payloads = st.one_of(
    request_objects.map(encode),
    request_objects.map(encode),
    json_values.map(encode),
    st.binary(max_size=300),
    request_objects.map(lambda r: encode(r)[:-1]),  # cut short
    st.binary(min_size=PAYLOAD_LIMIT - 8, max_size=PAYLOAD_LIMIT + 8),  # around the size limit
)


class Answers:
    """Everything published on the reply topics, per topic."""

    def __init__(self, port: int, subscription: str) -> None:
        self.by_topic: defaultdict[str, list[bytes]] = defaultdict(list)
        self._arrived = threading.Condition()
        subscribed = threading.Event()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *args: subscribed.set()
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        self.client.subscribe(subscription, qos=1)
        assert subscribed.wait(PATIENCE), "no SUBACK"

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        with self._arrived:
            self.by_topic[message.topic].append(bytes(message.payload))
            self._arrived.notify_all()

    def first(self, topic: str, timeout: float = PATIENCE) -> bytes:
        with self._arrived:
            assert self._arrived.wait_for(lambda: self.by_topic[topic], timeout), f"no answer on {topic}"
            return self.by_topic[topic][0]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def check_answer(raw: bytes, session: str) -> None:
    answer = json.loads(raw.decode("utf-8"))
    assert answer["sessionId"] == session
    assert isinstance(answer.get("requestId", ""), str)
    if "error" in answer:
        assert set(answer) <= {"sessionId", "requestId", "error"}
        assert answer["error"]["code"] in CODES and answer["error"]["message"], answer
    else:
        assert isinstance(answer["reply"], str) and answer["finishReason"] in FINISH_REASONS, answer
        assert set(answer["usage"]) == {"promptTokens", "completionTokens", "cachedTokens"}


@pytest.fixture
def live(broker: Mosquitto) -> Iterator[LiveWorker]:
    worker = LiveWorker(
        broker.port,
        limits={"max_payload_bytes": PAYLOAD_LIMIT},
        generation={"max_tokens": 2, "max_tokens_limit": 4, "stream_interval_ms": 0},
    )
    yield worker
    worker.close()


def test_every_payload_gets_exactly_one_well_formed_answer(live: LiveWorker, broker: Mosquitto) -> None:
    answers = Answers(broker.port, f"{live.prefix}/+/+/reply")
    sender = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    sender.connect("127.0.0.1", broker.port)
    sender.loop_start()
    sessions = (f"f{n}" for n in itertools.count())
    sent: list[str] = []

    @settings(
        max_examples=250,
        report_multiple_bugs=False,
        derandomize=True,  # the same examples on every run
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(payload=payloads)
    def one_request(payload: bytes) -> None:
        session = next(sessions)  # a fresh session: no history, no earlier requestIds
        payload = payload.replace(b"SESSION", session.encode())
        sent.append(session)
        sender.publish(live.topic("zed", session), payload, qos=1).wait_for_publish(5)
        check_answer(answers.first(live.topic("zed", session, "reply")), session)

    try:
        one_request()
        # The worker is alive and serving...
        sender.publish(live.topic("zed", "after"), encode({"message": "still there?"}), qos=1)
        check_answer(answers.first(live.topic("zed", "after", "reply")), "after")
        live.wait_idle()
        # ... and no request got a second answer: the worker answers a marker after whatever
        # it published before, so a second answer has arrived by the time the marker's has.
        sender.publish(live.topic("zed", "marker"), encode({"message": "marker"}), qos=1)
        check_answer(answers.first(live.topic("zed", "marker", "reply")), "marker")
        extra = {s: n for s in sent if (n := len(answers.by_topic[live.topic("zed", s, "reply")])) != 1}
        assert extra == {}
        assert live.stop_codes == [] and live.transport.connects == 1
    finally:
        sender.disconnect()
        sender.loop_stop()
        answers.close()
