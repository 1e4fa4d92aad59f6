"""Simulated workers for the load test (bench/scale.py): the worker's own parts as the server
wires them (worker/wiring.py: the real Service and MqttTransport, and with Redis its Intake and
RedisStore), each its own MQTT client, client id and status topic, all in one share group,
with an engine that costs nothing and a one-token-per-word renderer (devtools/fakes.py:
ZeroCostEngine, WordRenderer).

    python -m bench.scale host PORT FIRST COUNT ENGINE_JSON   # how bench/scale.py starts them
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from typing import Any

PREFIX = "chat"
GROUP = "sim"


async def host_workers(port: int, first: int, count: int, options: dict[str, Any]) -> None:
    """``count`` workers on this process's event loop until SIGTERM; prints ``ready``.
    ``options``: the ZeroCostEngine's arguments, and ``redis_url`` for the Redis store and
    intake (each worker its own connections, as worker/server.py sets them up), else an
    in-memory store each."""
    from devtools.fakes import WordRenderer, ZeroCostEngine
    from worker.config.models import WorkerConfig
    from worker.store import open_store
    from worker.system.logs import configure_logging
    from worker.wiring import Parts, wire

    configure_logging(os.environ.get("SIM_LOG_LEVEL", "WARNING"), json_logs=False)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    redis_url = options.pop("redis_url", None)
    running: list[tuple[Parts, asyncio.Future[None]]] = []
    async with contextlib.AsyncExitStack() as resources:
        for index in range(first, first + count):
            worker_id = f"sim-{index}"
            mqtt = {"host": "127.0.0.1", "port": port, "worker_id": worker_id, "topic_prefix": PREFIX}
            mqtt |= {"session_expiry": 0, "share_group": GROUP, "keepalive": 30, "reconnect_max_delay": 5}
            config = WorkerConfig.model_validate(
                {
                    "engine": {"model": "zero-cost"},
                    "mqtt": mqtt,
                    "history": {"store": "redis" if redis_url else "memory"},
                    "redis": {"url": redis_url} if redis_url else {},
                    "limits": {"max_requests_per_user_per_minute": 0},
                    "stats": {"interval": 0},
                }
            )
            store = open_store(config.history, config.redis, PREFIX)
            resources.callback(store.close)
            parts = wire(config, ZeroCostEngine(**options), WordRenderer(), store, lambda code: stop.set())
            await parts.start(resources)
            await asyncio.wait_for(parts.transport.wait_connected(), 30)
            await asyncio.wait_for(parts.transport.wait_subscribed(), 30)
            running.append((parts, asyncio.ensure_future(parts.service.consume())))
        print("ready", flush=True)
        await stop.wait()
        for _, consumer in running:
            consumer.cancel()
        # Leaving the block closes every worker's transport and intake, the last started first.
