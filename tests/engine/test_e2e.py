"""End to end: a real mosquitto, ``python -m worker`` as a subprocess on the real vLLM CPU
engine with the generated tiny model, and plain MQTT clients. One worker serves every test
here (an engine start costs ~50 s); each test uses its own sessions."""

from __future__ import annotations

import itertools
import json
import re
import time
import uuid
from typing import Any

import jsonschema
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import Client, Received
from devtools.waiting import PATIENCE, eventually
from devtools.worker_process import BLOCK_SIZE, WorkerProcess, gauge

pytestmark = pytest.mark.e2e


def new_session() -> str:
    return "s-" + uuid.uuid4().hex[:12]


def reply_of(client: Client, user: str, session: str, timeout: float = PATIENCE) -> dict[str, Any]:
    data: dict[str, Any] = client.wait_topic(f"chat/{user}/{session}/reply", timeout).json()
    return data


def stats_of(message: Received) -> dict[str, Any]:
    data: dict[str, Any] = message.json()
    return data


def latest_stats(client: Client, after: float = 0.0) -> dict[str, Any]:
    return stats_of(
        client.wait_for(
            lambda m: m.topic == "chat/_worker/shared/stats" and stats_of(m)["timestamp"] > after, timeout=PATIENCE
        )
    )


def test_three_turns_in_order_with_prefix_cache(shared_worker: WorkerProcess, client: Client) -> None:
    before = latest_stats(client)
    session = new_session()
    topic = f"chat/alice/{session}/request"
    system = "You are a helpful assistant who answers briefly. " * 4
    turns = [
        "Hello, who are you and what can you do for me today?",
        "Tell me more about the weather in the mountains in winter.",
        "And what should I pack for a week of hiking there?",
    ]
    client.publish(topic, {"sessionId": session, "message": turns[0], "maxTokens": 32, "systemPrompt": system})
    for message in turns[1:]:
        client.publish(topic, {"sessionId": session, "message": message, "maxTokens": 32})
    replies = [reply_of(client, "alice", session) for _ in turns]
    for reply in replies:
        assert "error" not in reply, reply
        assert reply["sessionId"] == session and reply["finishReason"] in ("stop", "length")
        assert set(reply["usage"]) == {"promptTokens", "completionTokens", "cachedTokens"}
        # vLLM keeps request stats (the worker's engine logs them): its own queue and prefill
        # times come with every reply, parts of the TTFT.
        latency = reply["latency"]
        assert set(latency) == {"queueMs", "ttftMs", "totalMs", "engineQueueMs", "prefillMs"}
        assert 0 < reply["usage"]["completionTokens"] <= 32
        assert latency["ttftMs"] <= latency["totalMs"]
        assert latency["engineQueueMs"] >= 0 and latency["prefillMs"] > 0
        assert latency["queueMs"] + latency["engineQueueMs"] + latency["prefillMs"] <= latency["ttftMs"] + 1
    prompts = [r["usage"]["promptTokens"] for r in replies]
    assert prompts[0] < prompts[1] < prompts[2], prompts  # in order: each turn carries the last
    for previous, current in itertools.pairwise(replies):
        reused = previous["usage"]["promptTokens"] // BLOCK_SIZE * BLOCK_SIZE
        assert current["usage"]["cachedTokens"] >= reused, (previous["usage"], current["usage"])
    stats = latest_stats(client, after=time.time())
    assert stats["processed"] >= before["processed"] + 3
    assert stats["cachedTokensTotal"] >= before["cachedTokensTotal"] + replies[2]["usage"]["cachedTokens"]
    assert stats["prefixCacheHitRateTotal"] > 0


def test_eight_sessions_at_once_are_batched(shared_worker: WorkerProcess, client: Client) -> None:
    sessions = [new_session() for _ in range(8)]
    started = time.time()
    for turn in range(2):
        for session in sessions:
            client.publish(
                f"chat/bob/{session}/request",
                {
                    "message": f"turn {turn} of {session}: tell me a long story",
                    "maxTokens": 48,
                    "requestId": f"{session}-{turn}",
                },
            )
    order: dict[str, list[str]] = {s: [] for s in sessions}
    for _ in range(16):
        message = client.wait_for(lambda m: m.topic.startswith("chat/bob/") and m.topic.endswith("/reply"))
        reply = message.json()
        assert "error" not in reply, reply
        order[reply["sessionId"]].append(reply["requestId"])
    assert order == {s: [f"{s}-0", f"{s}-1"] for s in sessions}
    # vLLM's own scheduler statistics: more than one request in the running batch at once, in
    # one of the reports from the first request to one published after the last reply.
    last = latest_stats(client, after=time.time())
    reports = [stats_of(m) for m in client.received(lambda m: m.topic == "chat/_worker/shared/stats")]
    most_running = max(s["maxRunning"] for s in [*reports, last] if s["timestamp"] >= started)
    assert most_running > 1, reports


def test_stream_deltas_add_up_to_the_reply(shared_worker: WorkerProcess, client: Client) -> None:
    session = new_session()
    client.publish(
        f"chat/carol/{session}/request",
        {"message": "stream this please", "maxTokens": 24, "stream": True, "requestId": "r-stream"},
    )
    reply = reply_of(client, "carol", session)
    # Every delta was published before the reply, so has arrived before it.
    deltas = [m.json() for m in client.received(lambda m: m.topic == f"chat/carol/{session}/stream")]
    assert deltas and all(d["requestId"] == "r-stream" for d in deltas)
    assert [d["seq"] for d in deltas] == list(range(len(deltas)))
    assert "".join(d["delta"] for d in deltas).strip() == reply["reply"].strip()


def test_cancel_aborts_and_does_not_store_the_turn(shared_worker: WorkerProcess, client: Client) -> None:
    session = new_session()
    topic = f"chat/dave/{session}/request"
    client.publish(topic, {"message": "go on forever", "maxTokens": 1000, "stream": True, "requestId": "long"})
    client.wait_topic(f"chat/dave/{session}/stream")  # generating now
    client.publish(f"chat/dave/{session}/control", {"action": "cancel", "requestId": "long"})
    cancelled = reply_of(client, "dave", session)
    assert cancelled["requestId"] == "long" and cancelled["finishReason"] == "cancelled"
    assert cancelled["usage"]["completionTokens"] < 1000
    # The same message again: had the cancelled turn been stored, the prompt would be longer.
    client.publish(topic, {"message": "go on forever", "maxTokens": 8, "requestId": "again"})
    again = reply_of(client, "dave", session)
    assert again["usage"]["promptTokens"] == cancelled["usage"]["promptTokens"]


def test_a_reply_not_streamed_is_read_at_its_end_and_a_cancel_still_answers_with_its_text(
    shared_worker: WorkerProcess, client: Client, shared_metrics_port: int
) -> None:
    """A reply nobody streams is vLLM's final output only (FINAL_ONLY): its time to the first
    token is still the engine's, not the end's; and a cancel while it runs still answers with
    what was generated until then."""
    session = new_session()
    topic = f"chat/erin/{session}/request"
    client.publish(topic, {"message": "count slowly", "maxTokens": 48, "requestId": "whole", "temperature": 0})
    whole = reply_of(client, "erin", session)
    assert "error" not in whole, whole
    if whole["usage"]["completionTokens"] > 8:
        assert whole["latency"]["ttftMs"] < whole["latency"]["totalMs"] - 1, whole["latency"]
    # The shared worker's engine idle first (an earlier test's request may still be ending),
    # so that a running request below is this one.
    eventually(lambda: gauge(shared_metrics_port, "engine_running_requests") == 0, "the shared engine idle")
    # As long as a request may ask (max_tokens_limit): far longer than the time between
    # seeing it run and the cancel's arrival.
    client.publish(topic, {"message": "go on forever", "maxTokens": 1024, "requestId": "long"})
    reply_topic = f"chat/erin/{session}/reply"

    def running() -> bool:
        # Generating now: vLLM's scheduler counts it running (its tokens come only at the end),
        # read from the worker's metrics at every engine step, not its once-a-second stats.
        early = client.received(lambda m: m.topic == reply_topic and m.json().get("requestId") == "long")
        assert not early, f"answered before the cancel: {early[0].json()}"
        return gauge(shared_metrics_port, "engine_running_requests") > 0

    eventually(running, "the long request running in the engine")
    client.publish(f"chat/erin/{session}/control", {"action": "cancel", "requestId": "long"})
    cancelled = reply_of(client, "erin", session)
    assert cancelled["requestId"] == "long" and cancelled["finishReason"] == "cancelled", cancelled
    assert 0 < cancelled["usage"]["completionTokens"] < 1024, cancelled["usage"]


def test_reset_clears_history(shared_worker: WorkerProcess, client: Client) -> None:
    session = new_session()
    topic = f"chat/erin/{session}/request"
    client.publish(topic, {"message": "first message", "maxTokens": 8})
    first = reply_of(client, "erin", session)
    client.publish(topic, {"message": "second message", "maxTokens": 8})
    assert reply_of(client, "erin", session)["usage"]["promptTokens"] > first["usage"]["promptTokens"]
    client.publish(f"chat/erin/{session}/control", {"action": "reset"})
    assert reply_of(client, "erin", session) == {"sessionId": session, "action": "reset", "ok": True}
    client.publish(topic, {"message": "first message", "maxTokens": 8, "requestId": "after-reset"})
    assert reply_of(client, "erin", session)["usage"]["promptTokens"] == first["usage"]["promptTokens"]


def test_repeated_request_is_answered_from_history(shared_worker: WorkerProcess, client: Client) -> None:
    session = new_session()
    payload = {"message": "only once", "maxTokens": 8, "requestId": "dup-1"}
    client.publish(f"chat/frank/{session}/request", payload)
    first = client.wait_topic(f"chat/frank/{session}/reply").payload
    client.publish(f"chat/frank/{session}/request", payload)
    second = client.wait_topic(f"chat/frank/{session}/reply").payload
    assert second == first  # same latency numbers too: not generated again


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (b"{not json", "bad_json"),
        (json.dumps({"message": "x", "sessionId": "someone-else"}).encode(), "invalid_request"),
        (json.dumps({"message": "x", "maxTokens": 5000}).encode(), "invalid_request"),
        (json.dumps({"message": "x", "max_tokens": 5}).encode(), "invalid_request"),
        (json.dumps({"message": "x" * 70000}).encode(), "too_large"),
    ],
)
def test_bad_requests_get_error_replies(
    shared_worker: WorkerProcess, client: Client, payload: bytes, code: str
) -> None:
    session = new_session()
    client.publish(f"chat/gina/{session}/request", payload)
    reply = reply_of(client, "gina", session)
    assert reply["error"]["code"] == code and reply["sessionId"] == session and reply["error"]["message"]


def test_unknown_control_action(shared_worker: WorkerProcess, client: Client) -> None:
    session = new_session()
    client.publish(f"chat/gina/{session}/control", {"action": "explode"})
    assert reply_of(client, "gina", session)["error"]["code"] == "unsupported_action"


def test_invalid_topic_gets_no_reply_and_is_counted(shared_worker: WorkerProcess, client: Client) -> None:
    before = latest_stats(client)["invalidTopics"]
    client.publish("chat/_reserved/s1/request", {"message": "x"})
    client.publish("chat/bad user/s1/request", {"message": "x"})
    # Counted in a stats report: a reply, had there been one, was published before it.
    eventually(lambda: latest_stats(client)["invalidTopics"] >= before + 2, "invalid topics were not counted")
    assert not client.received(lambda m: m.topic.startswith(("chat/_reserved/", "chat/bad user/")))


def test_response_topic_and_correlation_data(shared_worker: WorkerProcess, client: Client) -> None:
    session = new_session()
    own_reply = f"chat/hank/{session}/reply"
    props = Properties(PacketTypes.PUBLISH)
    props.ResponseTopic = own_reply
    props.CorrelationData = b"corr-1"
    client.publish(f"chat/hank/{session}/request", {"message": "hi", "maxTokens": 4}, properties=props)
    reply = client.wait_topic(own_reply)
    assert reply.properties.CorrelationData == b"corr-1"
    # A response topic outside the allow list is not honoured: the reply goes to the session's topic.
    props = Properties(PacketTypes.PUBLISH)
    props.ResponseTopic = "chat/victim/other/reply"
    props.CorrelationData = b"corr-2"
    client.publish(f"chat/hank/{session}/request", {"message": "hi again", "maxTokens": 4}, properties=props)
    redirected = client.wait_topic(own_reply)
    assert redirected.properties.CorrelationData == b"corr-2"
    # Logged with the session only: the topic asked for is the client's text (DEBUG).
    assert f"A ResponseTopic of hank/{session} is not allowed" in shared_worker.log()


def test_logging_is_routed_and_keeps_message_text_out(shared_worker: WorkerProcess, client: Client) -> None:
    session = new_session()
    client.publish(f"chat/ivan/{session}/request", {"message": "a-very-private-sentence", "maxTokens": 4})
    reply_of(client, "ivan", session)
    log = shared_worker.log()
    assert "a-very-private-sentence" not in log
    assert "prefix caching on" in log
    assert "Stats: Processed=" in log
    # vLLM's logging, in this process and in its engine process, goes through loguru's format.
    assert re.search(r"^\S+ \S+ \| INFO +\| vllm\.v1\.engine\.core: ", log, re.M), "engine core log not routed"
    assert re.search(r"^\S+ \S+ \| INFO +\| vllm\.config\.model: ", log, re.M)


def test_the_start_is_told_in_the_log(shared_worker: WorkerProcess) -> None:
    """Each start phase and its duration at the default level (INFO), the broker checked before
    the model load, vLLM's own lines about the load in between (the shared worker logs them at
    --vllm-log-level INFO; test_logs.py checks the default), "Listening" once subscribed, in
    this order. (The heartbeat while the engine starts depends on how long it takes: see
    test_startup.py.)"""
    shared_worker.wait_log("worker.server: Serving ")  # it comes with the SUBACK, maybe after "online"
    log = shared_worker.log()
    expected = [
        r"\| INFO +\| worker\.server: Worker shared \S+ starting: model \S+, broker 127\.0\.0\.1:\d+, store sqlite$",
        r"\| INFO +\| worker\.server: MQTT broker at 127\.0\.0\.1:\d+ accepted the login$",  # before the load
        r"\| INFO +\| worker\.system\.progress: Importing vLLM, torch and transformers$",
        r"worker\.system\.progress: Imported in \d+\.\d s$",
        r"worker\.system\.progress: Loading the tokenizer: \S+$",
        r"worker\.system\.progress: Tokenizer loaded in \d+\.\d s$",
        r"worker\.system\.progress: Starting the engine: vLLM is loading \S+$",
        r"\| INFO +\| vllm\.[\w.]+: Loading weights took ",  # from the engine's process
        r"\| INFO +\| worker\.system\.progress: Engine ready in \d+\.\d s$",
        # The shared worker warms up (--warmup on; auto is off on the CPU backend) before online.
        r"worker\.engine\.vllm: Warming the engine up: (\d+) steps, batch 1 to 4, at most 300 s \(warmup_timeout\)$",
        r"worker\.engine\.vllm: Warm-up done in \d+\.\d s: (\d+) of \1 steps, \d+ requests \(default sampling at "
        r"batch 1 to 4; ",
        r"worker\.transport\.mqtt: MQTT connected to 127\.0\.0\.1:\d+ \(session \w+\)$",
        r"worker\.server: Listening on chat/\+/\+/request, chat/\+/\+/control via 127\.0\.0\.1:\d+$",  # SUBACKed
        r"worker\.server: Serving \S+ as shared via 127\.0\.0\.1:\d+ \(ready \d+\.\d s after start\)$",
    ]
    position = 0
    for pattern in expected:
        found = re.compile(pattern, re.M).search(log, position)
        assert found, f"{pattern!r} not found after position {position} of the log:\n{log[:12000]}"
        position = found.end()


# Structured output. The tiny random model almost never ends a turn by itself (its end-of-turn
# tokens are made rare); a structured reply ends because, once the grammar's JSON is complete,
# only end-of-turn tokens are allowed. So the schema here is bounded: strings have a maxLength,
# the integer a range, the enum fixed strings, no additional properties, and the worker's
# default json_disable_any_whitespace allows no whitespace between tokens. With an unbounded
# string the random model could run to maxTokens mid-string and the JSON would be cut off.
PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad", "calm"]},
    },
    "required": ["name", "age", "mood"],
    "additionalProperties": False,
}


def test_json_schema_replies_are_complete_and_valid(shared_worker: WorkerProcess, client: Client) -> None:
    sessions = [new_session() for _ in range(4)]
    response_format = {"type": "json_schema", "schema": PERSON_SCHEMA}
    for turn in range(2):  # the second turn's prompt holds the first JSON reply in its history
        for i, session in enumerate(sessions):
            client.publish(
                f"chat/kate/{session}/request",
                {
                    "message": f"Describe person {i} as JSON, turn {turn}.",
                    "maxTokens": 96,
                    "temperature": 1.0,
                    "responseFormat": response_format,
                },
            )
        for session in sessions:
            reply = reply_of(client, "kate", session)
            assert "error" not in reply, reply
            assert reply["finishReason"] == "stop", reply  # the grammar closed the JSON before maxTokens
            assert reply["usage"]["completionTokens"] < 96
            data = json.loads(reply["reply"])
            jsonschema.validate(data, PERSON_SCHEMA)


def test_json_object_reply_is_a_json_object(shared_worker: WorkerProcess, client: Client) -> None:
    # {"type": "object"} allows any object, without bound: greedy decoding (temperature 0) of the
    # tiny model closes it at once, deterministically. What is checked is the contract (a
    # complete JSON object, ended by the grammar), not what the model puts in it.
    session = new_session()
    client.publish(
        f"chat/kate/{session}/request",
        {
            "message": "Any JSON object, please.",
            "maxTokens": 64,
            "temperature": 0,
            "responseFormat": {"type": "json_object"},
        },
    )
    reply = reply_of(client, "kate", session)
    assert "error" not in reply and reply["finishReason"] == "stop", reply
    assert isinstance(json.loads(reply["reply"]), dict)


@pytest.mark.parametrize(
    ("schema", "fragment"),
    [
        ({"type": "objekt"}, "not a valid JSON Schema at $.type"),  # refused by the worker
        ({"type": "integer", "multipleOf": 3}, "not supported by xgrammar"),  # valid, refused by vLLM
        ({"$ref": "#/definitions/missing"}, "does not resolve"),  # refused by the worker, before xgrammar
    ],
)
def test_unusable_schema_is_invalid_schema(
    shared_worker: WorkerProcess, client: Client, schema: dict[str, Any], fragment: str
) -> None:
    session = new_session()
    client.publish(
        f"chat/kate/{session}/request",
        {"message": "x", "maxTokens": 16, "responseFormat": {"type": "json_schema", "schema": schema}},
    )
    reply = reply_of(client, "kate", session)
    assert reply["error"]["code"] == "invalid_schema" and fragment in reply["error"]["message"], reply
    # The session and the engine go on.
    client.publish(f"chat/kate/{session}/request", {"message": "and now free text", "maxTokens": 4})
    assert reply_of(client, "kate", session)["finishReason"] == "length"


@pytest.mark.stops_shared_worker
def test_clean_stop_finishes_running_work_and_publishes_offline(
    shared_worker: WorkerProcess, broker: Mosquitto, client: Client
) -> None:
    """Last of all (conftest sorts it there): stops the shared worker with SIGTERM while it generates."""
    watcher = Client(broker.port, ["chat/_worker/shared/status"])
    watcher.wait_for(lambda m: m.payload == b"online", timeout=PATIENCE)
    session = new_session()
    client.publish(f"chat/judy/{session}/request", {"message": "last words", "maxTokens": 200, "stream": True})
    client.wait_topic(f"chat/judy/{session}/stream")  # generating now
    assert shared_worker.stop() == 0
    reply = reply_of(client, "judy", session)  # drained, not dropped
    assert reply["finishReason"] == "length" and reply["usage"]["completionTokens"] == 200
    watcher.wait_for(lambda m: m.payload == b"offline", timeout=PATIENCE)
    watcher.close()
    assert "Stopped (exit code 0)" in shared_worker.log()
