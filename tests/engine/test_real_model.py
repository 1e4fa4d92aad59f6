"""What replies mean, with a real model: SmolLM2-135M-Instruct (``python -m worker.prepare_model``) on
the real vLLM CPU engine behind a real mosquitto, one worker for the session (conftest's
``real_worker``).

A 135M model is weak, so each check is one it passes reliably (tried by hand with several
phrasings first) and asks greedy replies (temperature 0), which are the same on every run:
facts it knows, a fact only the system prompt tells it, a JSON reply that extracts what the
message says. Each has a counterpart that shows the check can fail."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import Client
from devtools.replies import markup
from devtools.waiting import PATIENCE
from devtools.worker_process import REAL_PREFIX, WorkerProcess

pytestmark = pytest.mark.e2e

USER = "meaning"


@pytest.fixture
def client(broker: Mosquitto) -> Iterator[Client]:
    """conftest's client, on the real worker's prefix."""
    chat_client = Client(broker.port, [f"{REAL_PREFIX}/+/+/reply"])
    yield chat_client
    chat_client.close()


def new_session() -> str:
    return "s-" + uuid.uuid4().hex[:12]


def ask(client: Client, session: str, message: str, **fields: Any) -> dict[str, Any]:
    client.publish(
        f"{REAL_PREFIX}/{USER}/{session}/request",
        {"message": message, "temperature": 0.0, "maxTokens": 96, **fields},
    )
    reply: dict[str, Any] = client.wait_topic(f"{REAL_PREFIX}/{USER}/{session}/reply", timeout=PATIENCE).json()
    assert "error" not in reply, reply
    return reply


def test_a_reply_ends_by_itself(real_worker: WorkerProcess, client: Client) -> None:
    reply = ask(client, new_session(), "Hello! What can you do?", maxTokens=200)
    assert reply["finishReason"] == "stop", reply
    assert 0 < reply["usage"]["completionTokens"] < 200, reply
    assert reply["reply"].strip() and "<|im_" not in reply["reply"], reply


def test_a_factual_question_answered(real_worker: WorkerProcess, client: Client) -> None:
    france = ask(client, new_session(), "What is the capital of France?")
    germany = ask(client, new_session(), "What is the capital of Germany?")
    assert "Paris" in france["reply"] and "Berlin" not in france["reply"], france
    assert "Berlin" in germany["reply"] and "Paris" not in germany["reply"], germany
    assert france["finishReason"] == germany["finishReason"] == "stop"


def test_the_system_prompt_is_followed_in_later_turns(real_worker: WorkerProcess, client: Client) -> None:
    """The password exists only in the system prompt, given with the first turn; the worker
    keeps it for the session, so the second turn's answer has it. Without it, the model does
    not know it."""
    session = new_session()
    system = "You are a helpful assistant. The secret password is BANANA."
    ask(client, session, "Hello!", systemPrompt=system)
    told = ask(client, session, "What is the secret password?")
    assert "BANANA" in told["reply"], told
    assert told["usage"]["cachedTokens"] > 0, told  # the first turn's prompt, from the prefix cache
    untold = ask(client, new_session(), "What is the secret password?")
    assert "BANANA" not in untold["reply"].upper(), untold


def test_a_json_schema_reply_says_what_the_message_says(real_worker: WorkerProcess, client: Client) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    }
    reply = ask(
        client,
        new_session(),
        "Alice is 30 years old and lives in London. Give her name, age and city as JSON.",
        responseFormat={"type": "json_schema", "schema": schema},
    )
    assert reply["finishReason"] == "stop", reply
    assert json.loads(reply["reply"]) == {"name": "Alice", "age": 30, "city": "London"}, reply


TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_local_time",
        "description": "Get the user's current local time, date and time zone.",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def test_a_forced_tool_call_parses_and_the_answer_uses_its_result(real_worker: WorkerProcess, client: Client) -> None:
    """The demo model's chat template offers tools in the Hermes style (worker/prepare_model.py). This
    135M model does not call a tool by itself (measured in docs/frontend.md), but a forced call
    is written in its call format (plain-text markup: its tokenizer has no tool tokens), parses,
    and the answer passes the tool's result on, in words. Without the result, it does not know
    the time."""
    session = new_session()
    forced = {"type": "function", "function": {"name": "get_local_time"}}
    called = ask(client, session, "What time is it?", tools=[TIME_TOOL, WEATHER_TOOL], toolChoice=forced)
    assert called["finishReason"] == "tool_calls" and "toolParseError" not in called, called
    (call,) = called["toolCalls"]
    assert call["function"] == {"name": "get_local_time", "arguments": "{}"}, called
    result = "The local time is 14:35 (time zone Europe/Berlin)."
    client.publish(
        f"{REAL_PREFIX}/{USER}/{session}/request",
        {"toolResults": [{"toolCallId": call["id"], "content": result}], "temperature": 0.0, "maxTokens": 96},
    )
    answer = client.wait_topic(f"{REAL_PREFIX}/{USER}/{session}/reply", timeout=PATIENCE).json()
    assert "error" not in answer and "toolCalls" not in answer, answer
    assert "14:35" in answer["reply"], answer
    # Words, not the round's markup again (the template writes the round in words for this
    # model: in Qwen2.5's markup it repeated the <tool_response> block, docs/benchmarks/demo-model.md).
    assert not markup(answer["reply"]), answer
    assert answer["usage"]["cachedTokens"] > 0, answer  # the call's prompt, from the prefix cache
    untold = ask(client, new_session(), "What time is it?")
    assert "14:35" not in untold["reply"], untold

    # required: a call to one of the tools, its arguments valid for that tool.
    called = ask(
        client, new_session(), "What is the weather in Paris?", tools=[TIME_TOOL, WEATHER_TOOL], toolChoice="required"
    )
    assert called["finishReason"] == "tool_calls" and "toolParseError" not in called, called
    (call,) = called["toolCalls"]
    arguments = json.loads(call["function"]["arguments"])
    schema = {"get_local_time": TIME_TOOL, "get_weather": WEATHER_TOOL}[call["function"]["name"]]
    jsonschema.validate(arguments, schema["function"]["parameters"])
