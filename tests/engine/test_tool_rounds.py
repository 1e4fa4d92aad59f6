"""Tool calling end to end: the shared worker (the tiny random model with Qwen2.5's tools
chat template and its <tool_call> tokens) over MQTT, the real vLLM CPU engine, vLLM's hermes
parser. A random model never calls a tool by itself, so the rounds here are forced calls:
the grammar makes it write its native call format, and every forced call must parse and
validate against the tool's parameters."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from typing import Any

import jsonschema
import pytest

from devtools.mqtt_client import Client
from devtools.worker_process import BLOCK_SIZE, WorkerProcess

pytestmark = pytest.mark.e2e

# Parameters a random model can finish: bounded strings, enums, integers, booleans, nesting.
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "set_lamp",
            "description": "Switch a lamp",
            "parameters": {
                "type": "object",
                "properties": {"on": {"type": "boolean"}, "room": {"enum": ["kitchen", "hall", "office"]}},
                "required": ["on", "room"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    "detail": {
                        "type": "object",
                        "properties": {"wind": {"type": "boolean"}},
                        "required": ["wind"],
                        "additionalProperties": False,
                    },
                },
                "required": ["city", "days", "detail"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "description": "The local time"}},
]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS}
FORCED_CALLS = 200


def reply_of(client: Client, session: str, timeout: float = 300) -> dict[str, Any]:
    data: dict[str, Any] = client.wait_topic(f"chat/tools/{session}/reply", timeout).json()
    return data


def test_forced_calls_always_parse_and_validate(shared_worker: WorkerProcess, client: Client) -> None:
    """FORCED_CALLS forced calls (required, and each tool named) on the random-weights model:
    all of them are calls in the model's own format that parse and validate."""
    choices: list[Any] = ["required", *({"type": "function", "function": {"name": name}} for name in SCHEMAS)]
    sessions = [f"forced-{uuid.uuid4().hex[:8]}-{i}" for i in range(FORCED_CALLS)]
    for i, session in enumerate(sessions):
        client.publish(
            f"chat/tools/{session}/request",
            {"message": f"Do task {i}.", "tools": TOOLS, "toolChoice": choices[i % len(choices)], "maxTokens": 96},
        )
    outcomes: Counter[str] = Counter()
    for i, session in enumerate(sessions):
        reply = reply_of(client, session)
        assert "error" not in reply, reply
        assert reply["finishReason"] == "tool_calls" and "toolParseError" not in reply, reply
        (call,) = reply["toolCalls"]
        name = call["function"]["name"]
        choice = choices[i % len(choices)]
        assert choice == "required" or name == choice["function"]["name"]
        arguments = json.loads(call["function"]["arguments"])
        jsonschema.validate(arguments, SCHEMAS[name])
        outcomes[name] += 1
    assert sum(outcomes.values()) == FORCED_CALLS and set(outcomes) == set(SCHEMAS)
    print(f"forced calls: {FORCED_CALLS} of {FORCED_CALLS} parsed and valid; by tool: {dict(outcomes)}")


def test_a_client_tool_round_streams_no_markup_and_reuses_the_prefix(
    shared_worker: WorkerProcess, client: Client
) -> None:
    session = f"round-{uuid.uuid4().hex[:8]}"
    topic = f"chat/tools/{session}/request"
    system = "You control the devices of a small house. Answer briefly. " * 6
    client.publish(
        topic,
        {
            "message": "Switch on the kitchen lamp.",
            "systemPrompt": system,
            "tools": TOOLS,
            "toolChoice": {"type": "function", "function": {"name": "set_lamp"}},
            "stream": True,
            "requestId": f"{session}-1",
        },
    )
    first = reply_of(client, session)
    assert first["finishReason"] == "tool_calls", first
    (call,) = first["toolCalls"]
    assert call["function"]["name"] == "set_lamp" and call["id"].startswith("call_")
    announced = client.wait_for(
        lambda m: m.topic == f"chat/tools/{session}/stream" and "toolCalls" in m.json(), timeout=30
    ).json()
    assert announced["toolCalls"] == first["toolCalls"] and announced["requestId"] == f"{session}-1"
    # The answer: the tools are kept by the session, the results continue the open turn.
    client.publish(
        topic,
        {
            "toolResults": [{"toolCallId": call["id"], "content": '{"ok": true}'}],
            "toolChoice": "none",
            "maxTokens": 8,
            "stream": True,
            "requestId": f"{session}-2",
        },
    )
    second = reply_of(client, session)
    assert "error" not in second and second["finishReason"] in ("stop", "length") and "toolCalls" not in second
    # The whole first prompt (system prompt, tools, the user message) is found cached.
    reused = first["usage"]["promptTokens"] // BLOCK_SIZE * BLOCK_SIZE
    assert second["usage"]["cachedTokens"] >= reused, (first["usage"], second["usage"])
    assert second["usage"]["promptTokens"] > first["usage"]["promptTokens"] + first["usage"]["completionTokens"]
    deltas = [m.json() for m in client.seen if m.topic == f"chat/tools/{session}/stream"]
    client.seen = [m for m in client.seen if m.topic != f"chat/tools/{session}/stream"]
    assert not any("<tool_call>" in d.get("delta", "") for d in deltas)
    # A redelivered toolResults request is answered from the store, never generated twice.
    client.publish(
        topic,
        {
            "toolResults": [{"toolCallId": call["id"], "content": '{"ok": true}'}],
            "toolChoice": "none",
            "maxTokens": 8,
            "requestId": f"{session}-2",
        },
    )
    assert reply_of(client, session) == second


def test_response_format_with_tools_is_refused_by_name(shared_worker: WorkerProcess, client: Client) -> None:
    session = f"fmt-{uuid.uuid4().hex[:8]}"
    client.publish(
        f"chat/tools/{session}/request",
        {"message": "x", "tools": TOOLS, "responseFormat": {"type": "json_object"}, "maxTokens": 8},
    )
    reply = reply_of(client, session, timeout=60)
    assert reply["error"]["code"] == "invalid_request" and "responseFormat" in reply["error"]["message"]
    client.publish(
        f"chat/tools/{session}/request",
        {"message": "x", "toolChoice": "none", "responseFormat": {"type": "json_object"}, "maxTokens": 32},
    )
    formatted = reply_of(client, session)
    assert "error" not in formatted and "toolCalls" not in formatted
