"""Simulated workers for the load test (bench/scale.py): the worker's real Service and
MqttTransport (and with Redis its Intake and RedisStore), each its own MQTT client, client id
and status topic, all in one share group, with an engine that costs nothing and a
one-token-per-word renderer (devtools/fakes.py: ZeroCostEngine, WordRenderer).

    python -m bench.scale host PORT FIRST COUNT ENGINE_JSON   # how bench/scale.py starts them
"""

from __future__ import annotations

import asyncio
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
    from worker.core.service import InFlight, Service
    from worker.intake.group import Intake
    from worker.protocol.topics import Topics
    from worker.store import open_store
    from worker.system.logs import configure_logging
    from worker.transport.mqtt import MqttSettings, MqttTransport

    configure_logging(os.environ.get("SIM_LOG_LEVEL", "WARNING"), json_logs=False)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    topics = Topics(PREFIX)
    shared = tuple(topics.subscriptions(GROUP))
    redis_url = options.pop("redis_url", None)
    running: list[tuple[MqttTransport, Intake | None, asyncio.Future[None]]] = []
    for index in range(first, first + count):
        worker_id = f"sim-{index}"
        config = WorkerConfig.model_validate(
            {
                "engine": {"model": "zero-cost"},
                "mqtt": {"port": port, "worker_id": worker_id, "session_expiry": 0, "share_group": GROUP},
                "history": {"store": "redis" if redis_url else "memory"},
                "redis": {"url": redis_url} if redis_url else {},
                "limits": {"max_requests_per_user_per_minute": 0},
                "stats": {"interval": 0},
            }
        )
        settings = MqttSettings(
            host="127.0.0.1",
            port=port,
            client_id=worker_id,
            username=None,
            password=None,
            keepalive=30,
            reconnect_min_delay=1,
            reconnect_max_delay=5,
            session_expiry=0,
            subscriptions=shared,
            status_topic=topics.status(worker_id),
            receive_maximum=config.limits.max_pending_requests,
        )
        transport = MqttTransport(settings, loop)
        in_flight = InFlight(config.limits.max_pending_requests)
        intake = None
        if redis_url:
            instance = f"{worker_id}.{index}"
            intake = Intake.for_group(config, transport, topics, instance, lambda code: stop.set(), in_flight.room)
        store = open_store(config.history, config.redis, PREFIX)
        engine = ZeroCostEngine(**options)
        service = Service(
            config, engine, WordRenderer(), intake or transport, lambda code: stop.set(), store, in_flight
        )
        if intake is not None:
            await intake.start()
        transport.start()
        await asyncio.wait_for(transport.wait_connected(), 30)
        await asyncio.wait_for(transport.wait_subscribed(), 30)
        running.append((transport, intake, asyncio.ensure_future(service.consume())))
    print("ready", flush=True)
    await stop.wait()
    for transport, intake, consumer in running:
        consumer.cancel()
        if intake is not None:
            await intake.close()
        await transport.close(2)
