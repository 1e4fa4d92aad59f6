"""The chat client (``python -m worker.chat``) as its user runs it: interactive, in a
pseudo-terminal (pexpect), or as a one-shot command."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from typing import Any

import pexpect

from . import REPO
from .waiting import PATIENCE

USAGE = re.compile(
    r"\[prompt (\d+) tokens \((\d+) cached\), reply (\d+) tokens, ttft [\d.]+ ms, total [\d.]+ ms, "
    r"round trip [\d.]+ ms, (\w+)\]"
)
PROMPT = "you> "
REPLY = "bot> "
# A tool call as the client shows it: (tool, arguments, call id); and the prompt that asks for
# its result.
TOOL_CALL = re.compile(r"\[tool call: ([\w-]+) (\{.*\}) \((call_\w+)\)\]")
# The note after a reply that ended on its length (finishReason length): not the reply's text.
LENGTH_NOTE = re.compile(r"^\[the reply was cut at \d+ tokens, its length limit .*\]$", re.MULTILINE)


def tool_prompt(name: str) -> str:
    return f"tool {name}> "


def chat_command(port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "worker.chat", "--mqtt-port", str(port), *args]


def in_terminal(command: list[str], *, timeout: float, **options: Any) -> pexpect.spawn:
    """``command`` in a pseudo-terminal of its own, as a user starts it from a shell (from the
    repository root, with this environment unless ``env`` is given). Its SIGINT is at the
    default whatever the tests were started with: a shell's background job (``cmd &``) starts
    with SIGINT ignored, its children inherit that, and then a Ctrl-C did nothing (three
    Ctrl-C tests waited out their timeouts so)."""
    options.setdefault("env", dict(os.environ))
    return pexpect.spawn(
        command[0],
        command[1:],
        cwd=str(REPO),
        encoding="utf-8",
        timeout=timeout,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        **options,
    )


class Chat:
    """The interactive client in a pseudo-terminal."""

    def __init__(self, port: int, *args: str) -> None:
        command = chat_command(port, *args)
        self.child = in_terminal(command, timeout=PATIENCE)
        self.length_noted = False  # the last turn's reply ended on its length, and the terminal said so
        self.child.expect(r"\[connected; ")
        self.child.expect_exact(PROMPT)

    def send(self, line: str) -> None:
        self.child.sendline(line)

    def expect(self, pattern: str, timeout: float = PATIENCE) -> re.Match[str]:
        self.child.expect(pattern, timeout=timeout)
        match = self.child.match
        assert isinstance(match, re.Match)
        return match

    def turn(self, message: str) -> tuple[str, re.Match[str]]:
        """Send a message (with stats on); what the terminal showed as the reply (without the
        note that a reply was cut at its length: ``length_noted`` says whether it was there),
        and the stats."""
        self.send(message)
        self.child.expect_exact(REPLY)
        match = self.expect(USAGE.pattern)
        shown = str(self.child.before).replace("\r\n", "\n")
        shown, notes = LENGTH_NOTE.subn("", shown)
        self.length_noted = bool(notes)
        self.child.expect_exact(PROMPT)
        return shown, match

    def quit(self) -> int:
        self.send("/quit")
        self.child.expect_exact("bye")
        self.child.expect(pexpect.EOF)
        self.child.close()
        return int(self.child.exitstatus or 0)

    def kill(self) -> None:
        if self.child.isalive():
            self.child.terminate(force=True)


def run_chat(
    port: int, *args: str, stdin: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        chat_command(port, *args),
        cwd=REPO,
        input=stdin,
        env=env,
        capture_output=True,
        text=True,
        timeout=PATIENCE,
        check=False,
    )
