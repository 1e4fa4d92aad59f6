"""What the chat terminal writes for a reply's deltas and tool calls, and how the chat client's
tool flags answer calls (no broker: the client's own rules). The client against a real worker
is tested in test_chat.py and test_reasoning.py."""

from __future__ import annotations

import argparse
import io
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from devtools.fakes import Sent
from worker.chat.cli import main
from worker.chat.terminal import REPLY, InputLine, Pending, Terminal, printable
from worker.chat.tool_calling import Results, ToolCommand, ToolSettings, ToolSetupError, load_tools, tool_choice
from worker.protocol.messages import ChatReply, FunctionCall, Latency, ToolCallOut, Usage


def terminal(**flags: Any) -> tuple[Terminal, io.StringIO]:
    out = io.StringIO()
    args = argparse.Namespace(**{"show_stats": False, "show_reasoning": False, "timeout": 120.0, **flags})
    return Terminal(client=None, args=args, out=out), out  # type: ignore[arg-type]


def reply(text: str, reasoning: str | None = None, finish_reason: str = "stop") -> ChatReply:
    return ChatReply(
        session_id="s",
        request_id="r",
        reply=text,
        reasoning=reasoning,
        finish_reason=finish_reason,
        usage=Usage(prompt_tokens=5, completion_tokens=9, cached_tokens=0, reasoning_tokens=4 if reasoning else None),
        latency=Latency(queue_ms=0, ttft_ms=1, total_ms=2),
    )


def test_control_characters_of_model_text_are_not_sent_to_the_terminal() -> None:
    assert printable("a\tb\nc") == "a\tb\nc"
    assert printable("\x1b[2J\rx\x05\x7f\x9b") == "\ufffd[2J\ufffdx\ufffd\ufffd\ufffd"
    term, out = terminal()
    pending = Pending("r", time.monotonic(), time.monotonic())
    term.on_delta(pending, "one\x1b]0;title\x07", None)
    term.finish(pending, reply("one\x1b]0;title\x07 two\r"))  # the end came only in the reply
    assert out.getvalue() == "one\ufffd]0;title\ufffd two\ufffd\n"


def test_hidden_reasoning_is_announced_once_and_the_answer_starts_a_line() -> None:
    term, out = terminal()
    pending = Pending("r", time.monotonic(), time.monotonic())
    for delta in ("\n", "hmm", " more"):
        term.on_delta(pending, "", delta)
    term.on_delta(pending, "Yes", None)
    term.finish(pending, reply("Yes", "hmm more"))
    assert out.getvalue() == f"(thinking; /reasoning shows it)\n{REPLY}Yes\n"


def test_shown_reasoning_streams_before_the_answer() -> None:
    term, out = terminal(show_reasoning=True)
    pending = Pending("r", time.monotonic(), time.monotonic())
    for delta in ("hmm", " more\x1b"):
        term.on_delta(pending, "", delta)
    term.on_delta(pending, "Yes", None)
    term.finish(pending, reply("Yes", "hmm more"))
    assert out.getvalue() == f"(thinking) hmm more\ufffd\n{REPLY}Yes\n"


def test_a_spent_thinking_budget_is_said() -> None:
    term, out = terminal()
    pending = Pending("r", time.monotonic(), time.monotonic())
    term.on_delta(pending, "", "hmm")
    term.finish(pending, reply("", "hmm", finish_reason="reasoning_budget"))
    assert out.getvalue() == (
        "(thinking; /reasoning shows it)\n"
        "[the thinking budget ran out after 4 tokens, before an answer; ask again (e.g. 'answer briefly')]\n"
    )


def test_a_reply_cut_at_its_length_is_said() -> None:
    """In the terminal as in one-shot mode (tests/broker/test_chat_one_shot.py): a reply that
    ended on its length says it was cut, and how to get a longer one; one that ended by itself
    says nothing more."""
    for max_tokens, limit in ((9, "--max-tokens 9"), (None, "the worker's default maxTokens")):
        term, out = terminal(max_tokens=max_tokens)
        pending = Pending("r", time.monotonic(), time.monotonic())
        term.on_delta(pending, "high-performance, low-latency,", None)
        term.finish(pending, reply("high-performance, low-latency,", finish_reason="length"))
        assert out.getvalue() == (
            f"high-performance, low-latency,\n[the reply was cut at 9 tokens, its length limit ({limit}); "
            "ask for a longer one with --max-tokens N]\n"
        )
    term, out = terminal(max_tokens=9)
    term.finish(Pending("r", time.monotonic(), time.monotonic()), reply("Done."))
    assert out.getvalue() == "Done.\n"
    # After a tool round usage counts every generation; the limit is each one's.
    term, out = terminal(max_tokens=6)
    term.finish(Pending("r", time.monotonic(), time.monotonic()), reply("The lamp is", finish_reason="length"))
    assert "[the reply was cut at 6 tokens (9 in all its rounds), its length limit (--max-tokens 6);" in out.getvalue()


# ---- tool calls: what the terminal shows and sends, and the one-shot flags (the client
# against a real worker: test_chat.py)


def call(name: str, arguments: str = "{}", index: int = 0) -> ToolCallOut:
    return ToolCallOut(id=f"call_{name}_{index}", function=FunctionCall(name=name, arguments=arguments))


def calls_reply(*calls: ToolCallOut, text: str = "") -> ChatReply:
    return reply(text, finish_reason="tool_calls").model_copy(update={"tool_calls": list(calls)})


def test_calls_are_shown_and_each_result_asked_for_then_sent_in_one_request() -> None:
    term, out = terminal(max_tokens=None, temperature=None, system_prompt=None)
    term.client = Sent()  # type: ignore[assignment]
    term.started = True
    pending = Pending("r", time.monotonic(), time.monotonic())
    term.finish(pending, calls_reply(call("get_time"), call("get_weather", '{"city": "Paris"}', 1), text="Let me see."))
    assert out.getvalue() == (
        "Let me see.\n"
        "[tool call: get_time {} (call_get_time_0)]\n"
        '[tool call: get_weather {"city": "Paris"} (call_get_weather_1)]\n'
    )
    term.prompt()  # as the loop does after each event
    assert out.getvalue().endswith("tool get_time> ")
    term.handle(InputLine("12:00"))
    assert out.getvalue().endswith("tool get_weather> ")
    term.handle(InputLine("/verbose off"))  # a command is a command, also here
    assert out.getvalue().endswith("[stats after each reply: off]\ntool get_weather> ")
    term.handle(InputLine(" sunny, 20 C "))  # anything else is the result, as typed
    assert term.client.requests == [  # type: ignore[attr-defined]
        {
            "message": None,
            "tool_results": [("call_get_time_0", "12:00"), ("call_get_weather_1", " sunny, 20 C ")],
            "tool_choice": None,
            "max_tokens": None,
            "temperature": None,
            "system_prompt": None,
            "include_reasoning": True,
        }
    ]
    assert term.pending is not None and term.pending.request_id == "r1" and out.getvalue().endswith(REPLY)


def test_a_call_only_reply_shows_its_calls_on_the_reply_line() -> None:
    term, out = terminal()
    term.client = Sent()  # type: ignore[assignment]
    term.finish(Pending("r", time.monotonic(), time.monotonic()), calls_reply(call("get_time")))
    assert out.getvalue() == "[tool call: get_time {} (call_get_time_0)]\n"
    assert [c.id for c in term.asking] == ["call_get_time_0"]
    term.on_interrupt()  # Ctrl-C: the calls stay unanswered
    assert not term.asking and term.client.requests == []  # type: ignore[attr-defined]
    assert "[the calls are left unanswered; the next message tells the model they were not run]" in out.getvalue()


def test_the_last_round_allowed_asks_for_a_text_answer() -> None:
    """--tool-command answers without asking; the results of round max_rounds carry toolChoice
    none, so that the model answers in text."""
    settings = ToolSettings(command=ToolCommand(f"{sys.executable} -c 'print(\"ok\")'"), max_rounds=2)
    term, out = terminal(max_tokens=None, temperature=None, system_prompt=None)
    term.client = Sent()  # type: ignore[assignment]
    term.tools = settings
    term.send("hi")
    for _ in range(2):
        term.finish(Pending("r", 0, 0), calls_reply(call("get_time")))
    choices = [r["tool_choice"] for r in term.client.requests]  # type: ignore[attr-defined]
    assert choices == [None, None, "none"]
    assert [r.get("tool_results") for r in term.client.requests][1:] == [[("call_get_time_0", "ok")]] * 2  # type: ignore[attr-defined]
    assert "[tool result for call_get_time_0: ok]" in out.getvalue()


def test_tool_result_values() -> None:
    results = Results.parse(["get_time=12:00", "get_time=12:05", "call_x_0=direct", '{"a=b": 1}', "=w=x", "plain"])
    assert results.keyed(call("get_time")) == "12:00"
    assert results.keyed(call("get_time")) == "12:05"
    assert results.keyed(call("get_time")) == "12:05"  # the last one stays
    assert results.keyed(ToolCallOut(id="call_x_0", function=FunctionCall(name="get_time", arguments="{}"))) == "direct"
    assert results.keyed(call("other")) is None
    assert [results.fallback() for _ in range(4)] == ['{"a=b": 1}', "w=x", "plain", "plain"]
    assert Results.parse(["call_1=a", "b"]).for_pending() == [("call_1", "a")]
    with pytest.raises(ToolSetupError, match="ID=TEXT"):
        Results.parse(["b"]).for_pending()


def test_a_tool_command_gets_the_call_and_its_failure_is_the_result() -> None:
    script = "import os, sys; print(os.environ['TOOL_NAME'], os.environ['TOOL_CALL_ID'], sys.stdin.read())"
    command = ToolCommand(f"{sys.executable} -c {shlex.quote(script)}")
    assert command.run(call("get_weather", '{"city": "Paris"}'), 30) == (
        'get_weather call_get_weather_0 {"city": "Paris"}',
        None,
    )
    failing = ToolCommand(f"{sys.executable} -c 'import sys; sys.exit(\"no such city\")'")
    text, problem = failing.run(call("get_weather"), 30)
    assert text.startswith("error: ") and text.endswith("exited with status 1: no such city")
    assert problem is not None and "exited with status 1" in problem
    text, problem = ToolCommand("/nonexistent/tool").run(call("x"), 30)
    assert text.startswith("error: could not run /nonexistent/tool") and problem is not None


def test_tools_files_and_tool_choice_are_checked_before_anything_is_sent(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"tools": [{"type": "function", "function": {"name": "get_time"}}]}))
    assert load_tools(good) == [{"type": "function", "function": {"name": "get_time"}}]
    assert tool_choice("get_time", load_tools(good)) == {"type": "function", "function": {"name": "get_time"}}
    assert tool_choice("required", None) == "required" and tool_choice("anything", None) is not None
    with pytest.raises(ToolSetupError, match="none of auto, none, required and the tools of --tools"):
        tool_choice("get_date", load_tools(good))
    cases = {
        '{"name": "x"}': "must hold a JSON list of tools",
        '[{"type": "function", "function": {"name": "bad name"}}]': "not a valid tool name",
        '[{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "a"}}]': "twice",
        '[{"type": "function", "function": {"name": "a", "parameters": {"type": "string"}}}]': "JSON object",
        '[{"type": "function", "function": {"nam": "a"}}]': "tool 0: function.name: Field required",
        "[" * 100_000 + "]" * 100_000: "nest too deep",
    }
    for text, problem in cases.items():
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(ToolSetupError, match=problem):
            load_tools(bad)


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["--tool-result", "x"], "name it with --session"),
        (["--session", "s1", "--tool-result", "text only"], "ID=TEXT"),
        (["--tool-choice", "nope", "--tools", "{tools}", "--message", "hi"], "none of auto, none, required"),
    ],
)
def test_tool_flags_that_cannot_be_used_exit_2_before_connecting(
    args: list[str], problem: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tools = tmp_path / "tools.json"
    tools.write_text('[{"type": "function", "function": {"name": "get_time"}}]')
    argv = [arg.replace("{tools}", str(tools)) for arg in args]
    assert main([*argv, "--mqtt-port", "1"], environ={}) == 2
    assert problem in capsys.readouterr().err


def test_the_chat_command_gives_sigpipe_back(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run in-process (as these tests do), the command must not leave its SIGPIPE default
    behind: the process would die of the next write to a closed pipe."""
    import signal

    before = signal.getsignal(signal.SIGPIPE)
    seen: list[object] = []
    monkeypatch.setattr(
        "worker.chat.cli.tool_settings", lambda args: seen.append(signal.getsignal(signal.SIGPIPE)) or 1 / 0
    )
    with pytest.raises(ZeroDivisionError):
        main(["--mqtt-port", "1", "--message", "hi"], environ={})
    assert seen == [signal.SIG_DFL]  # while it ran
    assert signal.getsignal(signal.SIGPIPE) == before
