"""The chat client's tool calling: tools declared from a JSON file, the toolChoice flag, and
how a call is answered without a person: ``--tool-result`` values and ``--tool-command``.

The worker keeps a session's tools (sending them again replaces them; ``[]`` clears them) and
asks the client to run each call (docs/protocol.md). The client answers every call of a reply
in one ``toolResults`` request; the model then goes on, and may call again. A message's tool
rounds end with a reply without calls; after ``max_rounds`` rounds the results ask for a text
answer (toolChoice none), so a model that keeps calling cannot loop for ever.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..protocol.messages import (
    RequestError,
    ToolCallOut,
    ToolEvent,
    ToolSpecIn,
    WorkerCallOut,
    check_tools,
    check_worker_tool_names,
)

# A --tool-result value KEY=TEXT names a tool or a call by KEY: a tool's name (OpenAI's rule)
# or a call's id (the worker's are call_<hex>_<n>).
RESULT_KEY = re.compile(r"([A-Za-z0-9_-]{1,128})=(.*)", re.DOTALL)
# The largest part of a failed command's error output passed on to the model.
COMMAND_ERROR_CHARS = 2000


class ToolSetupError(Exception):
    """A tools file, toolChoice or result value that cannot be used; the message says why."""


def load_tools(path: Path) -> list[dict[str, Any]]:
    """The tools of a JSON file: a list of OpenAI function tools, checked as the worker checks
    them (names, duplicates, parameter schemas), so that a mistake is said before anything is
    sent. ``[]`` is a valid file: it clears the session's tools."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ToolSetupError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:  # not UTF-8 (UnicodeDecodeError) among them
        raise ToolSetupError(f"{path} is not JSON: {exc}") from None
    except RecursionError:
        raise ToolSetupError(f"{path} is not usable JSON: its arrays or objects nest too deep") from None
    if isinstance(data, dict) and isinstance(data.get("tools"), list):
        data = data["tools"]  # an OpenAI request's excerpt: {"tools": [...]}
    if not isinstance(data, list):
        raise ToolSetupError(
            f'{path} must hold a JSON list of tools: [{{"type": "function", "function": {{"name": ...}}}}, ...]'
        )
    specs = []
    for index, tool in enumerate(data):
        try:
            specs.append(ToolSpecIn.model_validate(tool))
        except ValidationError as exc:
            problem = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'the tool'}: {e['msg']}" for e in exc.errors()[:3]
            )
            raise ToolSetupError(f"{path}: tool {index}: {problem}") from None
    try:
        check_tools(specs)
    except RequestError as exc:
        raise ToolSetupError(f"{path}: {exc.message}") from None
    return [spec.model_dump(by_alias=True, exclude_none=True) for spec in specs]


def tool_choice(
    value: str | None, tools: Sequence[dict[str, Any]] | None, worker_tools: Sequence[str] | None = None
) -> str | dict[str, Any] | None:
    """The wire toolChoice of --tool-choice: auto, none, required, or a tool's name (that tool
    must be called). A name not among --tools (nor --worker-tools) is refused here; without
    --tools, or with --worker-tools '*', the worker checks it."""
    if value is None or value in ("auto", "none", "required"):
        return value
    if tools is not None and not (worker_tools and (worker_tools == ["*"] or value in worker_tools)):
        names = [tool["function"]["name"] for tool in tools] + list(worker_tools or ())
        if value not in names:
            raise ToolSetupError(
                f"--tool-choice {value!r} is none of auto, none, required and the tools of --tools "
                f"and --worker-tools ({', '.join(names)})"
            )
    return {"type": "function", "function": {"name": value}}


def worker_tools(value: str | None) -> list[str] | None:
    """The workerTools of --worker-tools: '*' (every worker tool this user may use), names
    separated by commas, or '' (none: clears the session's choice)."""
    if value is None:
        return None
    names = [name.strip() for name in value.split(",") if name.strip()]
    try:
        check_worker_tool_names(names)
    except RequestError as exc:
        raise ToolSetupError(f"--worker-tools {value!r}: {exc.message}") from None
    return names


@dataclass
class Results:
    """The --tool-result values: ``TEXT`` answers any call, ``NAME=TEXT`` the calls of tool
    NAME, ``ID=TEXT`` the call with that id; ``=TEXT`` is TEXT as it is (for a text that begins
    with ``word=``). Given several times for the same key, the values answer that key's calls
    in turn, and the last one answers every call after them."""

    keyed_values: dict[str, deque[str]] = field(default_factory=dict)
    default: deque[str] = field(default_factory=deque)

    @classmethod
    def parse(cls, values: Sequence[str]) -> Results:
        results = cls()
        for value in values:
            match = RESULT_KEY.fullmatch(value)
            if match is None:
                results.default.append(value.removeprefix("="))
            else:
                results.keyed_values.setdefault(match[1], deque()).append(match[2])
        return results

    def __bool__(self) -> bool:
        return bool(self.keyed_values or self.default)

    @staticmethod
    def _take(values: deque[str]) -> str:
        return values.popleft() if len(values) > 1 else values[0]

    def keyed(self, call: ToolCallOut) -> str | None:
        """The value for this call's id, else for its tool's name."""
        for key in (call.id, call.function.name):
            if key in self.keyed_values:
                return self._take(self.keyed_values[key])
        return None

    def fallback(self) -> str | None:
        """The value for any call (TEXT)."""
        return self._take(self.default) if self.default else None

    def for_pending(self) -> list[tuple[str, str]]:
        """Without a message: each KEY=TEXT value is the result of the pending call KEY (the ids
        printed by the run that got the calls); a plain TEXT answers later rounds only."""
        if not self.keyed_values:
            raise ToolSetupError(
                "without --message, --tool-result ID=TEXT answers the session's pending calls: give one "
                "for each, with the call's id (printed by the run that got the calls)"
            )
        return [(key, self._take(values)) for key, values in self.keyed_values.items()]


class ToolCommand:
    """--tool-command: a program run once per call, its arguments (the JSON text of an object)
    on stdin, the call's tool name and id in TOOL_NAME and TOOL_CALL_ID; what it writes on
    stdout is the result. The command line is split like a shell's words, not run by a shell.
    A failure is the result too: the model is told what went wrong, as a tool says it."""

    def __init__(self, command: str) -> None:
        self.argv = shlex.split(command)
        if not self.argv:
            raise ToolSetupError("--tool-command is empty")
        self.text = command

    def run(self, call: ToolCallOut, timeout: float) -> tuple[str, str | None]:
        """(the result, a note on a failure for the user, or None)."""
        env = {**os.environ, "TOOL_NAME": call.function.name, "TOOL_CALL_ID": call.id}
        try:
            done = subprocess.run(
                self.argv,
                input=call.function.arguments,
                capture_output=True,
                text=True,
                errors="replace",
                env=env,
                timeout=timeout,
                check=False,
            )
        except OSError as exc:
            problem = f"could not run {self.argv[0]}: {exc.strerror or exc}"
            return f"error: {problem}", f"--tool-command {problem}"
        except subprocess.TimeoutExpired:
            problem = f"{self.argv[0]} did not finish within {timeout:g} s"
            return f"error: {problem}", f"--tool-command: {problem}"
        output = done.stdout.removesuffix("\n")
        if done.returncode != 0:
            detail = (done.stderr.strip() or output)[-COMMAND_ERROR_CHARS:]
            problem = f"{self.argv[0]} exited with status {done.returncode}"
            return f"error: {problem}: {detail}" if detail else f"error: {problem}", f"--tool-command: {problem}"
        return output, None


@dataclass
class ToolSettings:
    """What the client does with tools: what it declares and forces, and how it answers calls
    without asking (nothing set: the terminal asks its user; a one-shot run prints the calls)."""

    tools: list[dict[str, Any]] | None = None  # sent with a message: replaces the session's tools
    choice: str | dict[str, Any] | None = None  # toolChoice of the requests a message starts with
    worker_tools: list[str] | None = None  # workerTools sent with a message: the worker's own tools
    results: Results = field(default_factory=Results)
    command: ToolCommand | None = None
    max_rounds: int = 8

    @property
    def automatic(self) -> bool:
        return bool(self.results) or self.command is not None

    def answer(self, call: ToolCallOut, timeout: float) -> tuple[str | None, str | None]:
        """(the result of a call, a note for the user or None): a --tool-result value for its id
        or its tool, else --tool-command's output, else the --tool-result value for any call;
        None: nothing answers it."""
        text = self.results.keyed(call)
        if text is not None:
            return text, None
        if self.command is not None:
            return self.command.run(call, timeout)
        return self.results.fallback(), None

    def choice_after(self, rounds: int) -> str | None:
        """toolChoice of the results of the rounds-th round: none at the last round allowed,
        so the model answers in text; otherwise the default (auto)."""
        return "none" if rounds >= self.max_rounds else None


def call_line(call: ToolCallOut) -> str:
    """How a call is shown: its tool, its arguments, its id."""
    return f"tool call: {call.function.name} {call.function.arguments} ({call.id})"


def result_line(call_id: str, text: str) -> str:
    return f"tool result for {call_id}: {text}"


def tool_event_line(event: ToolEvent) -> str:
    """A worker call starting or ending, as the stream announces it."""
    if event.event == "start":
        return f"\u25b6 {event.name} running\u2026"
    mark = "\u2713" if event.outcome == "ok" else "\u2717"
    return f"{mark} {event.name} {event.duration_ms or 0:.0f} ms ({event.outcome})"


def worker_call_line(call: WorkerCallOut) -> str:
    """A call the worker ran itself: its tool, arguments, result and how it ended."""
    result = " ".join(call.result.split())
    if len(result) > 200:
        result = result[:200] + "\u2026"
    return (
        f"worker call (round {call.round + 1}): {call.name} {call.arguments} -> {result} "
        f"({call.outcome}, {call.duration_ms:.0f} ms)"
    )
