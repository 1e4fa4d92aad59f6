"""MCP over MQTT, the worker's client side (worker/tools/mcp_mqtt.py): what discovery and a
call cost, through a real mosquitto and the tests' MCP-over-MQTT server
(devtools/mcp_mqtt_server.py) in its own process.

    python -m bench.mcp_mqtt [--calls 1000] [--concurrency 16] [--repeat 3] [--provider MODULE:CLASS]

Per repeat, a fresh provider on the worker's own MqttTransport (the Messaging port):
``list``: from start() to the server's tools offered (presence, initialize, initialized,
tools/list); ``serial``: ``--calls`` calls of ``add`` one after another (the round trip);
``concurrent``: as many again, ``--concurrency`` at a time. Printed: the median over the
repeats, as JSON (the numbers behind the comment in worker/tools/mcp_mqtt.py).
``--provider bench.mcp_mqtt_sdk:SdkMcpOverMqtt`` measures the same on the official MCP SDK's
ClientSession instead of the provider's own JSON-RPC.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from loguru import logger

from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import transport_on
from worker.config.models import McpMqttConfig
from worker.tools.mcp_mqtt import McpOverMqtt
from worker.tools.port import CallContext, ToolOutcome

CTX = CallContext("bench", "bench:0:0", "bench/s1")


async def one_repeat(port: int, name: str, calls: int, concurrency: int, provider_class: Any) -> dict[str, float]:
    async with transport_on(port) as messaging:
        config = McpMqttConfig(server_filter=name, users=["*"], timeout=30)
        provider = provider_class(config, messaging, f"bench-{uuid.uuid4().hex[:6]}")
        tool = name.replace("/", "_") + "_add"
        started = time.perf_counter()
        await provider.start()
        while not any(t.name == tool for t in provider.tools()):
            await asyncio.sleep(0.001)
        listed = time.perf_counter() - started
        try:
            started = time.perf_counter()
            for i in range(calls):
                outcome = await provider.call(tool, {"a": i, "b": 1}, CTX)
                assert outcome == ToolOutcome(str(i + 1)), outcome
            serial = time.perf_counter() - started

            gate = asyncio.Semaphore(concurrency)

            async def call(i: int) -> None:
                async with gate:
                    outcome = await provider.call(tool, {"a": i, "b": 2}, CTX)
                    assert outcome == ToolOutcome(str(i + 2)), outcome

            started = time.perf_counter()
            await asyncio.gather(*(call(i) for i in range(calls)))
            concurrent = time.perf_counter() - started
        finally:
            await provider.close()
    return {
        "list_ms": listed * 1000,
        "serial_call_ms": serial * 1000 / calls,
        "serial_calls_per_s": calls / serial,
        "concurrent_calls_per_s": calls / concurrent,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--provider", help="module:class of another provider to measure (default: worker.tools.mcp_mqtt's)"
    )
    args = parser.parse_args()
    provider_class: Any = McpOverMqtt
    if args.provider:
        module, _, attribute = args.provider.partition(":")
        provider_class = getattr(importlib.import_module(module), attribute)
    logger.remove()  # the transport logs every packet at DEBUG
    logger.add(sys.stderr, level="WARNING")
    with tempfile.TemporaryDirectory() as tmp:
        broker = Mosquitto(Path(tmp), persistence=False, log=False)
        broker.start()
        name = f"bench-{uuid.uuid4().hex[:6]}/calc"
        server = subprocess.Popen(
            [sys.executable, "-m", "devtools.mcp_mqtt_server", "--port", str(broker.port), "--name", name],
            stdout=subprocess.DEVNULL,
        )
        try:
            # A first, short round, not counted: the server process starts and goes online.
            asyncio.run(one_repeat(broker.port, name, 50, args.concurrency, provider_class))
            runs = [
                asyncio.run(one_repeat(broker.port, name, args.calls, args.concurrency, provider_class))
                for _ in range(args.repeat)
            ]
        finally:
            server.terminate()
            server.wait(10)
            broker.stop()
    result: dict[str, Any] = {key: round(statistics.median(r[key] for r in runs), 3) for key in runs[0]}
    result["runs"] = runs
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
