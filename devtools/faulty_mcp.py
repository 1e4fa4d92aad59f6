"""A stdio MCP server that misbehaves on demand, for the tests of worker/tools/mcp.py: plain
JSON-RPC lines on stdin/stdout, no SDK (the SDK would not let it send what a hostile server
sends). Tools:

- ``fail {"error": <any JSON>}``: answers the call with that JSON-RPC ``error`` member as is
  (any code, a code that is not a number, no message, odd data, a huge message);
- ``raw {"line": "..."}``: writes the line as is, with every ``@ID@`` replaced by the call's id
  (a lone surrogate escape, a line that is no JSON at all, ...);
- ``echo {"text": "..."}``: answers the text;
- ``slow {"seconds": N}``: answers "done" after N seconds (calls run at once, each in a thread);
  ``slow {"started": PATH, "until": PATH}``: creates the first file, answers once the second exists;
- ``pid``: its process id (a restart changes it).

With ``FAULTY_PAGES=endless`` in its environment, its tools/list never ends: every page
answers a new ``nextCursor``, the first page with the tools above, each further page with
one more tool (``more1``, ``more2``, ...).

    python devtools/faulty_mcp.py

Standalone (no import of the worker), like devtools/calc_mcp.py.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

OBJECT = {"type": "object"}
TOOLS = [
    {"name": name, "description": f"{name} (see devtools/faulty_mcp.py)", "inputSchema": OBJECT}
    for name in ("fail", "raw", "echo", "slow", "pid")
]
_write = threading.Lock()


def send(line: str) -> None:
    with _write:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def answer(request_id: Any, result: dict[str, Any]) -> None:
    send(json.dumps({"jsonrpc": "2.0", "id": request_id, "result": result}))


def text(value: str) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": value}], "isError": False}


def call(request_id: Any, name: str, arguments: dict[str, Any]) -> None:
    if name == "fail":
        send(json.dumps({"jsonrpc": "2.0", "id": request_id, "error": arguments.get("error")}))
    elif name == "raw":
        send(str(arguments.get("line", "")).replace("@ID@", json.dumps(request_id)))
    elif name == "echo":
        answer(request_id, text(str(arguments.get("text", ""))))
    elif name == "slow":
        if "started" in arguments:  # a test holds it: it says it runs, and waits for "until"
            Path(arguments["started"]).touch()
            while not Path(arguments["until"]).exists():
                time.sleep(0.02)
        else:
            time.sleep(float(arguments.get("seconds", 1)))
        answer(request_id, text("done"))
    elif name == "pid":
        answer(request_id, text(str(os.getpid())))
    else:
        send(json.dumps({"jsonrpc": "2.0", "id": request_id, "error": {"code": -32602, "message": "unknown tool"}}))


# JSON-RPC error members of any shape a server may send, and what the model is told of each
# (tests/unit/test_mcp_errors.py for stdio, tests/broker/test_mcp_mqtt_errors.py over MQTT).
ERRORS: list[tuple[Any, str]] = [
    ({"code": -32000, "message": "server busy"}, "Error: server busy"),
    ({"code": -32603, "message": "boom"}, "Error: boom"),
    ({"code": "oops", "message": "a code that is a string"}, "Error: a code that is a string"),
    ({"code": None, "message": "a null code"}, "Error: a null code"),
    ({"code": 1.5, "message": "a fractional code"}, "Error: a fractional code"),
    ({"code": 7}, "JSON-RPC error (code 7)"),
    ({"code": 7, "message": 12}, "JSON-RPC error (code 7)"),
    ({"code": 1, "message": "list data", "data": [1, {"a": None}, "x"]}, "Error: list data"),
    ({"code": 1, "message": "text data", "data": "details"}, "Error: text data"),
    ({"code": 1, "message": "number data", "data": 3.5}, "Error: number data"),
    ({"code": 1, "message": "null data", "data": None}, "Error: null data"),
    ({"code": 1, "message": "x" * 200_000}, "Error: " + "x" * 1000 + "…"),
    ("just a string", "JSON-RPC error (code -32603)"),
    (None, "JSON-RPC error (code -32603)"),
    ([1, 2], "JSON-RPC error (code -32603)"),
]


def main() -> None:
    for line in sys.stdin:
        try:
            message = json.loads(line)
        except ValueError:
            continue
        method, request_id = message.get("method"), message.get("id")
        if request_id is None:
            continue  # a notification (initialized, cancelled)
        if method == "initialize":
            version = (message.get("params") or {}).get("protocolVersion", "2025-06-18")
            info = {"name": "faulty", "version": "0.1"}
            answer(request_id, {"protocolVersion": version, "capabilities": {"tools": {}}, "serverInfo": info})
        elif method == "tools/list" and os.environ.get("FAULTY_PAGES") == "endless":
            cursor = (message.get("params") or {}).get("cursor")
            page = int(cursor) if cursor else 0
            tools = [{"name": f"more{page}", "inputSchema": OBJECT}] if page else TOOLS
            answer(request_id, {"tools": tools, "nextCursor": str(page + 1)})
        elif method == "tools/list":
            answer(request_id, {"tools": TOOLS})
        elif method == "ping":
            answer(request_id, {})
        elif method == "tools/call":
            params = message.get("params") or {}
            arguments = params.get("arguments") or {}
            threading.Thread(target=call, args=(request_id, params.get("name"), arguments), daemon=True).start()
        else:
            send(json.dumps({"jsonrpc": "2.0", "id": request_id, "error": {"code": -32601, "message": "no method"}}))


if __name__ == "__main__":
    main()
