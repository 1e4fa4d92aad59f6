"""No user or tool text in the log at INFO or above (issue 30, point 7), for the worker's own
tools: the in-process worker (devtools/inproc.py) on the tests' mosquitto, the fake engine
writing the model's calls (vLLM's hermes parser reads them), an MCP-over-MQTT server
(devtools/mcp_mqtt_server.py) whose ``raw`` and ``fail`` tools answer what the call asks. Each
kind of text carries a marker of its own, and the worker's log at INFO (what a deployment
logs) must hold none of them: a tool call's arguments, a call whose arguments break a strict
tool's schema (its toolParseError quotes the value), a tool's result, a JSON-RPC error's
message, a client's workerTools name that is refused, and a line of server output that is no
JSON. (The MCP SDK's own loggers: tests/unit/test_mcp_errors.py; a user's message and the
model's reply: tests/engine/test_hardened.py.)"""

from __future__ import annotations

import json
import queue
import secrets
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from loguru import logger

from devtools.fakes import FakeEngine
from devtools.inproc import LiveWorker
from devtools.mcp_mqtt_server import McpMqttServer
from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import connect
from devtools.waiting import PATIENCE, eventually
from worker.engine.tokenizer import ChatTokenizer
from worker.engine.vllm import tool_support

OBJECT = {"type": "object"}
MARKS = {kind: f"{kind}-{secrets.token_hex(5)}" for kind in ("argument", "parse", "result", "error", "name", "output")}


def call(name: str, arguments: dict[str, Any]) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


@pytest.fixture
def server(broker: Mosquitto) -> Iterator[McpMqttServer]:
    box = McpMqttServer(broker.port, f"logs-{uuid.uuid4().hex[:6]}/box")
    box.tools += [{"name": name, "description": name, "inputSchema": OBJECT} for name in ("fail", "raw")]
    box.start()
    yield box
    box.stop()


@pytest.fixture
def log() -> Iterator[list[str]]:
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="INFO")
    yield lines
    logger.remove(sink)


@pytest.fixture
def live(broker: Mosquitto, tokenizer: ChatTokenizer, server: McpMqttServer) -> Iterator[LiveWorker]:
    tools = {"mcp_mqtt": {"server_filter": server.name, "users": ["*"], "timeout": 20}}
    worker = LiveWorker(
        broker.port, engine=FakeEngine(), tool_support=tool_support("auto", tokenizer, "tiny"), tools=tools
    )
    yield worker
    worker.close()


def test_no_tool_text_in_the_log_at_info(live: LiveWorker, server: McpMqttServer, log: list[str]) -> None:
    replies: queue.Queue[dict[str, Any]] = queue.Queue()
    client = connect(
        live.config.mqtt.port,
        [live.topic("eve", "+", "reply")],
        on_message=lambda m: replies.put(json.loads(m.payload)),
    )
    prefix = server.name.replace("/", "_") + "_"

    def ask(payload: dict[str, Any]) -> dict[str, Any]:
        client.publish(live.topic("eve", "s"), json.dumps(payload), qos=1)
        reply = replies.get(timeout=PATIENCE)
        assert reply.get("requestId") == payload["requestId"], reply
        return reply

    try:
        eventually(
            lambda: live.call(
                lambda: any(t.name.startswith(prefix) for t in live.service.turns.toolbox.available("eve").values())  # type: ignore[union-attr]
            ),
            "the MCP server was not discovered",
        )
        result_line = json.dumps(
            {"jsonrpc": "2.0", "id": "@ID@", "result": {"content": [{"type": "text", "text": MARKS["result"]}]}}
        ).replace('"@ID@"', "@ID@")
        live.engine.rounds["r1"] = [
            call(prefix + "raw", {"payload": "not json " + MARKS["output"] + "\n", "note": MARKS["argument"]}),
            call(prefix + "raw", {"payload": result_line}),
            call(prefix + "fail", {"error": {"code": -32000, "message": MARKS["error"]}}),
            "done",
        ]
        reply = ask({"message": "go", "requestId": "r1", "workerTools": ["*"]})
        outcomes = [c["outcome"] for c in reply["workerCalls"]]
        assert outcomes == ["timeout", "ok", "error"], reply
        assert reply["workerCalls"][1]["result"] == MARKS["result"]
        assert MARKS["error"] in reply["workerCalls"][2]["result"]
        # A strict client tool whose argument breaks its schema: the reply's toolParseError quotes it.
        strict = {
            "type": "function",
            "function": {
                "name": "count",
                "strict": True,
                "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
            },
        }
        live.engine.rounds["r2"] = [call("count", {"n": MARKS["parse"]})]
        reply = ask({"message": "count", "requestId": "r2", "tools": [strict]})
        assert MARKS["parse"] in reply["toolParseError"], reply
        refused = ask({"message": "x", "requestId": "r3", "workerTools": [MARKS["name"]]})
        assert refused["error"]["code"] == "invalid_request"
    finally:
        client.disconnect()
        client.loop_stop()
    text = "\n".join(log)
    assert "tool call not taken" in text and "workerTools of eve refused" in text  # the lines are there
    for kind, mark in MARKS.items():
        assert mark not in text, f"the {kind} is in the log at INFO: " + next(line for line in log if mark in line)
