"""The one-shot chat client (``python -m worker.chat --message``) and a reply's length: the
maxTokens it asks for by default, and the note on stderr when a reply was cut at it. The
broker is real; a pretend worker (a retained ``online`` status, and a plain MQTT client that
answers the request) stands in for one, so that the reply's finishReason is the test's to
choose. The client against a real worker: tests/engine/test_chat.py."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from devtools.chat_terminal import run_chat
from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import Client
from devtools.mqtt_client import pretend_worker as pretend_worker_on
from devtools.waiting import PATIENCE
from worker.chat.cli import ONE_SHOT_MAX_TOKENS

PREFIX = "oneshot"


@pytest.fixture
def pretend_worker(broker: Mosquitto) -> Iterator[Client]:
    with pretend_worker_on(broker.port, PREFIX) as watch:
        yield watch


def ask(broker: Mosquitto, worker: Client, args: list[str], finish_reason: str) -> tuple[dict[str, Any], Any]:
    """Run the one-shot client with ``args``; answer its request with a reply that ended on
    ``finish_reason`` after as many tokens as it asked for; (the request, the finished run)."""
    done: dict[str, subprocess.CompletedProcess[str]] = {}
    session = f"s-{finish_reason}"
    command = ["--topic-prefix", PREFIX, "--session", session, "--message", "Summarise MQTT in one line.", *args]
    thread = threading.Thread(target=lambda: done.setdefault("run", run_chat(broker.port, *command)))
    thread.start()
    try:
        request = worker.wait_for(lambda m: m.topic == f"{PREFIX}/anon/{session}/request", timeout=PATIENCE).json()
        tokens = request.get("maxTokens", 256) if finish_reason == "length" else 12
        worker.publish(
            f"{PREFIX}/anon/{session}/reply",
            {
                "sessionId": session,
                "requestId": request["requestId"],
                "reply": "MQTT is a light, high-performance, low-latency, high-performance",
                "finishReason": finish_reason,
                "usage": {"promptTokens": 40, "completionTokens": tokens, "cachedTokens": 0},
                "latency": {"queueMs": 1.0, "ttftMs": 50.0, "totalMs": 900.0},
            },
        )
    finally:
        thread.join(120)
    return request, done["run"]


def test_a_reply_cut_at_its_length_is_said_on_stderr_and_the_default_fits_a_line(
    broker: Mosquitto, pretend_worker: Client
) -> None:
    request, run = ask(broker, pretend_worker, [], "length")
    assert request["maxTokens"] == ONE_SHOT_MAX_TOKENS == 96
    assert run.returncode == 0, run.stderr
    assert run.stdout == "MQTT is a light, high-performance, low-latency, high-performance\n"  # the reply as it is
    assert run.stderr == (
        "chat: the reply was cut at 96 tokens, its length limit (--max-tokens 96); "
        "ask for a longer one with --max-tokens N\n"
    )


def test_a_reply_that_ended_by_itself_gets_no_note(broker: Mosquitto, pretend_worker: Client) -> None:
    request, run = ask(broker, pretend_worker, ["--max-tokens", "300"], "stop")
    assert request["maxTokens"] == 300  # the flag, over the one-shot default
    assert run.returncode == 0 and run.stderr == "", run.stderr
