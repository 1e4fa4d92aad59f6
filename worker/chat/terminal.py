"""The chat client's interactive terminal.

One loop on the main thread over the client's event queue, fed by paho's thread (replies,
deltas, connection changes), a thread reading typed lines, and the SIGINT handler (Ctrl-C
cancels the running reply; at the prompt, a second Ctrl-C in a row leaves)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, TextIO

from ..protocol.messages import REASONING_BUDGET, ChatReply, StatsReport, ToolCallOut
from .client import (
    Answer,
    ChatClient,
    Connected,
    ConnectFailed,
    Delta,
    Disconnected,
    Event,
    Failed,
    Ready,
    Refused,
    ResetDone,
    Stats,
    Unreadable,
    WorkerStatus,
)
from .images import read_image
from .tool_calling import ToolSettings, call_line, result_line, tool_event_line, worker_call_line

PROMPT = "you> "
REPLY = "bot> "
HELP = """\
Type a message and press Enter; the reply streams as it is generated.
  /reset           start the conversation over (clears its history and system prompt)
  /cancel          stop the running reply (Ctrl-C does the same)
  /stats           the worker's latest statistics
  /verbose [on|off] after each reply: tokens (cached), TTFT and latency
  /reasoning [on|off] show a reasoning model's thinking as it streams
  /tools           the tools this client declared (--tools) and how their calls are answered
  /image FILE      send this image with the next message (/image alone: drop the attached ones)
  /help            this text
  /quit            leave (Ctrl-D too)
When a reply calls tools, each call is shown and its result asked for ("tool NAME> "): type it
and press Enter (an empty line is an empty result); Ctrl-C or /cancel leaves the calls
unanswered (the next message tells the model they were not run)."""
COMMANDS = ("/reset", "/cancel", "/stats", "/verbose", "/reasoning", "/tools", "/image", "/help", "/quit", "/exit")


@dataclass(frozen=True)
class InputLine(Event):
    text: str


@dataclass(frozen=True)
class InputEnd(Event):
    """stdin is closed (Ctrl-D)."""


@dataclass(frozen=True)
class Interrupt(Event):
    """Ctrl-C."""


@dataclass
class Pending:
    """What the terminal waits for: a turn's reply (request_id) or a reset's answer."""

    request_id: str | None
    sent_at: float
    last_heard: float
    streamed: list[str] = field(default_factory=list)  # the answer's deltas
    cancelling: bool = False
    thinking: bool = False  # reasoning was shown and the answer has not begun
    tool_lines: bool = False  # a worker call's line was shown since the last answer text


# Control characters other than newline and tab, shown as U+FFFD: a model's text may hold any
# of them (the tiny random model's does), and a terminal acts on some: ESC starts sequences
# that clear the screen, move the cursor or set the window title; CR overwrites the line.
_CONTROLS = {c: "\ufffd" for c in (*range(0x20), *range(0x7F, 0xA0)) if c not in (0x09, 0x0A)}


def printable(text: str) -> str:
    """Model text as the terminal may show it."""
    return text.translate(_CONTROLS)


def budget_note(reply: ChatReply) -> str:
    spent = reply.usage.reasoning_tokens or reply.usage.completion_tokens
    return f"the thinking budget ran out after {spent} tokens, before an answer; ask again (e.g. 'answer briefly')"


def length_note(reply: ChatReply, max_tokens: int | None) -> str:
    """What to say of a reply that ended on its length (finishReason ``length``): it is cut."""
    limit = f"--max-tokens {max_tokens}" if max_tokens is not None else "the worker's default maxTokens"
    spent = reply.usage.completion_tokens
    # maxTokens bounds each generation; usage counts every generation of a tool loop.
    at = (
        f"{spent} tokens"
        if max_tokens is None or spent <= max_tokens
        else f"{max_tokens} tokens ({spent} in all its rounds)"
    )
    return f"the reply was cut at {at}, its length limit ({limit}); ask for a longer one with --max-tokens N"


def usage_line(reply: ChatReply, round_trip_ms: float | None = None) -> str:
    usage, latency = reply.usage, reply.latency
    text = (
        f"prompt {usage.prompt_tokens} tokens ({usage.cached_tokens} cached"
        + (f", {usage.image_tokens} of images" if usage.image_tokens else "")
        + f"), reply {usage.completion_tokens} "
        f"tokens, ttft {latency.ttft_ms:.0f} ms, total {latency.total_ms:.0f} ms"
    )
    if round_trip_ms is not None:
        text += f", round trip {round_trip_ms:.0f} ms"
    return text + f", {reply.finish_reason}"


def stats_lines(reports: dict[str, StatsReport]) -> list[str]:
    if not reports:
        return ["no stats received yet (workers publish them on <prefix>/_worker/<id>/stats)"]
    lines = []
    for worker_id, report in sorted(reports.items()):
        age = max(0.0, time.time() - report.timestamp)
        lines.append(
            f"worker {worker_id} ({age:.0f} s ago): {report.log_line().removeprefix('Stats: ')}, "
            f"PromptTokens={report.prompt_tokens_total} ({report.cached_tokens_total} cached), "
            f"PrefixHitTotal={report.prefix_cache_hit_rate_total * 100:.1f}%, Cancelled={report.cancelled}"
        )
    return lines


class Terminal:
    def __init__(
        self,
        client: ChatClient,
        args: argparse.Namespace,
        out: TextIO | None = None,
        tools: ToolSettings | None = None,
    ) -> None:
        self.client = client
        self.args = args
        self.tools = tools or ToolSettings()
        self.tools_sent = False  # the session has --tools (sent with a message since the last reset)
        self.asking: deque[ToolCallOut] = deque()  # calls whose results the user is asked for
        self.results: list[tuple[str, str | bool]] = []  # this round's results (bool: an approval) so far
        self.rounds = 0  # tool rounds of the current message
        self.out = out or sys.stdout
        self.verbose: bool = bool(args.show_stats)
        self.show_reasoning: bool = bool(args.show_reasoning)
        # Reasoning is shown dimmed, where the output is a terminal that understands it.
        self.dim = ("\x1b[2m", "\x1b[0m") if self.out.isatty() else ("", "")
        self.pending: Pending | None = None
        self.deferred: deque[str] = deque()
        self.running = True
        self.line_start = True  # the cursor is at the start of a line
        self.at_prompt = False  # the cursor is right after the prompt
        self.failing = False  # a connection failure was reported and no connection came since
        self.started = False  # the prompt is shown once the banner is out
        self.leaving = False  # Ctrl-C at the prompt, and no line since: a second one leaves
        # Images that go with the next message (--image, /image FILE): (file name, bytes).
        self.attached: list[tuple[str, bytes]] = list(getattr(args, "images", ()))

    # -- output -------------------------------------------------------------------------

    def write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()
            self.line_start = text.endswith("\n")
            self.at_prompt = text == PROMPT

    def note(self, text: str) -> None:
        """A line of its own, in brackets; the prompt again when idle."""
        self.notes([text])

    def notes(self, lines: list[str]) -> None:
        """Lines of their own, in brackets; then the prompt again when idle."""
        for text in lines:
            self.write(("" if self.line_start else "\n") + f"[{text}]\n")
        self.prompt()

    def prompt(self) -> None:
        if self.started and self.pending is None and self.running and self.line_start:
            self.write(self.asking_prompt() if self.asking else PROMPT)

    def asking_prompt(self) -> str:
        call = self.asking[0]
        if call.needs_confirmation:
            return f"run {call.function.name}? (y/n)> "
        return f"tool {call.function.name}> "

    # -- the loop ---------------------------------------------------------------------

    def run(self) -> int:
        where = f"{self.client.settings.host}:{self.client.settings.port}"
        address = self.client.address
        self.write(f"Connecting to {where} as user {address.user}, session {address.session} ...\n")
        while not isinstance(event := self.client.next_event(3600), Ready):
            if isinstance(event, Refused):
                self.write(f"[{event.reason}]\n")
                return 3  # as cli.py's EXIT_NO_ANSWER
            if isinstance(event, ConnectFailed) and not self.failing:
                self.failing = True
                self.write(f"[cannot reach the broker at {where} ({event.error}); retrying, Ctrl-C to give up]\n")
        self.failing = False
        # The retained status and stats messages follow the subscription acknowledgement.
        while (event := self.client.next_event(0.3)) is not None:
            self.handle(event)
        online = sorted(w for w, up in self.client.workers_online.items() if up)
        workers = f"worker online: {', '.join(online)}" if online else "no worker online yet: requests wait for one"
        self.write(f"[connected; {workers}. /help lists the commands; resume with --session {address.session}]\n")
        threading.Thread(target=self._read_lines, name="chat-stdin", daemon=True).start()
        previous = signal.signal(signal.SIGINT, self._on_sigint)
        try:
            self.started = True
            self.prompt()
            while self.running:
                event = self.client.next_event(0.25)
                if event is not None:
                    self.handle(event)
                self._check_timeout()
        finally:
            signal.signal(signal.SIGINT, previous)
        self.write(("" if self.line_start else "\n") + "bye\n")
        return 0

    def _read_lines(self) -> None:  # its own thread: blocks in readline
        while line := sys.stdin.readline():
            self.client.post(InputLine(line.rstrip("\n")))
        self.client.post(InputEnd())

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        self.client.post(Interrupt())  # SimpleQueue.put is safe here

    def _check_timeout(self) -> None:
        pending = self.pending
        if pending is None or time.monotonic() - pending.last_heard < self.args.timeout:
            return
        if pending.request_id is not None and not pending.cancelling:
            self.client.cancel(pending.request_id)
        online = "" if self.client.any_worker_online() else ": no worker is online"
        self.pending = None
        self.note(f"no answer from the worker for {self.args.timeout:g} s{online}; stopped waiting")

    # -- events -----------------------------------------------------------------------

    def handle(self, event: Event) -> None:
        pending = self.pending
        if isinstance(event, InputLine):
            self.leaving = False
            self.line_start, self.at_prompt = True, False  # the terminal echoed the line and its newline
            self.on_line(event.text)
        elif isinstance(event, InputEnd):
            if pending is not None and pending.request_id is not None:
                self.client.cancel(pending.request_id)
            self.running = False
        elif isinstance(event, Interrupt):
            self.on_interrupt()
        elif isinstance(event, Delta):
            if pending is not None and event.delta.request_id == pending.request_id:
                pending.last_heard = time.monotonic()  # reasoning too: the worker is at it
                if pending.cancelling:
                    pass
                elif event.delta.tool_event is not None:
                    line = printable(tool_event_line(event.delta.tool_event))
                    self.write(("" if self.line_start else "\n") + f"[{line}]\n")
                    pending.tool_lines = True
                else:
                    self.on_delta(pending, event.delta.delta, event.delta.reasoning)
        elif isinstance(event, Answer):
            if pending is not None and event.reply.request_id == pending.request_id:
                self.finish(pending, event.reply)
        elif isinstance(event, Failed):
            if pending is not None and event.error.request_id in (pending.request_id, None):
                self.pending = None
                self.note(f"error {event.error.error.code.value}: {event.error.error.message}")
        elif isinstance(event, ResetDone):
            if pending is not None and pending.request_id is None:
                self.pending = None
                self.note("session reset: history and system prompt cleared")
        elif isinstance(event, WorkerStatus):
            if event.changed and self.started:
                self.note(f"worker {event.worker_id} is {'online' if event.online else 'offline'}")
        elif isinstance(event, Connected):
            self.failing = False
            if not event.first:
                resumed = "session resumed" if event.resumed else "new session: replies sent meanwhile are lost"
                self.note(f"reconnected to the broker ({resumed})")
        elif isinstance(event, Disconnected):
            self.note(f"connection to the broker lost ({event.reason}); reconnecting")
        elif isinstance(event, ConnectFailed):
            if not self.failing:
                self.failing = True
                self.note(f"cannot reach the broker ({event.error}); retrying")
        elif isinstance(event, Refused):
            self.note(event.reason)
        elif isinstance(event, Unreadable) and event.topic in (self.client.reply_topic, self.client.stream_topic):
            self.note(f"unreadable message on {event.topic}: {event.text[:300]}")
        elif isinstance(event, (Stats, Ready)):
            pass  # the client keeps the latest stats; Ready again after each reconnect
        if self.pending is None:
            while self.deferred and self.pending is None and self.running and not self.asking:
                text = self.deferred.popleft()
                self.write((text if self.at_prompt else ("" if self.line_start else "\n") + PROMPT + text) + "\n")
                self.on_line(text)
            self.prompt()

    def on_delta(self, pending: Pending, answer: str, reasoning: str | None) -> None:
        if reasoning is not None:
            if self.show_reasoning:
                start, end = self.dim
                self.write(("" if pending.thinking else "(thinking) ") + start + printable(reasoning) + end)
            elif not pending.thinking:
                self.write(f"{self.dim[0]}(thinking; /reasoning shows it){self.dim[1]}")
            pending.thinking = True
            return
        if answer and pending.thinking:
            self.write("\n" + REPLY)
            pending.thinking = False
        if answer and pending.tool_lines:  # the answer goes on after the worker's calls
            self.write(REPLY)
            pending.tool_lines = False
        pending.streamed.append(answer)
        self.write(printable(answer))

    def finish(self, pending: Pending, reply: ChatReply) -> None:
        streamed = "".join(pending.streamed)
        if reply.finish_reason == "cancelled":
            self.note(f"cancelled after {reply.usage.completion_tokens} tokens")
        elif reply.finish_reason == REASONING_BUDGET:
            self.note(budget_note(reply))
        else:
            if pending.thinking and reply.reply:  # an answer whose deltas were all lost
                self.write("\n" + REPLY)
            if pending.cancelling:
                self.note("the reply was complete before the cancel reached the worker")
            if not streamed:
                if reply.reply and pending.tool_lines:
                    self.write(REPLY)
                self.write(printable(reply.reply))
            elif streamed.strip() != reply.reply.strip():
                if reply.reply.startswith(streamed):
                    self.write(printable(reply.reply[len(streamed) :]))  # the deltas lost at the end
                else:
                    self.write(f"\n[some streamed text was lost; the whole reply:]\n{printable(reply.reply)}")
            # The calls after the text, or right after the reply's prompt when it has none.
            self.write("" if reply.tool_calls and not (streamed or reply.reply) else "\n")
            if reply.worker_calls and not self.line_start:
                self.write("\n")
            for worker_call in reply.worker_calls or ():
                self.write(f"[{printable(worker_call_line(worker_call))}]\n")
            for call in reply.tool_calls or ():
                self.write(f"[{printable(call_line(call))}]\n")
            if reply.finish_reason == "truncated":
                self.note("the reply was cut to fit the broker's maximum packet size")
            elif reply.finish_reason == "length":
                self.note(length_note(reply, self.args.max_tokens))
            if reply.tool_parse_error:
                self.note(f"the model wrote a tool call that was not taken: {reply.tool_parse_error}")
        if self.verbose:
            self.note(usage_line(reply, (time.monotonic() - pending.sent_at) * 1000))
        self.pending = None
        if reply.tool_calls:
            self.start_round(reply.tool_calls)

    # -- tool rounds ------------------------------------------------------------------

    def start_round(self, calls: list[ToolCallOut]) -> None:
        """A reply's calls (shown by finish): answer those --tool-command answers, ask the user
        for the others, one at a time; send the results once all have one."""
        self.rounds += 1
        self.results = []
        for call in calls:
            if call.needs_confirmation:  # the worker's own tool, run once the user approves it
                self.asking.append(call)
                continue
            text, problem = self.tools.answer(call, self.args.timeout) if self.tools.automatic else (None, None)
            if problem is not None:
                self.write(f"[{problem}]\n")
            if text is None:
                self.asking.append(call)
            else:
                self.write(f"[{printable(result_line(call.id, text))}]\n")
                self.results.append((call.id, text))
        if not self.asking:
            self.send_results()

    def answer(self, text: str) -> None:
        """A typed line: the result of the call asked for."""
        call = self.asking.popleft()
        if call.needs_confirmation:
            approved = text.strip().lower() in ("y", "yes")
            self.write(f"[{call.function.name} {'approved' if approved else 'declined'}]\n")
            self.results.append((call.id, approved))
        else:
            self.results.append((call.id, text))
        if not self.asking:
            self.send_results()

    def send_results(self) -> None:
        # In the calls' order, as the worker stores them (typed answers may come after others).
        try:
            request_id = self.client.send(
                tool_results=self.results,
                tool_choice=self.tools.choice_after(self.rounds),
                **self._request_fields(),
            )
        except ValueError as exc:
            self.note(f"not sent: {exc}")
            return
        self.results = []
        now = time.monotonic()
        self.pending = Pending(request_id, now, now)
        self.write(REPLY)

    def stop_answering(self) -> None:
        self.asking.clear()
        self.results = []
        self.note("the calls are left unanswered; the next message tells the model they were not run")

    def _request_fields(self) -> dict[str, Any]:
        return {
            "max_tokens": self.args.max_tokens,
            "temperature": self.args.temperature,
            "system_prompt": self.args.system_prompt,
            # Always: while a reasoning model thinks, its reasoning deltas are the only sign
            # that the worker is at it (--timeout); they are shown only with /reasoning.
            "include_reasoning": True,
        }

    def tools_lines(self) -> list[str]:
        tools = self.tools
        if tools.tools is None:
            lines = ["no --tools: the session's tools are whatever an earlier request declared"]
        elif not tools.tools:
            lines = ["--tools declares none: the session's tools are cleared"]
        else:
            lines = [
                f"tool {t['function']['name']}: {t['function'].get('description') or '(no description)'}"
                for t in tools.tools
            ]
        if tools.choice is not None:
            choice = tools.choice if isinstance(tools.choice, str) else tools.choice["function"]["name"]
            lines.append(f"toolChoice of each message: {choice}")
        how = f"--tool-command {tools.command.text}" if tools.command is not None else "asking you"
        lines.append(f"calls are answered by {how}; at most {tools.max_rounds} tool rounds per message")
        return lines

    def on_interrupt(self) -> None:
        pending = self.pending
        if pending is None and self.asking:
            self.stop_answering()
        elif pending is None:
            # At the prompt, as in node's REPL: the first Ctrl-C may be a reflex (a reply just
            # ended), the second in a row means it.
            if self.leaving:
                self.handle(InputEnd())
                return
            self.leaving = True
            self.note("Ctrl-C again, /quit or Ctrl-D to leave")
        elif pending.request_id is None or pending.cancelling:
            self.pending = None
            self.note("stopped waiting")
        else:
            self.cancel(pending)

    def cancel(self, pending: Pending) -> None:
        assert pending.request_id is not None
        self.client.cancel(pending.request_id)
        pending.cancelling = True
        pending.last_heard = time.monotonic()
        self.note("cancelling (Ctrl-C again to stop waiting)")

    def on_line(self, text: str) -> None:
        stripped = text.strip()
        command = stripped.split()[0].lower() if stripped.startswith("/") else ""
        if self.pending is not None:
            if command == "/cancel" and self.pending.request_id is not None:
                if not self.pending.cancelling:
                    self.cancel(self.pending)
            elif command in ("/quit", "/exit"):
                self.handle(InputEnd())
            elif command in ("/stats", "/verbose", "/reasoning", "/help"):
                self.command(stripped)
            elif stripped:
                self.deferred.append(text)
                self.note("queued until this reply is done (/cancel or Ctrl-C stops it)")
            return
        if self.asking and command not in COMMANDS:
            self.answer(text)  # any other line is the result, as typed
        elif command:
            self.command(stripped)
        elif stripped:
            self.send(text)
        self.prompt()

    def send(self, text: str) -> None:
        # The session keeps the tools: sent with the first message, and again after a reset.
        tools = None if self.tools_sent else self.tools.tools
        images: dict[str, Any] = {"images": [data for _, data in self.attached]} if self.attached else {}
        try:
            request_id = self.client.send(
                text,
                tools=tools,
                tool_choice=self.tools.choice,
                worker_tools=None if self.tools_sent else self.tools.worker_tools,
                **self._request_fields(),
                **images,
            )
        except ValueError as exc:
            self.note(f"not sent: {exc}")
            return
        self.attached = []
        self.tools_sent = True
        self.rounds = 0
        now = time.monotonic()
        self.pending = Pending(request_id, now, now)
        self.write(REPLY)

    def attach(self, path: str) -> None:
        """/image FILE: the file goes with the next message; /image alone drops those attached."""
        if not path:
            self.note(f"dropped {len(self.attached)} attached image(s)" if self.attached else "no image attached")
            self.attached = []
            return
        try:
            data = read_image(path)
        except ValueError as exc:
            self.note(str(exc))
            return
        self.attached.append((path, data))
        self.note(f"{path} ({len(data)} bytes) goes with your next message")

    def command(self, text: str) -> None:
        name, _, rest = text.partition(" ")
        if name.lower() == "/image":  # the file name as typed, not lowercased
            self.attach(rest.strip())
            return
        name, rest = name.lower(), rest.strip().lower()
        if name in ("/quit", "/exit"):
            self.running = False
        elif name == "/help":
            self.write(HELP + "\n")
        elif name == "/reset":
            self.client.reset()
            self.tools_sent = False
            self.asking.clear()
            self.results = []
            now = time.monotonic()
            self.pending = Pending(None, now, now)
        elif name == "/cancel" and self.asking:
            self.stop_answering()
        elif name == "/cancel":
            self.note("nothing to cancel")
        elif name == "/tools":
            self.notes(self.tools_lines())
        elif name == "/stats":
            self.notes(stats_lines(self.client.latest_stats))
        elif name == "/verbose":
            self.verbose = {"on": True, "off": False}.get(rest, not self.verbose)
            self.note(f"stats after each reply: {'on' if self.verbose else 'off'}")
        elif name == "/reasoning":
            self.show_reasoning = {"on": True, "off": False}.get(rest, not self.show_reasoning)
            self.note(f"a reasoning model's thinking: {'shown' if self.show_reasoning else 'hidden'}")
        else:
            self.note(f"unknown command {name}; /help lists them")
