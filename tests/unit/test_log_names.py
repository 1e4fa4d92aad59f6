"""How logs name a request and an invalid topic (protocol/messages.py ``log_ref``,
``log_text``): by the id the client sent or the ``h-…`` key its reply carries, so that grep
finds it; escaped and cut, so that a client cannot forge a log line. The same through the
service: tests/broker/test_delivery_rules.py."""

from __future__ import annotations

import asyncio

from loguru import logger

from devtools.fakes import Harness
from worker.protocol.messages import log_ref, log_text


def test_a_plain_id_is_logged_as_sent() -> None:
    for key in ("r1", "3f2a9c01-de4b-4c1e-9a7e-0c5b8d2f6a11", "h-0123456789abcdef01234567-42", "web-1a2b:3"):
        assert log_ref(key) == key
    assert log_ref(None) == "-"


def test_anything_else_is_quoted_and_escaped_so_it_cannot_forge_a_line() -> None:
    forged = "x\n2026-01-01 00:00:00.000 | ERROR    | worker.server: forged"
    shown = log_ref(forged)
    assert "\n" not in shown and shown.startswith("'x\\n2026")
    assert log_ref("a b") == "'a b'"
    assert log_ref("\x1b[31mred\x1b[0m") == "'\\x1b[31mred\\x1b[0m'"  # no terminal escapes
    assert log_ref("\u202etxt.exe") == "'\\u202etxt.exe'"  # no right-to-left override
    assert log_ref("\u2028") == "'\\u2028'"  # a Unicode line separator
    assert log_ref("it's") == '"it\'s"'
    assert log_ref("café") == "'café'"  # printable: readable as it is, still quoted


def test_a_long_name_is_cut_and_marked() -> None:
    assert log_ref("a" * 64) == "a" * 64
    assert log_ref("a" * 128) == "a" * 64 + "…"
    assert log_text("é" * 200, 128) == repr("é" * 128) + "…"
    assert len(log_ref("\n" * 128)) == 2 * 64 + 2 + 1  # escaped, quoted, marked


def test_the_log_names_requests_by_their_ids_and_invalid_topics_by_their_topic() -> None:
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="INFO", format="{level} {message}")

    async def scenario() -> None:
        h = Harness()
        h.transport.deliver("chat/u/s1/request", {"message": "hi", "requestId": "client-id-7"})
        h.transport.deliver("chat/u/s2/request", {"message": "hi"})
        h.transport.deliver("chat/u/bad topic\n/request", {"message": "hi"})
        await h.run_until(lambda: h.transport.replies("s1") and h.transport.replies("s2"))
        hashed = h.transport.replies("s2")[0]["requestId"]
        assert hashed.startswith("h-")
        # Logged once the answer is taken: after the reply, so waited for.
        await h.run_until(lambda: sum(line.startswith("INFO Replied ") for line in list(lines)) == 2)
        assert any(f"Replied {hashed} of u/s2" in line for line in lines), lines
        # The engine's request id (vLLM logs it) carries the same name.
        assert any("/client-id-7/" in r.request_id for r in h.engine.requests)

    try:
        asyncio.run(scenario())
    finally:
        logger.remove(sink)
    assert any("Replied client-id-7 of u/s1" in line for line in lines), lines
    invalid = [line for line in lines if "invalid topic" in line]
    assert invalid and invalid[0].startswith(
        "WARNING Ignoring a message on an invalid topic 'chat/u/bad topic\\n/request'"
    )


def test_the_warmup_check_sees_the_engine_cores_error_lines() -> None:
    """The lines the H100 warm-up logged came from the engine core process, prefixed."""
    from devtools.warmup_check import warmup_problems

    log = (
        "2026-11-24 22:14:09.000 | INFO     | worker.engine.vllm: Warm-up done in 5.5 s: 18 of 18 steps\n"
        "(EngineCore pid=1386) 2026-11-24 22:14:09.624 | ERROR   | vllm.v1.core.sched.scheduler: Unexpected: "
        "grammar rejected tokens [80813] for request warmup-15-4. Terminating request.\n"
        "2026-11-24 22:14:10.000 | INFO     | worker.server: Serving m as w\n"
    )
    (problem,) = warmup_problems(log)
    assert "grammar rejected tokens" in problem
    assert warmup_problems(log.replace("| ERROR   |", "| INFO    |")) == []


def test_a_device_answer_come_before_the_tools_watch_is_dropped_not_an_invalid_topic() -> None:
    """A restart's broker session delivers a device's late answer at the connect, before the
    tools subscribe their response topic: acknowledged and dropped as an answer no call waits
    for, not taken for a request on an invalid topic. Other invalid topics are still named."""
    from worker.protocol.topics import tool_responses_topic

    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="DEBUG", format="{level} {message}")

    async def scenario() -> None:
        h = Harness()
        answers = tool_responses_topic(h.service.config.mqtt.topic_prefix, h.service.worker_id)
        late = h.transport.deliver(answers, {"ok": True})
        h.transport.deliver("chat/_tools/another-worker/responses", {"ok": True})
        h.transport.deliver("chat/u/s1/request", {"message": "hi", "requestId": "after"})
        await h.run_until(lambda: h.transport.replies("s1"))
        assert late in h.transport.acked

    try:
        asyncio.run(scenario())
    finally:
        logger.remove(sink)
    dropped = [line for line in lines if line.startswith("DEBUG Dropping a device answer on chat/_tools/")]
    assert len(dropped) == 1 and "that no call waits for" in dropped[0], lines
    invalid = [line for line in lines if "invalid topic" in line]
    assert len(invalid) == 1 and "another-worker" in invalid[0], invalid
