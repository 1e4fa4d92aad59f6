"""The service's own rules, with an engine that fails on demand (no real engine can be made to
fail at a chosen request) and an in-memory transport. Everything else is tested end to end."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from devtools.fakes import Harness, WordRenderer, mentions
from devtools.waiting import PATIENCE
from worker.engine.port import (
    EngineDead,
    EngineError,
    EngineStats,
    EngineTimes,
    StructuredOutput,
    StructuredOutputRejected,
)
from worker.protocol.messages import log_ref
from worker.session import ChatMessage


def test_sessions_run_concurrently_turns_in_order() -> None:
    async def scenario() -> None:
        h = Harness()
        for turn in range(3):
            for session in ("a", "b", "c"):
                h.transport.deliver(
                    f"chat/u/{session}/request",
                    {"message": f"m{turn}", "maxTokens": 5, "requestId": f"{session}{turn}"},
                )
        await h.run_until(lambda: sum(len(h.transport.replies(s)) for s in "abc") == 9)
        for session in "abc":
            assert [r["requestId"] for r in h.transport.replies(session)] == [f"{session}{t}" for t in range(3)]
            prompts = [r["usage"]["promptTokens"] for r in h.transport.replies(session)]
            assert prompts == sorted(prompts) and len(set(prompts)) == 3
        assert h.engine.most_running == 3  # one turn per session at a time, sessions in parallel
        assert sorted(h.transport.acked) == list(range(1, 10))

    asyncio.run(scenario())


def test_engine_error_is_answered_and_engine_death_stops_the_worker() -> None:
    async def scenario() -> None:
        h = Harness()
        h.engine.fail = {"bad": EngineError("boom"), "dead": EngineDead("gone")}
        h.transport.deliver("chat/u/s1/request", {"message": "x", "requestId": "bad", "maxTokens": 3})
        h.transport.deliver("chat/u/s1/request", {"message": "y", "requestId": "ok", "maxTokens": 3})
        h.transport.deliver("chat/u/s2/request", {"message": "z", "requestId": "dead", "maxTokens": 3})
        await h.run_until(lambda: len(h.transport.replies("s1")) == 2 and h.stop_codes)
        bad, ok = h.transport.replies("s1")
        assert bad["error"]["code"] == "engine_error" and "boom" in bad["error"]["message"]
        assert ok["finishReason"] == "length"  # the session goes on after a failed turn
        # A dead engine interrupted the work: no answer, no ack (redelivered after the restart).
        assert h.stop_codes == [1] and h.transport.replies("s2") == []
        assert sorted(h.transport.acked) == [1, 2]

    asyncio.run(scenario())


def test_busy_limits() -> None:
    async def scenario() -> None:
        h = Harness(max_queued_per_session=2, max_pending_requests=4)
        for i in range(4):  # one runs, two queue, the fourth is refused
            h.transport.deliver("chat/u/s1/request", {"message": "x", "requestId": f"q{i}", "maxTokens": 20})
        for i in range(3):  # the pending total is 4: the third here is refused
            h.transport.deliver(f"chat/u/t{i}/request", {"message": "x", "requestId": f"t{i}", "maxTokens": 20})
        await h.run_until(lambda: len(h.transport.replies("s1")) == 4 and h.transport.replies("t2"))
        codes = {r["requestId"]: r.get("error", {}).get("code") for t, r in h.transport.published if "reply" in t}
        assert codes["q3"] == "busy" and codes["t2"] == "busy"
        assert codes["q0"] is None and codes["q2"] is None and codes["t0"] is None

    asyncio.run(scenario())


def test_cancel_queued_and_running_requests() -> None:
    async def scenario() -> None:
        h = Harness()
        h.transport.deliver("chat/u/s1/request", {"message": "long", "requestId": "run", "maxTokens": 500})
        h.transport.deliver("chat/u/s1/request", {"message": "next", "requestId": "queued", "maxTokens": 500})
        await h.run_until(lambda: h.engine.running == 1)
        h.transport.deliver("chat/u/s1/control", {"action": "cancel", "requestId": "queued"})
        h.transport.deliver("chat/u/s1/control", {"action": "cancel", "requestId": "run"})
        h.transport.deliver("chat/u/s1/request", {"message": "after", "requestId": "after", "maxTokens": 2})
        await h.run_until(lambda: len(h.transport.replies("s1")) == 3)
        run, queued, after = h.transport.replies("s1")
        assert (run["requestId"], run["finishReason"]) == ("run", "cancelled")
        assert (queued["requestId"], queued["finishReason"]) == ("queued", "cancelled")
        assert not any(mentions(rid, "queued") for rid in h.engine.started)  # never reached the engine
        # Neither cancelled turn was stored: the prompt is that of a first turn.
        assert (
            after["usage"]["promptTokens"]
            == WordRenderer().render([{"role": "user", "content": "after"}], add_generation_prompt=True).__len__()
        )

    asyncio.run(scenario())


def test_a_cancel_while_the_turn_prepares_its_prompt_is_not_lost() -> None:
    """A cancel that comes after the queued turn started (its prompt being prepared: the
    tokenizer may run in a thread) but before it reached the engine. The chat page cancels
    every pending turn at once: cancelling the running one starts the next, and the next
    one's cancel lands in this window."""

    class HeldRenderer(WordRenderer):
        def __init__(self) -> None:
            self.entered = asyncio.Event()
            self.release = asyncio.Event()

        async def prepare(self, messages: Sequence[ChatMessage], tools: object = None) -> None:
            self.entered.set()
            await self.release.wait()

    async def scenario() -> None:
        h = Harness()
        held = HeldRenderer()
        h.service.turns.renderer = held
        h.transport.deliver("chat/u/s1/request", {"message": "held", "requestId": "held", "maxTokens": 50})
        consumer = asyncio.ensure_future(h.service.consume())
        try:
            await asyncio.wait_for(held.entered.wait(), PATIENCE)
            h.transport.deliver("chat/u/s1/control", {"action": "cancel", "requestId": "held"})

            # The cancel is handled: the held request is marked, not to be generated.
            async def marked() -> None:
                while not any("held" in runtime.cancelled for runtime in h.service._runtime.values()):
                    await asyncio.sleep(0.01)

            await asyncio.wait_for(marked(), PATIENCE)
        finally:
            consumer.cancel()
        held.release.set()
        await h.run_until(lambda: h.transport.replies("s1"))
        reply = h.transport.replies("s1")[0]
        assert (reply["requestId"], reply["finishReason"]) == ("held", "cancelled")
        assert h.engine.started == []

    asyncio.run(scenario())


def test_redelivery_during_generation_is_answered_once() -> None:
    async def scenario() -> None:
        h = Harness()
        payload = {"message": "hello", "maxTokens": 30}  # no requestId: keyed by topic + payload hash
        h.transport.deliver("chat/u/s1/request", payload, mid=7)
        await h.run_until(lambda: h.engine.running == 1)
        h.transport.deliver("chat/u/s1/request", payload, mid=7, dup=True)  # the broker redelivers it
        await h.run_until(lambda: h.transport.replies("s1") and h.transport.acked)  # answered and done
        h.transport.deliver("chat/u/s1/request", payload, mid=7, dup=True)  # and again, after the answer
        await h.run_until(lambda: len(h.transport.replies("s1")) == 2)
        first, again = h.transport.replies("s1")
        assert first == again and first["requestId"].startswith("h-")
        assert len(h.engine.started) == 1
        assert h.transport.acked == [7, 7, 7]

    asyncio.run(scenario())


def test_invalid_and_retained_messages_are_acked_without_reply() -> None:
    async def scenario() -> None:
        h = Harness()
        h.transport.deliver("chat/_x/s1/request", {"message": "x"})
        h.transport.deliver("chat/u/s 1/request", {"message": "x"})
        await h.run_until(lambda: len(h.transport.acked) == 2)
        assert h.transport.published == []
        assert h.service.stats.invalid_topics == 2

    asyncio.run(scenario())


@pytest.mark.parametrize(("message", "code"), [("word " * 5000, "too_long"), ("x", "invalid_request")])
def test_admission_errors(message: str, code: str) -> None:
    async def scenario() -> None:
        h = Harness()
        h.transport.deliver("chat/u/s1/request", {"message": message, "maxTokens": 5000 if code != "too_long" else 5})
        await h.run_until(lambda: h.transport.replies("s1"))
        assert h.transport.replies("s1")[0]["error"]["code"] == code
        assert h.engine.started == []

    asyncio.run(scenario())


def test_message_and_reply_text_are_logged_at_debug_only() -> None:
    from loguru import logger

    lines: dict[str, list[str]] = {"DEBUG": [], "INFO": []}
    sinks = [logger.add(lambda m, k=k: lines[k].append(str(m)), level=k, format="{message}") for k in lines]

    async def scenario() -> None:
        h = Harness()
        h.engine.script["s1"] = ["a-private-", "reply"]
        h.transport.deliver("chat/u/s1/request", {"message": "a-private-sentence"})
        await h.run_until(lambda: h.transport.replies("s1"))
        assert h.transport.replies("s1")[0]["reply"] == "a-private-reply"

    try:
        asyncio.run(scenario())
    finally:
        for sink in sinks:
            logger.remove(sink)
    assert any("a-private-sentence" in line for line in lines["DEBUG"])
    assert any("a-private-reply" in line for line in lines["DEBUG"])
    assert not any("a-private" in line for line in lines["INFO"]), lines["INFO"]


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def test_a_requests_schemas_are_checked_in_its_turn_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checking JSON Schemas costs CPU in proportion to their size (seconds for one payload of
    them): each request's are checked on a thread, in its turn, and not at all where the
    request is refused anyway (tool calling not set up)."""
    import threading

    from worker.core import turns

    checked: list[tuple[str | None, bool]] = []

    def recording(request: Any) -> None:
        checked.append((request.request_id, threading.current_thread() is threading.main_thread()))
        real(request)

    real = turns.check_request_schemas
    monkeypatch.setattr(turns, "check_request_schemas", recording)

    async def scenario() -> None:
        h = Harness()  # no tool calling
        tool = {"type": "function", "function": {"name": "t", "parameters": {"type": "object"}}}
        h.transport.deliver("chat/u/s1/request", {"message": "x", "requestId": "tools", "tools": [tool]})
        fine = {"type": "json_schema", "schema": SCHEMA}
        h.transport.deliver("chat/u/s1/request", {"message": "x", "requestId": "json", "responseFormat": fine})
        bad = {"type": "json_schema", "schema": {"type": "objekt"}}
        h.transport.deliver("chat/u/s1/request", {"message": "x", "requestId": "bad", "responseFormat": bad})
        h.transport.deliver("chat/u/s1/request", {"message": "x", "requestId": "free"})
        await h.run_until(lambda: len(h.transport.replies("s1")) == 4)
        replies = {r["requestId"]: r for r in h.transport.replies("s1")}
        assert replies["tools"]["error"]["code"] == "invalid_request"
        assert "tool calling is not set up" in replies["tools"]["error"]["message"]
        assert replies["bad"]["error"]["code"] == "invalid_schema" and "$.type" in replies["bad"]["error"]["message"]
        assert "reply" in replies["json"] and "reply" in replies["free"]

    asyncio.run(scenario())
    assert checked == [("json", False), ("bad", False)]


def test_response_format_reaches_the_engine_and_schema_errors_are_invalid_schema() -> None:
    async def scenario() -> None:
        h = Harness()
        # A JSON string may contain "</think>": structured replies are not split as reasoning.
        h.engine.script = {"json": ['{"n": 1, "s": "a</think>', 'b"}'], "free": ["a</think>", "b"]}
        h.transport.deliver(
            "chat/u/s1/request",
            {"message": "x", "requestId": "json", "responseFormat": {"type": "json_schema", "schema": SCHEMA}},
        )
        h.transport.deliver(
            "chat/u/s1/request",
            {"message": "x", "requestId": "obj", "maxTokens": 2, "responseFormat": {"type": "json_object"}},
        )
        h.transport.deliver("chat/u/s1/request", {"message": "x", "requestId": "free"})
        bad = {"type": "json_schema", "schema": {"type": "objekt"}}
        h.transport.deliver("chat/u/s1/request", {"message": "x", "requestId": "bad", "responseFormat": bad})
        unsupported = {"type": "json_schema", "schema": {"type": "integer", "multipleOf": 3}}
        h.engine.fail = {"refused": StructuredOutputRejected("features not supported by xgrammar")}
        h.transport.deliver(
            "chat/u/s1/request", {"message": "x", "requestId": "refused", "responseFormat": unsupported}
        )
        await h.run_until(lambda: len(h.transport.replies("s1")) == 5)
        replies = {r["requestId"]: r for r in h.transport.replies("s1")}
        ids = {log_ref(key): key for key in ("json", "obj", "free", "bad", "refused")}
        structured = {ids[r.request_id.split("/")[-2]]: r.sampling.structured for r in h.engine.requests}
        assert structured == {
            "json": StructuredOutput(json_schema=SCHEMA),
            "obj": StructuredOutput(json_schema=None),
            "free": None,
            "refused": StructuredOutput(json_schema=unsupported["schema"]),
        }  # "bad" never reached the engine
        assert json.loads(replies["json"]["reply"]) == {"n": 1, "s": "a</think>b"}
        assert replies["free"]["reply"] == "b"  # free text: the think block is removed
        assert replies["bad"]["error"]["code"] == "invalid_schema" and "$.type" in replies["bad"]["error"]["message"]
        assert replies["refused"]["error"]["code"] == "invalid_schema"
        assert "xgrammar" in replies["refused"]["error"]["message"]
        assert h.service.stats.errors_by_code == {"invalid_schema": 2}

    asyncio.run(scenario())


@pytest.mark.parametrize("interval_ms", [0, 50])
def test_stream_deltas_are_gathered_per_interval(interval_ms: float) -> None:
    async def scenario() -> None:
        h = Harness(generation={"stream_interval_ms": interval_ms})
        sent_at: list[float] = []  # when each delta was published
        publish = h.transport.publish

        def timed(topic: str, payload: bytes, **kwargs: Any) -> Any:
            if topic.endswith("/stream"):
                sent_at.append(time.monotonic())
            return publish(topic, payload, **kwargs)

        h.transport.publish = timed  # type: ignore[method-assign]
        h.transport.deliver("chat/u/s1/request", {"message": "x", "maxTokens": 40, "stream": True, "requestId": "r"})
        await h.run_until(lambda: h.transport.replies("s1"))
        deltas = [p for t, p in h.transport.published if t.endswith("/s1/stream")]
        reply = h.transport.replies("s1")[0]
        assert [d["seq"] for d in deltas] == list(range(len(deltas)))
        assert "".join(d["delta"] for d in deltas) == reply["reply"]
        assert deltas[0]["delta"] == "w0 "  # the first token goes out at once: the client's TTFT
        if interval_ms == 0:
            assert len(deltas) == 40  # one per engine step
        else:
            # At most one delta per interval, the last (the rest, at the end) excepted; how
            # many there are depends on how fast the tokens come, which a loaded machine slows.
            gaps = [later - earlier for earlier, later in itertools.pairwise(sent_at[:-1])]
            assert len(deltas) >= 2 and min(gaps, default=1.0) >= interval_ms / 1000, gaps

    asyncio.run(scenario())


def test_reasoning_budget_include_reasoning_and_history() -> None:
    """A renderer whose prompt opens <think>: the fake engine's words are all reasoning."""

    async def scenario() -> None:
        h = Harness(generation={"max_reasoning_tokens": 8, "stream_interval_ms": 0})
        renderer = WordRenderer()
        renderer.opens_reasoning = True
        h.service.turns.renderer = renderer
        h.engine.script = {"closes": ["think", "ing</th", "ink>", "\n\nthe", " answer"]}
        send = h.transport.deliver
        send("chat/u/s1/request", {"message": "a", "requestId": "hidden", "maxTokens": 40, "stream": True})
        send(
            "chat/u/s1/request",
            {"message": "b", "requestId": "shown", "maxTokens": 40, "maxReasoningTokens": 5, "includeReasoning": True},
        )
        send("chat/u/s1/request", {"message": "c", "requestId": "capped", "maxTokens": 40, "maxReasoningTokens": 99})
        send("chat/u/s1/request", {"message": "d", "requestId": "closes", "includeReasoning": True, "stream": True})
        send("chat/u/s1/request", {"message": "e f", "requestId": "next", "maxTokens": 3})
        await h.run_until(lambda: len(h.transport.replies("s1")) == 5)
        replies = {r["requestId"]: r for r in h.transport.replies("s1")}

        hidden = replies["hidden"]
        assert hidden["finishReason"] == "reasoning_budget" and hidden["reply"] == "" and "reasoning" not in hidden
        assert hidden["usage"]["reasoningTokens"] == hidden["usage"]["completionTokens"] == 8
        shown = replies["shown"]
        assert shown["finishReason"] == "reasoning_budget"
        assert shown["reasoning"] == "w0 w1 w2 w3 w4" and shown["usage"]["reasoningTokens"] == 5
        assert replies["capped"]["usage"]["reasoningTokens"] == 8  # the request's 99, capped by the config
        closes = replies["closes"]
        assert closes["finishReason"] == "stop" and closes["reply"] == "the answer"
        assert closes["reasoning"] == "thinking" and closes["usage"]["reasoningTokens"] == 3
        # The 3-token generation of "next" never closed its think block and hit no budget.
        assert replies["next"]["finishReason"] == "length" and replies["next"]["usage"]["reasoningTokens"] == 3

        streams: dict[str, list[dict[str, Any]]] = {}
        for topic, payload in h.transport.published:
            if topic.endswith("/s1/stream"):
                streams.setdefault(payload["requestId"], []).append(payload)
        assert "hidden" not in streams  # reasoning only, not asked for: no delta
        assert [d["seq"] for d in streams["closes"]] == list(range(len(streams["closes"])))
        assert "".join(d.get("reasoning", "") for d in streams["closes"]) == "thinking"
        assert "".join(d["delta"] for d in streams["closes"]).strip() == "the answer"
        assert all(d["delta"] == "" for d in streams["closes"] if "reasoning" in d)

        # The history holds the answers only: the last prompt is the rendering of the turns
        # with their replies, none of the reasoning.
        history = [
            (m, replies[k]["reply"]) for m, k in zip("abcd", ["hidden", "shown", "capped", "closes"], strict=True)
        ]
        messages = [
            x for m, r in history for x in ({"role": "user", "content": m}, {"role": "assistant", "content": r})
        ]
        expected = renderer.render([*messages, {"role": "user", "content": "e f"}], add_generation_prompt=True)
        assert replies["next"]["usage"]["promptTokens"] == len(expected)

    asyncio.run(scenario())


def test_the_reasoning_budget_is_exact_when_the_engine_hands_over_several_tokens_at_once() -> None:
    """vLLM gives a reader that lags behind several steps' tokens in one update (seen: 24 at
    once for a budget of 10 on a loaded machine): the generation still stops at the budget,
    with the reasoning and the counts of the tokens within it."""

    async def scenario() -> None:
        h = Harness(generation={"max_reasoning_tokens": 10, "stream_interval_ms": 0})
        renderer = WordRenderer()
        renderer.opens_reasoning = True
        h.service.turns.renderer = renderer
        h.engine.tokens_per_update = 7
        h.transport.deliver(
            "chat/u/s1/request", {"message": "a", "maxTokens": 40, "includeReasoning": True, "stream": True}
        )
        await h.run_until(lambda: len(h.transport.replies("s1")) == 1)
        reply = h.transport.replies("s1")[0]
        assert reply["finishReason"] == "reasoning_budget" and reply["reply"] == ""
        assert reply["reasoning"] == " ".join(f"w{i}" for i in range(10))
        assert reply["usage"]["reasoningTokens"] == reply["usage"]["completionTokens"] == 10
        streamed = [p.get("reasoning", "") for t, p in h.transport.published if t.endswith("/s1/stream")]
        assert "".join(streamed).strip() == reply["reasoning"]

    asyncio.run(scenario())


def test_a_reply_nothing_reads_as_it_comes_is_asked_of_the_engine_at_its_end_only() -> None:
    """A reply that is not streamed and has no thinking budget is read only at its end (vLLM's
    FINAL_ONLY: no output, and no pass of the worker's loop, per token); a stream or a budget
    reads every update. The reply read at its end says the same: its think block ends at the
    close's own token, and its time to the first token is the engine's, not the end's."""

    class CloseRenderer(WordRenderer):
        opens_reasoning = True

        def encode(self, text: str) -> list[int]:
            return [50] if text == "</think>" else super().encode(text)

    async def scenario() -> None:
        h = Harness(generation={"stream_interval_ms": 0})
        h.service.turns.renderer = CloseRenderer()
        h.engine.final_only = True
        deltas = ["think", "ing</th", "ink>", "\n\nthe", " answer"]
        for key in ("at-end", "streamed"):
            h.engine.script[key] = deltas
            h.engine.script_ids[key] = [11, 12, 50, 13, 14]  # the last delta's ids: read at the end, the reply's
        send = h.transport.deliver
        send("chat/u/s1/request", {"message": "a", "requestId": "at-end", "includeReasoning": True})
        send("chat/u/s1/request", {"message": "b", "requestId": "streamed", "stream": True})
        send("chat/u/s1/request", {"message": "c", "requestId": "budget", "maxTokens": 3, "maxReasoningTokens": 2})
        send("chat/u/s1/request", {"message": "d", "requestId": "plain", "maxTokens": 30})
        await h.run_until(lambda: len(h.transport.replies("s1")) == 4)
        replies = {r["requestId"]: r for r in h.transport.replies("s1")}
        incremental = {key: r.incremental for r in h.engine.requests for key in replies if mentions(r.request_id, key)}
        assert incremental == {"at-end": False, "streamed": True, "budget": True, "plain": False}

        at_end, streamed = replies["at-end"], replies["streamed"]
        assert at_end["reply"] == streamed["reply"] == "the answer" and at_end["reasoning"] == "thinking"
        assert at_end["usage"]["reasoningTokens"] == streamed["usage"]["reasoningTokens"] == 3
        assert replies["budget"]["finishReason"] == "reasoning_budget"
        # 30 tokens at 10 ms each, read at the end: the first came ~290 ms before the reply
        # (counted from the engine's start: the session's earlier requests went first).
        latency = replies["plain"]["latency"]
        assert latency["ttftMs"] - latency["queueMs"] < (latency["totalMs"] - latency["queueMs"]) / 2, latency
        assert replies["plain"]["usage"]["completionTokens"] == 30

    asyncio.run(scenario())


def test_a_reply_says_where_its_first_token_waited_in_the_engine() -> None:
    """Where the engine keeps request stats (vLLM does by default), a reply's latency carries
    its time in the engine's own queue and its prefill, and the stats message their queue's
    average; where it keeps none, neither appears (no zeros that would read as measured)."""

    async def scenario() -> None:
        h = Harness()
        h.transport.deliver("chat/u/a/request", {"message": "m", "maxTokens": 3, "requestId": "unsaid"})
        await h.run_until(lambda: len(h.transport.replies("a")) == 1)
        h.engine.engine_times = EngineTimes(queue_s=0.0042, prefill_s=0.0125)
        h.transport.deliver("chat/u/b/request", {"message": "m", "maxTokens": 3, "requestId": "said"})
        await h.run_until(lambda: len(h.transport.replies("b")) == 1)
        unsaid, said = h.transport.replies("a")[0]["latency"], h.transport.replies("b")[0]["latency"]
        assert set(unsaid) == {"queueMs", "ttftMs", "totalMs"}
        assert said["engineQueueMs"] == 4.2 and said["prefillMs"] == 12.5
        report = json.loads(h.service.stats.report(EngineStats(), sessions=2, pending=0).to_json())
        assert report["requests"] == 2 and report["avgEngineQueueMs"] == 4.2  # the reply whose engine said
        quiet = json.loads(h.service.stats.report(EngineStats(), sessions=2, pending=0).to_json())
        assert "avgEngineQueueMs" not in quiet and "avgQueueMs" not in quiet

    asyncio.run(scenario())


def test_stream_of_a_model_that_does_not_think_is_not_held_back() -> None:
    """The reasoning split never delays an answer: each delta is published before the engine
    produces the next token, except a possible "<think>" at the start, held only while it
    could still be one."""

    async def scenario() -> None:
        h = Harness(generation={"stream_interval_ms": 0})
        h.engine.script = {
            "plain": ["Hello", " world", "!"],
            "blank": ["\n", "\n", "Hi"],
            "tag": ["<thi", "nk>", "hmm", "</think>", "Yes"],
            "text": ["<thi", "s is text", "."],
        }

        def deltas(session: str) -> list[dict[str, Any]]:
            return [p for t, p in h.transport.published if t.endswith(f"/{session}/stream")]

        published_before: dict[str, list[list[str]]] = {}

        def before_step(session: str, step: int) -> None:
            published_before.setdefault(session, []).append([d.get("reasoning") or d["delta"] for d in deltas(session)])

        h.engine.before_step = before_step
        for session in h.engine.script:
            request = {"message": "x", "requestId": session, "stream": True, "includeReasoning": True}
            h.transport.deliver(f"chat/u/{session}/request", request)
        await h.run_until(lambda: all(h.transport.replies(s) for s in h.engine.script))
        replies = {s: h.transport.replies(s)[0] for s in h.engine.script}

        assert published_before["plain"] == [[], ["Hello"], ["Hello", " world"]]  # the first with the first token
        assert published_before["blank"] == [[], ["\n"], ["\n", "\n"]]  # blanks are not held either
        assert replies["plain"]["reply"] == "Hello world!" and "reasoning" not in replies["plain"]
        assert "reasoningTokens" not in replies["plain"]["usage"]
        # "<thi" may open a think block: held for one token; "<think>" did.
        assert published_before["tag"] == [[], [], [], ["hmm"], ["hmm"]]
        assert [(d["delta"], d.get("reasoning")) for d in deltas("tag")] == [("", "hmm"), ("Yes", None)]
        assert replies["tag"]["reply"] == "Yes" and replies["tag"]["reasoning"] == "hmm"
        assert replies["tag"]["usage"]["reasoningTokens"] == 4
        # "<this" cannot: released whole as soon as that is known.
        assert published_before["text"] == [[], [], ["<this is text"]]
        assert replies["text"]["reply"] == "<this is text." and "reasoning" not in replies["text"]

    asyncio.run(scenario())


def test_a_turns_reply_is_remembered_with_the_ids_it_was_generated_as() -> None:
    """The renderer hears each kept reply with its generated ids (the next prompt may encode
    the reply as them, which the prefix cache holds)."""

    class Recording(WordRenderer):
        def __init__(self) -> None:
            self.replies: list[tuple[str, list[int]]] = []

        def remember_reply(self, text: str, ids: Sequence[int]) -> None:
            self.replies.append((text, list(ids)))

    async def scenario() -> None:
        h = Harness()
        recording = Recording()
        h.service.turns.renderer = recording
        h.engine.tokens_per_update = 2  # updates that carry their ids
        h.transport.deliver("chat/u/s1/request", {"message": "x", "requestId": "a", "maxTokens": 4})
        await h.run_until(lambda: h.transport.replies("s1"))
        reply = h.transport.replies("s1")[0]
        assert recording.replies == [(reply["reply"], [0, 1, 2, 3])], (recording.replies, reply)

    asyncio.run(scenario())


def test_the_next_turn_starts_with_the_first_prompt_and_the_ids_the_reply_was_generated_as(tiny_model: Path) -> None:
    """What the engine's prefix cache holds after the first turn: its prompt, then the ids the
    model generated. The second turn's prompt begins with exactly those, though the
    tokenizer would split the reply's text otherwise."""
    from worker.engine.tokenizer import ChatTokenizer

    renderer = ChatTokenizer(str(tiny_model))
    reply = "Forty-two apples, I think."
    generated = [i for ch in reply for i in renderer.encode(ch)]  # one id per character
    assert generated != renderer.encode(reply)

    async def scenario() -> None:
        h = Harness()
        h.service.turns.renderer = renderer
        h.engine.script["first"] = [reply[:10], reply[10:]]
        h.engine.script_ids["first"] = [*generated, *renderer.stop_token_ids[:1]]
        h.transport.deliver("chat/u/s1/request", {"message": "How many apples?", "requestId": "first"})
        await h.run_until(lambda: h.transport.replies("s1"))
        h.transport.deliver("chat/u/s1/request", {"message": "And pears?", "requestId": "second", "maxTokens": 2})
        await h.run_until(lambda: len(h.transport.replies("s1")) == 2)
        assert h.transport.replies("s1")[0].get("reply") == reply
        one, two = (request.prompt_token_ids for request in h.engine.requests)
        assert two[: len(one) + len(generated)] == [*one, *generated]

    asyncio.run(scenario())


def test_a_burst_reaches_the_engine_while_the_rest_of_it_is_still_dispatched() -> None:
    """Messages taken from the inbox together are not all dispatched before the first turn goes
    on: a burst's first turns reach the engine while later messages still wait for dispatch."""
    from worker.core.service import DISPATCH_SLICE, PREFETCH

    async def scenario() -> None:
        h = Harness(max_requests_per_user_per_minute=0)
        burst = PREFETCH
        for n in range(burst):
            h.transport.deliver(f"chat/u/s{n}/request", {"message": f"m{n}", "maxTokens": 1, "requestId": f"r{n}"})
        dispatched: list[int] = []
        dispatch = h.service.dispatch

        async def counted(message: Any) -> None:
            await dispatch(message)
            dispatched.append(1)

        h.service.dispatch = counted  # type: ignore[method-assign]
        at_first_start: list[int] = []
        generate = h.engine.generate

        def recorded(request: Any) -> Any:
            if not at_first_start:
                at_first_start.append(len(dispatched))
            return generate(request)

        h.engine.generate = recorded  # type: ignore[method-assign]
        await h.run_until(lambda: len(h.transport.acked) == burst)
        assert at_first_start and at_first_start[0] <= 2 * DISPATCH_SLICE < burst

    asyncio.run(scenario())
