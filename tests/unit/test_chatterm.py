"""What the chat terminal writes for a reply's deltas (no broker: the terminal's own rules).
The client against a real worker is tested in test_chat.py and test_reasoning.py."""

from __future__ import annotations

import argparse
import io
import time
from typing import Any

from worker.chat.terminal import REPLY, Pending, Terminal, printable
from worker.protocol.messages import ChatReply, Latency, Usage


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
