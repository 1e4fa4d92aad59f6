"""Tool calling end to end: the shared worker (the tiny random model with Qwen2.5's tools
chat template and its <tool_call> tokens) over MQTT, the real vLLM CPU engine, vLLM's hermes
parser. A random model never calls a tool by itself, so the rounds here are forced calls:
the grammar makes it write its native call format, and every forced call must parse and
validate against the tool's parameters."""

from __future__ import annotations

import json
import time
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


# A tool's parameters with each form of local reference (issue 30, point 6): in a forced call the
# arguments schema is no longer the root, so each must still lead where it led. The random model
# recurses into "#" often (10 levels and more, ~7 tokens each): its calls get 1024 tokens.
LEAF = {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["v"]}
REF_FORMS: dict[str, dict[str, Any]] = {
    "root": {
        "type": "object",
        "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9}, "next": {"$ref": "#"}},
        "required": ["v"],
        "additionalProperties": False,
    },
    "properties": {
        "type": "object",
        "properties": {"a": {"enum": ["x", "y"]}, "b": {"$ref": "#/properties/a"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    "defs_nested": {
        "type": "object",
        "$defs": {"leaf": LEAF, "pair": {"type": "array", "items": {"$ref": "#/$defs/leaf"}, "maxItems": 2}},
        "properties": {"p": {"$ref": "#/$defs/pair"}, "q": {"$ref": "#/$defs/pair/items"}},
        "required": ["p", "q"],
        "additionalProperties": False,
    },
    "escaped": {
        "type": "object",
        "properties": {
            "a/b": {"type": "integer", "minimum": 0, "maximum": 9},
            "c~d": {"type": "boolean"},
            "e f": {"enum": ["x", "y"]},
            "r1": {"$ref": "#/properties/a~1b"},
            "r2": {"$ref": "#/properties/c~0d"},
            "r3": {"$ref": "#/properties/e%20f"},
        },
        "required": ["r1", "r2", "r3"],
        "additionalProperties": False,
    },
    "anchor": {
        "type": "object",
        "$defs": {"leaf": {"$anchor": "leaf", **LEAF, "additionalProperties": False}},
        "properties": {"p": {"$ref": "#leaf"}},
        "required": ["p"],
        "additionalProperties": False,
    },
}
CALLS_PER_FORM = 50
MAX_TOKENS = {form: 1024 if form == "root" else 160 for form in REF_FORMS}


def depth(value: Any) -> int:
    return 1 + depth(value["next"]) if isinstance(value, dict) and "next" in value else 0


def test_forced_calls_parse_for_every_local_reference_form(shared_worker: WorkerProcess, client: Client) -> None:
    """CALLS_PER_FORM forced calls per form of local reference ('#', '#/properties/...', nested
    '#/$defs/...', ~1 ~0 and %20 escapes, an anchor), all sent at once: each is a call that
    parses and validates against the tool's own parameters. Before the fix, '#' broke about one
    call in four and the others were refused as invalid_schema."""
    # One tool per request: the prompt stays short enough for the recursive form's maxTokens.
    tools = {
        form: [{"type": "function", "function": {"name": f"ref_{form}", "parameters": schema}}]
        for form, schema in REF_FORMS.items()
    }
    started = time.monotonic()
    depths: Counter[int] = Counter()
    sessions: list[tuple[str, str]] = []
    for form in REF_FORMS:
        for i in range(CALLS_PER_FORM):
            session = f"refs-{form.replace('_', '-')}-{uuid.uuid4().hex[:8]}-{i}"
            sessions.append((session, form))
            choice = {"type": "function", "function": {"name": f"ref_{form}"}}
            client.publish(
                f"chat/tools/{session}/request",
                {"message": f"Do {i}.", "tools": tools[form], "toolChoice": choice, "maxTokens": MAX_TOKENS[form]},
            )
    for session, form in sessions:
        reply = reply_of(client, session)
        assert "error" not in reply, (form, reply)
        assert reply["finishReason"] == "tool_calls" and "toolParseError" not in reply, (form, reply)
        (call,) = reply["toolCalls"]
        assert call["function"]["name"] == f"ref_{form}"
        arguments = json.loads(call["function"]["arguments"])
        jsonschema.validate(arguments, REF_FORMS[form])
        if form == "root":
            depths[depth(arguments)] += 1
    took = time.monotonic() - started
    print(f"forced calls per reference form: {CALLS_PER_FORM} x {len(REF_FORMS)} valid in {took:.1f} s")
    print(f"recursion depths of the '#' form's calls: {dict(sorted(depths.items()))}")


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
    announced = client.wait_for(lambda m: m.topic == f"chat/tools/{session}/stream" and "toolCalls" in m.json()).json()
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
    reply = reply_of(client, session)
    assert reply["error"]["code"] == "invalid_request" and "responseFormat" in reply["error"]["message"]
    client.publish(
        f"chat/tools/{session}/request",
        {"message": "x", "toolChoice": "none", "responseFormat": {"type": "json_object"}, "maxTokens": 32},
    )
    formatted = reply_of(client, session)
    assert "error" not in formatted and "toolCalls" not in formatted
