"""The chat client and the worker's own tools (docs/tools.md): --worker-tools, the stream's tool
events and the reply's worker calls as the terminal shows them, and a call that asks for the
user's approval (no broker: the client's own rules; the demo, scripts/tools-demo.sh, runs the
client against a real worker)."""

from __future__ import annotations

import argparse
import io
import time
from typing import Any

import pytest

from devtools.fakes import Sent
from worker.chat.client import Answer, ChatClient, ClientSettings, Delta
from worker.chat.terminal import REPLY, InputLine, Pending, Terminal
from worker.chat.tool_calling import ToolSetupError, tool_choice, tool_event_line, worker_call_line, worker_tools
from worker.protocol.messages import (
    ChatReply,
    FunctionCall,
    Latency,
    StreamDelta,
    ToolCallOut,
    ToolEvent,
    Usage,
    WorkerCallOut,
)
from worker.protocol.topics import SessionAddress

TIME_TOOL = {"type": "function", "function": {"name": "get_local_time", "parameters": {"type": "object"}}}


def terminal() -> tuple[Terminal, io.StringIO, Sent]:
    out = io.StringIO()
    args = argparse.Namespace(
        show_stats=False, show_reasoning=False, timeout=120.0, max_tokens=None, temperature=None, system_prompt=None
    )
    term = Terminal(client=None, args=args, out=out)  # type: ignore[arg-type]
    sent = Sent()
    term.client = sent  # type: ignore[assignment]
    term.started = True
    return term, out, sent


def reply(text: str, finish_reason: str = "stop", **fields: Any) -> ChatReply:
    return ChatReply(
        session_id="s",
        request_id="r",
        reply=text,
        finish_reason=finish_reason,
        usage=Usage(prompt_tokens=5, completion_tokens=9, cached_tokens=0),
        latency=Latency(queue_ms=0, ttft_ms=1, total_ms=2),
        **fields,
    )


SENSOR_CALL = WorkerCallOut(
    id="call_a_0",
    name="sensor_read",
    arguments="{}",
    result='{"temperature_c": 21.5,\n "occupied": false}',
    outcome="ok",
    duration_ms=12.4,
    round=0,
)


def event(kind: str, seq: int, **fields: Any) -> Delta:
    tool_event = ToolEvent(event=kind, tool_call_id="call_a_0", name="sensor_read", round=0, **fields)  # type: ignore[arg-type]
    return Delta(StreamDelta(request_id="r", seq=seq, delta="", tool_event=tool_event))


def test_worker_tools_flag_takes_a_star_names_or_nothing() -> None:
    assert worker_tools(None) is None
    assert worker_tools("*") == ["*"]
    assert worker_tools("lamp_set, sensor_read") == ["lamp_set", "sensor_read"]
    assert worker_tools("") == []  # clears the session's choice
    with pytest.raises(ToolSetupError, match="alone"):
        worker_tools("*,lamp_set")
    with pytest.raises(ToolSetupError, match="not a tool name"):
        worker_tools("lamp set")


def test_a_worker_tool_may_be_forced_beside_the_clients_own_tools() -> None:
    forced = {"type": "function", "function": {"name": "lamp_set"}}
    assert tool_choice("lamp_set", [TIME_TOOL], ["*"]) == forced
    assert tool_choice("lamp_set", [TIME_TOOL], ["lamp_set"]) == forced
    with pytest.raises(ToolSetupError, match="--worker-tools"):
        tool_choice("lamp_set", [TIME_TOOL], ["sensor_read"])


def test_requests_carry_worker_tools_and_approvals() -> None:
    client = ChatClient(ClientSettings(), SessionAddress("u", "s"))
    request = client.request("Lamp off", worker_tools=["*"], tool_choice="required")
    assert request.worker_tools == ["*"] and '"workerTools":["*"]' in request.to_json().decode()
    answers = client.request(tool_results=[("call_a_0", True), ("call_b_0", "12:00"), ("call_c_0", False)])
    assert [(r.tool_call_id, r.approved, r.content) for r in answers.tool_results or ()] == [
        ("call_a_0", True, None),
        ("call_b_0", None, "12:00"),
        ("call_c_0", False, None),
    ]


def test_the_terminal_shows_worker_calls_as_they_run_then_the_replys_list() -> None:
    term, out, _ = terminal()
    term.pending = Pending("r", time.monotonic(), time.monotonic())
    term.write(REPLY)
    term.handle(event("start", 0))
    term.handle(event("end", 1, duration_ms=12.4, outcome="ok"))
    term.handle(Delta(StreamDelta(request_id="r", seq=2, delta="Nobody is there.")))
    term.handle(Answer(reply("Nobody is there.", worker_calls=[SENSOR_CALL])))
    assert out.getvalue() == (
        f"{REPLY}\n"
        "[▶ sensor_read running…]\n"
        "[✓ sensor_read 12 ms (ok)]\n"
        f"{REPLY}Nobody is there.\n"
        '[worker call (round 1): sensor_read {} -> {"temperature_c": 21.5, "occupied": false} (ok, 12 ms)]\n'
        "you> "
    )
    failed = ToolEvent(event="end", tool_call_id="c", name="lamp_set", round=1, duration_ms=5000, outcome="timeout")
    assert tool_event_line(failed) == "✗ lamp_set 5000 ms (timeout)"
    long = SENSOR_CALL.model_copy(update={"result": "x" * 500})
    assert worker_call_line(long).count("x") == 200


def test_a_call_that_needs_confirmation_is_approved_or_declined_by_the_user() -> None:
    term, out, sent = terminal()
    door = ToolCallOut(
        id="call_d_0", function=FunctionCall(name="lamp_set", arguments='{"on": true}'), needs_confirmation=True
    )
    clock = ToolCallOut(id="call_t_0", function=FunctionCall(name="get_local_time", arguments="{}"))
    term.pending = Pending("r", time.monotonic(), time.monotonic())
    term.handle(Answer(reply("", finish_reason="tool_calls", tool_calls=[door, clock])))
    assert out.getvalue().endswith("run lamp_set? (y/n)> ")
    term.handle(InputLine("y"))
    assert out.getvalue().endswith("[lamp_set approved]\ntool get_local_time> ")
    term.handle(InputLine("12:00"))
    assert sent.requests[-1]["tool_results"] == [("call_d_0", True), ("call_t_0", "12:00")]
    # Anything but y or yes declines.
    term.pending = Pending("r2", time.monotonic(), time.monotonic())
    term.handle(
        Answer(reply("", finish_reason="tool_calls", tool_calls=[door]).model_copy(update={"request_id": "r2"}))
    )
    term.handle(InputLine("sure"))
    assert sent.requests[-1]["tool_results"] == [("call_d_0", False)]
