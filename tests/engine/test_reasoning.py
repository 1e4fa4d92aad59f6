"""Reasoning models end to end: the tiny model with a chat template that opens ``<think>``
(a random model never closes it, so all it writes is reasoning), on the real vLLM CPU engine
behind a real mosquitto. One worker for the module (an engine start costs ~50 s)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devtools.chat_terminal import PROMPT, Chat, run_chat
from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import Client
from devtools.worker_process import WorkerProcess, engine_args, serving

pytestmark = pytest.mark.e2e

CONFIG_BUDGET = 24  # --max-reasoning-tokens of the worker
SYSTEM = "You are a careful assistant who thinks first."
# Its own topic prefix: other modules' workers on the session's broker (the shared worker of
# test_e2e, on "chat") would answer these requests too, with the plain model's reply.
PREFIX = "think"


@pytest.fixture(scope="module")
def think_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from devtools.tinymodel import generate_tiny_model

    return generate_tiny_model(tmp_path_factory.mktemp("think-model"), think=True)


@pytest.fixture(scope="module")
def thinking_worker(
    think_model: Path, broker: Mosquitto, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    workdir = tmp_path_factory.mktemp("thinking-worker")
    worker = WorkerProcess(
        [
            *engine_args(think_model),
            "--mqtt-port",
            str(broker.port),
            "--worker-id",
            "thinking",
            "--topic-prefix",
            PREFIX,
            "--max-reasoning-tokens",
            str(CONFIG_BUDGET),
            "--stream-interval-ms",
            "0",
            "--state-dir",
            str(workdir / "state"),
        ],
        workdir / "worker.log",
        status=(broker.port, f"{PREFIX}/_worker/thinking/status"),
    )
    with serving(worker):
        yield worker


@pytest.fixture
def client(broker: Mosquitto) -> Iterator[Client]:
    """conftest's client, on this module's prefix."""
    chat_client = Client(broker.port, [f"{PREFIX}/+/+/reply", f"{PREFIX}/+/+/stream", f"{PREFIX}/_worker/+/stats"])
    yield chat_client
    chat_client.close()


def ask(client: Client, user: str, session: str, request: dict[str, Any]) -> dict[str, Any]:
    """Greedy: the random model then writes the same tokens every time (after "<think>\n" it
    writes newlines, never "</think>")."""
    client.publish(f"{PREFIX}/{user}/{session}/request", {"temperature": 0.0, **request})
    reply: dict[str, Any] = client.wait_topic(f"{PREFIX}/{user}/{session}/reply", timeout=180).json()
    assert "error" not in reply, reply
    return reply


def deltas_of(client: Client, request_id: str) -> list[dict[str, Any]]:
    """The stream deltas of a request already received (published before its reply)."""
    found = [m.json() for m in client.seen if m.topic.endswith("/stream") and m.json()["requestId"] == request_id]
    return sorted(found, key=lambda d: d["seq"])


def assert_stopped_at(reply: dict[str, Any], budget: int) -> None:
    usage = reply["usage"]
    assert reply["finishReason"] == "reasoning_budget", reply
    assert reply["reply"] == ""  # the think block never closed: no answer
    # Exact, however many tokens the engine hands over at once (vLLM merges the outputs of a
    # reader that lags behind): what came past the budget is dropped, and not counted.
    assert usage["reasoningTokens"] == usage["completionTokens"] == budget, usage


def test_reasoning_stops_at_the_budget(thinking_worker: WorkerProcess, client: Client) -> None:
    session = "s-" + uuid.uuid4().hex[:12]
    asked = ask(
        client,
        "alice",
        session,
        {"message": "Think hard.", "maxTokens": 200, "maxReasoningTokens": 10},
    )
    assert_stopped_at(asked, 10)
    # Without maxReasoningTokens (or above it), the configured budget.
    configured = ask(client, "alice", session, {"message": "Again.", "maxTokens": 200})
    assert_stopped_at(configured, CONFIG_BUDGET)
    capped = ask(client, "alice", session, {"message": "More.", "maxTokens": 200, "maxReasoningTokens": 150})
    assert_stopped_at(capped, CONFIG_BUDGET)
    # A maxTokens below the budget ends the generation first: length, all of it reasoning.
    short = ask(client, "alice", session, {"message": "Short.", "maxTokens": 6})
    assert short["finishReason"] == "length" and short["reply"] == ""
    assert short["usage"]["reasoningTokens"] == short["usage"]["completionTokens"] == 6


def test_reasoning_only_when_asked_in_reply_and_stream(thinking_worker: WorkerProcess, client: Client) -> None:
    session = "s-" + uuid.uuid4().hex[:12]
    base = {"message": "What is two plus two?", "maxTokens": 100, "maxReasoningTokens": 12, "stream": True}
    hidden = ask(client, "bob", session, {**base, "requestId": "hidden"})
    assert "reasoning" not in hidden and hidden["reply"] == "" and "think>" not in hidden["reply"]
    assert deltas_of(client, "hidden") == []  # nothing but reasoning: no delta
    shown = ask(client, "bob", session, {**base, "requestId": "shown", "includeReasoning": True})
    # The random model's reasoning is blank lines: the reply's (stripped) reasoning is "", the
    # stream carries them as generated.
    assert isinstance(shown["reasoning"], str) and "think>" not in shown["reasoning"] and shown["reply"] == ""
    deltas = deltas_of(client, "shown")
    assert deltas and [d["seq"] for d in deltas] == list(range(len(deltas)))
    assert all(d["delta"] == "" for d in deltas)
    streamed = "".join(d["reasoning"] for d in deltas)
    assert streamed and "think>" not in streamed and streamed.strip() == shown["reasoning"]


def test_the_history_keeps_no_reasoning(thinking_worker: WorkerProcess, client: Client, think_model: Path) -> None:
    from worker.engine.tokenizer import ChatTokenizer

    session = "s-" + uuid.uuid4().hex[:12]
    first_message, second_message = "Plan a trip to the mountains.", "And pack what?"
    first = ask(
        client,
        "carol",
        session,
        {"message": first_message, "systemPrompt": SYSTEM, "maxTokens": 200, "maxReasoningTokens": 20},
    )
    assert first["usage"]["reasoningTokens"] >= 20
    second = ask(client, "carol", session, {"message": second_message, "maxTokens": 4, "includeReasoning": True})
    # The second prompt is the first turn with its answer (empty), not its reasoning.
    renderer = ChatTokenizer(str(think_model))
    history = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": first_message},
        {"role": "assistant", "content": first["reply"]},
        {"role": "user", "content": second_message},
    ]
    assert second["usage"]["promptTokens"] == len(renderer.render(history, add_generation_prompt=True))
    assert "reasoning" not in first and "reasoning" in second


def test_the_chat_client_shows_that_the_model_thinks(thinking_worker: WorkerProcess, broker: Mosquitto) -> None:
    """The chat client always asks for the reasoning (its deltas keep --timeout from expiring
    while the model thinks) and shows it only when told to."""
    session = "s-" + uuid.uuid4().hex[:12]
    one_shot = run_chat(
        broker.port,
        *("--topic-prefix", PREFIX, "--session", session, "--message", "Think."),
        *("--temperature", "0", "--show-reasoning"),
    )
    # No answer before the budget ran out: exit 1, an empty stdout, the reasoning on stderr.
    assert one_shot.returncode == 1 and one_shot.stdout == "\n", one_shot.stderr
    assert "[reasoning]\n" in one_shot.stderr and "[answer]" in one_shot.stderr
    spent = re.search(r"the thinking budget ran out after (\d+) tokens", one_shot.stderr)
    assert spent and int(spent[1]) == CONFIG_BUDGET, one_shot.stderr

    chat = Chat(broker.port, "--topic-prefix", PREFIX, "--session", "t-" + uuid.uuid4().hex[:12], "--temperature", "0")
    try:
        chat.send("Think.")
        chat.child.expect_exact("(thinking; /reasoning shows it)")  # hidden, but said
        chat.expect(r"\[the thinking budget ran out after \d+ tokens, before an answer")
        chat.child.expect_exact(PROMPT)
        chat.send("/reasoning on")
        chat.child.expect_exact("[a reasoning model's thinking: shown]")
        chat.send("Again.")
        chat.child.expect_exact("(thinking) ")  # then the reasoning itself, as it streams
        chat.expect(r"\[the thinking budget ran out after \d+ tokens, before an answer")
        assert chat.quit() == 0
    finally:
        chat.kill()
