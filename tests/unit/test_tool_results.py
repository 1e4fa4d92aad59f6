"""Worker tool results at the boundary (issue 30, points 3 and 5): any text or bytes a device
or an MCP server answers becomes a result the model gets, cut to tools.max_tool_result_bytes
on a character boundary before its tokens are counted, with the cut said, and repaired where
it is not valid Unicode (a lone surrogate, bytes that are not UTF-8): never an internal_error.
Hypothesis runs arbitrary text and bytes through the helpers and through the tool loop (the
service on the fake engine, vLLM's hermes parser, a fake toolbox)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devtools.fakes import FakeToolbox, Harness
from worker.engine.tokenizer import ChatTokenizer
from worker.engine.vllm import tool_support
from worker.store.port import encode_state, parse_session
from worker.tools.mcp import result_outcome
from worker.tools.port import ToolOutcome, WorkerTool, cut_utf8, error_message, safe_text, utf8_size

SENSOR = WorkerTool("sensor_read", "Read the room sensor", None, ("*",), source="mqtt")
# Text as a hostile tool writes it: any code point, lone surrogates and control tokens included.
ANY_CHAR = st.one_of(
    st.characters(codec=None, categories=None),
    st.sampled_from(["\ud800", "\udfff", "\udc80", "é", "数", "😀", "\x00"]),
)
PIECE = st.one_of(st.text(alphabet=ANY_CHAR, max_size=40), st.sampled_from(["<|im_end|>", "</tool_response>", "word "]))
ANY_TEXT = st.lists(PIECE, max_size=12).map("".join)
# The content kinds and the keys of an MCP tools/call result, for values of any shape under them.
MCP_KINDS = ["text", "image", "audio", "resource", "resource_link"]
MCP_KEYS = ["content", "type", "text", "data", "mimeType", "resource", "blob", "uri", "structuredContent", "isError"]


def call(name: str, arguments: dict[str, Any] | None = None) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments or {})}}}\n</tool_call>'


def make(tokenizer: ChatTokenizer, box: FakeToolbox, **kwargs: Any) -> Harness:
    return Harness(tools=tool_support("auto", tokenizer, "tiny"), toolbox=box, **kwargs)


def ask(h: Harness, session: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
    async def scenario() -> None:
        h.transport.deliver(f"chat/u/{session}/request", payload)
        await h.run_until(lambda: len(h.transport.replies(session)) == 1, 10)

    asyncio.run(scenario())
    return h.transport.replies(session)


def encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@given(text=ANY_TEXT, limit=st.integers(1, 400))
@settings(max_examples=300, derandomize=True)
def test_a_text_cut_is_the_longest_start_that_fits_on_a_character_boundary(text: str, limit: int) -> None:
    cut, was_cut = cut_utf8(text, limit)
    whole = safe_text(text)
    assert encodes(cut) and encodes(whole)
    assert whole.startswith(cut)
    size = len(cut.encode())
    assert size <= limit
    assert was_cut == (cut != whole)
    if was_cut:  # the next character would not have fitted
        assert size + len(whole[len(cut)].encode()) > limit
    assert utf8_size(text) == len(whole.encode())


@given(data=st.binary(max_size=300), limit=st.integers(1, 400))
@settings(max_examples=300, derandomize=True)
def test_bytes_are_cut_before_they_are_decoded_and_never_raise(data: bytes, limit: int) -> None:
    cut, was_cut = cut_utf8(data, limit)
    assert encodes(cut)
    assert was_cut == (len(data) > limit)
    assert cut == data[:limit].decode("utf-8", errors="replace") or (
        was_cut and data[:limit].decode("utf-8", errors="replace").startswith(cut)
    )


def test_a_character_split_by_the_cut_is_left_out_whole() -> None:
    assert cut_utf8("aé😀".encode(), 2) == ("a", True)
    assert cut_utf8("aé😀".encode(), 5) == ("aé", True)
    assert cut_utf8("aé😀".encode(), 7) == ("aé😀", False)
    assert cut_utf8("a\ud800b", 4) == ("a\ufffd", True)


def test_a_json_rpc_error_message_is_bounded_and_safe() -> None:
    assert error_message("x" * 5000, "f") == "x" * 1000 + "…"
    assert error_message("bad \ud800", "f") == "bad \ufffd"
    for odd in (None, 5, ["a"], {"a": 1}, "", "  "):
        assert error_message(odd, "fallback") == "fallback"


@given(text=ANY_TEXT, error=st.booleans())
@settings(max_examples=40, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_any_result_text_becomes_a_result_the_turn_stores_and_replies_with(
    tokenizer: ChatTokenizer, text: str, error: bool
) -> None:
    box = FakeToolbox(SENSOR)
    box.answer = lambda name, args: ToolOutcome(text, "error" if error else "ok")
    h = make(tokenizer, box, tools_section={"max_tool_result_bytes": 256, "max_tool_result_tokens": 16})
    h.engine.rounds["p1"] = [call("sensor_read"), "done"]
    (reply,) = ask(h, "p", {"message": "Read", "requestId": "p1", "workerTools": ["*"]})
    assert "error" not in reply, reply
    assert reply["reply"] == "done" and reply["workerCalls"][0]["outcome"] == ("error" if error else "ok")
    history = h.service.sessions.get("u/p")
    result = next(m["content"] for m in history.turns[-1].messages if m["role"] == "tool")
    assert encodes(result)
    assert safe_text(text).startswith(result.split("\n[The result was cut")[0])
    stored = encode_state(history).encode()  # what the store writes: UTF-8
    assert parse_session("u/p", stored)[1][-1].messages == history.turns[-1].messages


def test_a_long_result_is_cut_in_bytes_first_and_the_cut_is_said(tokenizer: ChatTokenizer) -> None:
    box = FakeToolbox(SENSOR)
    box.answer = lambda name, args: "é" * 100_000  # 200,000 bytes, 1 word
    h = make(tokenizer, box, tools_section={"max_tool_result_bytes": 1001})
    h.engine.rounds["b1"] = [call("sensor_read"), "ok"]
    ask(h, "b", {"message": "Big", "requestId": "b1", "workerTools": ["*"]})
    (turn,) = h.service.sessions.get("u/b").turns
    result = next(m["content"] for m in turn.messages if m["role"] == "tool")
    assert result == "é" * 500 + "\n[The result was cut: it had 200000 bytes; the first 1000 are shown.]"


def test_a_provider_cut_says_the_size_it_had(tokenizer: ChatTokenizer) -> None:
    """A device's answer is cut before it is decoded (DeviceTools): the result says the
    answer's size, and the token cut after it says it too."""
    box = FakeToolbox(SENSOR)
    box.answer = lambda name, args: ToolOutcome("word " * 200, "ok", size=10_000_000)
    h = make(tokenizer, box, tools_section={"max_tool_result_tokens": 16})
    h.engine.rounds["c1"] = [call("sensor_read"), "ok"]
    ask(h, "c", {"message": "Big", "requestId": "c1", "workerTools": ["*"]})
    (turn,) = h.service.sessions.get("u/c").turns
    result = next(m["content"] for m in turn.messages if m["role"] == "tool")
    assert result.count("word") == 16
    assert result.endswith("[The result was cut: it had 10000000 bytes; the first 16 tokens are shown.]")


def test_an_mcp_result_with_a_lone_surrogate_is_repaired_at_the_turn(tokenizer: ChatTokenizer) -> None:
    """MCP over MQTT parses with Python's json, which takes "\\ud800" escapes: the result has
    a lone surrogate, which used to fail the request with internal_error."""
    wire = '{"content": [{"type": "text", "text": "21 \\ud800C"}]}'
    outcome = result_outcome(json.loads(wire))
    assert not encodes(outcome.content)
    box = FakeToolbox(SENSOR)
    box.answer = lambda name, args: outcome
    h = make(tokenizer, box)
    h.engine.rounds["s1"] = [call("sensor_read"), "ok"]
    (reply,) = ask(h, "s", {"message": "Read", "requestId": "s1", "workerTools": ["*"]})
    assert reply["workerCalls"][0]["result"] == "21 \ufffdC", reply


def nested(depth: int) -> list[Any]:
    """A list nested ``depth`` deep, built without recursion."""
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


@given(
    result=st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=8) | st.sampled_from(MCP_KINDS),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(MCP_KEYS), inner, max_size=4),
        max_leaves=12,
    )
)
@settings(max_examples=500, derandomize=True)
def test_any_mcp_result_is_an_outcome_never_an_exception(result: Any) -> None:
    """result_outcome takes the JSON an MCP-over-MQTT server published, of any shape: every
    value is an outcome; one of the wrong shape is ``error`` and says so."""
    outcome = result_outcome(result)
    if not isinstance(result, dict):
        assert outcome == ToolOutcome(
            "Error: the MCP server's answer is not a valid MCP result: it is not a JSON object.", "error"
        )


def test_an_mcp_result_nested_too_deep_to_write_is_an_error_result() -> None:
    """A value Python's json parsed, but too deep for str() or json.dumps where the result is
    read (deeper in the stack than the parse): an ``error`` saying so, not a RecursionError."""
    said = ToolOutcome("Error: the MCP server's answer is not a valid MCP result: it nests too deep.", "error")
    assert result_outcome({"content": [], "structuredContent": nested(100_000)}) == said
    assert result_outcome({"content": [{"type": "text", "text": nested(100_000)}]}) == said


def test_the_tool_loop_counts_a_long_result_off_the_event_loop(tokenizer: ChatTokenizer) -> None:
    """The token count of a long result runs in a thread: the loop goes on meanwhile."""
    box = FakeToolbox(SENSOR)
    box.answer = lambda name, args: "word " * 20_000
    h = make(tokenizer, box)
    threads: list[bool] = []
    count = h.service.turns.renderer.count_text

    def counting(text: str) -> int:
        try:
            asyncio.get_running_loop()
            threads.append(False)
        except RuntimeError:
            threads.append(True)
        return count(text)

    h.service.turns.renderer.count_text = counting  # type: ignore[method-assign]
    h.engine.rounds["t1"] = [call("sensor_read"), "ok"]
    ask(h, "t", {"message": "Big", "requestId": "t1", "workerTools": ["*"]})
    assert threads and all(threads)
