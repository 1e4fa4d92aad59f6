"""The worker's lifecycle: ``Server(config).serve()`` starts the worker, serves until told to
stop, and stops it; the exit code. Modelled on uvicorn's ``Server`` (``serve`` → ``startup``
/ ``main_loop`` / ``shutdown``) and hypercorn's ``worker_serve`` (a ``finally`` that cancels
the background tasks and waits for them under a timeout).

Start (``startup``), one method a step, in order: ``with_sampling_defaults``, the sampling
defaults resolved once (the configuration's, else the model's generation_config.json, else
built in); ``_check_broker``, one login to the broker
(a broker that is down, or refuses the login, is found in seconds instead of after minutes of
loading the model); ``_import_engine_libraries``, vLLM, torch and transformers;
``_open_metrics`` and ``_open_store`` (a port in use, a bad state_dir or an unreachable Redis
fail before the model load); ``_load_tokenizer``; ``_start_engine`` and ``_warm_up``; then
``_connect``, the service wired to MQTT (worker/wiring.py; in a group on Redis, the intake
joins first), so that the retained ``online`` status means the worker can answer; last, the
background tasks. Each resource goes on an ``AsyncExitStack`` as it is opened: a start that
fails at any step closes what the steps before it opened, in reverse order, and nothing else.
A start that cannot go on (the broker, the metrics port, the store, the group in Redis) raises
``CannotStart`` and ends with exit code 2; an error of the tokenizer or the engine is raised,
after the same clean-up.

Stop (``shutdown``), on SIGTERM/SIGINT, an injected ``shutdown_trigger``, or a dead engine
(exit code 1): stop receiving (a share group's member unsubscribes), let running generations
finish up to ``drain_timeout`` (none when the engine died), publish the last stats; then the
background tasks are cancelled and awaited, and the exit stack closes the rest in reverse
order of opening: ``offline`` is published and the connection closed, the intake leaves the
group, the engine shut down, the store closed, the metrics endpoint closed. Ctrl-C in the
worker's terminal is this same stop: the engine's processes never get the terminal's SIGINT
(system/children.py). A second signal exits at once, leaving what is unanswered to the
broker's redelivery. A signal during the start cancels it (``_start``; the engine start,
which holds the event loop, through ``_signals_cancel_the_start``): "Stopped during the
start", exit code 0. The signal handlers are the server's only while it runs: the previous
ones are restored afterwards. Under systemd (``Type=notify``) each step is reported (system/notify.py).

paho is imported at the broker check (milliseconds), vLLM in the import phase: importing this
module imports neither (main.py sets CUDA_VISIBLE_DEVICES before vLLM may be imported).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Coroutine, Iterator
from typing import TYPE_CHECKING, Any

from loguru import logger

from . import __version__
from .config.loader import render_toml
from .config.models import (
    MODEL_DEFAULTS_FILE,
    SAMPLING_OFF,
    WorkerConfig,
    nvidia_gpu_present,
    read_model_defaults,
    resolve_sampling,
)
from .engine.limits import pending_limit_short
from .engine.port import ServedEngine, ToolSupport, VisionSettings, WarmupPlan
from .protocol.topics import Topics
from .system.children import remove_files
from .system.logs import route_library_logging
from .system.notify import Notifier
from .system.progress import start_phase

if TYPE_CHECKING:
    from .core.service import Service
    from .engine.tokenizer import ChatTokenizer
    from .intake.group import Intake
    from .store.port import HistoryStore
    from .system.metrics import MetricsEndpoint
    from .transport.mqtt import MqttSettings, MqttTransport


HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)

# How often the worker checks that vLLM's engine is alive: a dead engine is noticed within
# about this long also while no generation runs (a running one notices at once).
ENGINE_CHECK_INTERVAL = 1.0

# How long the stop waits for the background tasks it cancelled (consume, stats, session
# expiry, watchdog, ...) before it closes what they use.
TASKS_TIMEOUT = 5.0


# Starts the engine for a configuration and the tokenizer's stop token ids.
EngineStarter = Callable[[WorkerConfig, list[int]], Awaitable[ServedEngine]]


async def start_vllm(config: WorkerConfig, stop_token_ids: list[int]) -> ServedEngine:
    """The worker's engine: vLLM, its frontend in a process of its own (engine/remote.py) or in
    this one (``frontend_apart``)."""
    if frontend_apart(config):
        from .engine.remote import RemoteEngine

        starter = f"{__name__}:{start_vllm_here.__name__}"
        logs = config.logging
        return await RemoteEngine.start(engine_process, starter, (config, stop_token_ids), logs.level, logs.json_logs)
    return await start_vllm_here(config, stop_token_ids)


ENGINE_PROCESS_TITLE = "EngineFrontend"


def engine_process(sock: Any, starter: str, args: tuple[Any, ...], log_level: str, json_logs: bool) -> None:
    """The engine's own process (engine/remote.py; multiprocessing spawns it with this target):
    its life tied to the worker's and out of the terminal's reach, as vLLM's processes
    (system/children.py), logging as the worker does, named in ps, then the engine started by
    ``starter`` (``module:function``) and served to the worker over ``sock``."""
    import importlib

    from .engine.remote_host import serve
    from .system.children import die_with_parent
    from .system.logs import configure_logging

    die_with_parent()
    configure_logging(log_level, json_logs=json_logs)
    with contextlib.suppress(ImportError):  # vLLM's dependency
        importlib.import_module("setproctitle").setproctitle(ENGINE_PROCESS_TITLE)
    asyncio.run(serve(sock, starter, args))


def frontend_apart(config: WorkerConfig, *, gpu: bool | None = None) -> bool:
    """Whether vLLM's frontend runs in a process of its own (engine.frontend_process; auto: on
    with a GPU; ``gpu``: whether this machine has one, default: looked up)."""
    choice = config.engine.frontend_process
    return choice == "on" or (choice == "auto" and (nvidia_gpu_present() if gpu is None else gpu))


async def start_vllm_here(config: WorkerConfig, stop_token_ids: list[int]) -> ServedEngine:
    """vLLM in this process (imported by the start's import phase, or by the engine's own
    process: engine/remote_host.py)."""
    from .engine.vllm import VllmEngine

    vision = VisionSettings(
        max_pixels=config.vision.max_pixels,
        max_images_in_prompt=config.vision.max_images_in_prompt,
        image_threads=config.vision.image_threads,
        image_torch_threads=config.vision.image_torch_threads,
    )
    return await VllmEngine.start(
        config.engine,
        vision=vision,
        stop_token_ids=stop_token_ids,
        json_disable_any_whitespace=config.generation.json_disable_any_whitespace,
        progress_bars=config.logging.vllm_level in ("DEBUG", "INFO"),
        sampling=config.generation.engine_sampling(),
        session_tokens=config.history.max_history_tokens + config.generation.max_tokens,
    )


SAMPLING_SOURCES = {"config": "config", "model": MODEL_DEFAULTS_FILE, "built-in": "built-in"}


def with_sampling_defaults(config: WorkerConfig) -> WorkerConfig:
    """The configuration with its sampling defaults resolved, once, at start: what the
    configuration sets, else the model's generation_config.json, else the built-in default
    (config/models.py resolve_sampling). Logged with where each came from; a request's own
    temperature and topP still come first."""
    values, problem = read_model_defaults(config.engine.model)
    if problem:
        logger.warning("The model's sampling defaults are not used: {}", problem)
    generation, sources = resolve_sampling(config.generation, values)
    for source in sources:
        if source.note:
            logger.warning("The model's sampling default is not used: {}", source.note)
    shown = [
        f"{s.name}={'off' if s.value in SAMPLING_OFF.get(s.name, ()) else format(s.value, 'g')} "
        f"({SAMPLING_SOURCES[s.source]})"
        for s in sources
    ]
    logger.info("Sampling defaults of requests that set none: {}", ", ".join(shown))
    return config.model_copy(update={"generation": generation})


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
    try:
        return await _broker_accepts(settings, check, notifier, stop, wait=wait)
    except asyncio.CancelledError:
        if not stop.is_set():
            raise
        # A stop cancels the start (Server._start): here it ends the wait like ``stop`` does.
        task = asyncio.current_task()
        if task is not None and hasattr(task, "uncancel"):  # 3.11+
            task.uncancel()
        return False


async def _broker_accepts(
    settings: MqttSettings,
    check: Callable[[MqttSettings], None],
    notifier: Notifier,
    stop: asyncio.Event,
    *,
    wait: bool,
) -> bool:
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


def freeze_startup_heap() -> None:
    """Move every object alive once the worker is up (vLLM, torch, transformers, the model's
    configuration: some 675,000 objects here) out of the garbage collector's reach, as ``vllm
    serve`` does after its start and vLLM's engine core after its own.

    Otherwise each full collection walks all of them, on whichever thread allocates at the
    time: on a busy 2-core machine full collections of this process took 450-860 ms each, two
    of them (760 and 860 ms) as bursts of 1,000 requests came in; on an H200 the thread that
    decodes the engine core's outputs spent 118 of the worker's 434 samples (py-spy --gil, a
    320-session burst) at the first Python line after msgspec's allocations, where a collection
    they triggered runs, against 3 in raw AsyncLLM's process: 0.47 s, one full collection. Frozen, the longest full
    collection within a burst fell from 528 to 78 ms at 1,000 sessions and from 505 to 196 ms
    at 2,000 (an H200, bench BENCH_GC: docs/performance.md, "Admission"). Objects made later
    (sessions, requests) are collected as before; ``gc.unfreeze`` at the stop hands the frozen
    ones back."""
    gc.collect()
    gc.freeze()


def _name(task: asyncio.Future[Any]) -> str:
    return task.get_name() if isinstance(task, asyncio.Task) else repr(task)


async def cancel_and_wait(tasks: Collection[asyncio.Future[Any]], timeout: float) -> set[asyncio.Future[Any]]:
    """Cancel ``tasks`` and wait up to ``timeout`` for them to end, so that what they do on
    their way out does not overlap what the caller closes next. A task that failed earlier is
    logged with its error. Those still running after ``timeout`` are logged at WARNING and
    left (returned): the stop goes on without them."""
    for task in tasks:
        task.cancel()
    if not tasks:
        return set()
    done, pending = await asyncio.wait(tasks, timeout=timeout)
    for task in done:
        if not task.cancelled() and (exc := task.exception()) is not None:
            logger.opt(exception=exc).error("Background task {} failed", _name(task))
    if pending:
        logger.warning(
            "{} background task(s) still running {:g} s after they were cancelled, left behind: {}",
            len(pending),
            timeout,
            ", ".join(sorted(_name(task) for task in pending)),
        )
    return pending


class CannotStart(Exception):
    """A start that cannot go on: exit code 2. Its message is the log line that says why
    (none where the step has said it already)."""


class Server:
    """One run of the worker: ``await Server(config).serve()``, the exit code.

    ``start_engine`` starts the engine once the tokenizer is loaded: vLLM unless a test
    passes another (the steps after the engine, and a dead engine's stop, are tested without
    the minutes a vLLM start takes). ``tasks_timeout``: how long the stop waits for the
    background tasks it cancelled."""

    def __init__(
        self,
        config: WorkerConfig,
        *,
        start_engine: EngineStarter = start_vllm,
        tasks_timeout: float = TASKS_TIMEOUT,
    ) -> None:
        self.config = config
        self.worker_id = config.effective_worker_id
        self.topics = Topics(config.mqtt.topic_prefix)
        self.notifier = Notifier.from_environment()
        self.exit_code = 0
        self.started = False  # the main loop was reached
        self._engine_starter = start_engine
        self._tasks_timeout = tasks_timeout
        self._started_at = time.monotonic()
        self._stop = asyncio.Event()
        self._engine_died = asyncio.Event()
        self._resources = contextlib.AsyncExitStack()
        self._starting: asyncio.Future[bool] | None = None  # the startup task
        self._start_interrupted = False  # a stop signal came during the engine start
        self._signal: signal.Signals | None = None  # the stop signal, if a signal stopped it
        self._tasks: list[asyncio.Future[Any]] = []
        # Set by startup, in order.
        self.metrics: MetricsEndpoint | None = None
        self.engine: ServedEngine | None = None
        self.transport: MqttTransport | None = None
        self.intake: Intake | None = None
        self.service: Service | None = None

    # -- run ----------------------------------------------------------------------------

    async def serve(self, shutdown_trigger: Callable[[], Awaitable[None]] | None = None) -> int:
        """Run until a signal, ``shutdown_trigger`` returning, or the engine's death; the
        exit code (0, 1 for a dead engine, 2 for a start that could not go on)."""
        self._started_at = time.monotonic()
        with self.capture_signals():
            if shutdown_trigger is not None:
                trigger = asyncio.ensure_future(shutdown_trigger())
                trigger.add_done_callback(self._triggered)
                self._tasks.append(trigger)
            try:
                if await self._start():
                    self.started = True
                    await self.main_loop()
                    await self.shutdown()
            finally:
                # Awaited, so nothing they do overlaps the closing below.
                await cancel_and_wait(self._tasks, self._tasks_timeout)
                # What startup opened, in reverse order: transport, intake, engine, store, metrics.
                await self._resources.aclose()
                if self.started:
                    logger.info("Stopped (exit code {})", self.exit_code)
        return self.exit_code

    async def _start(self) -> bool:
        """``startup`` as a task of its own, which a stop signal cancels: a Ctrl-C while the
        tokenizer loads or the engine warms up (minutes on a GPU) stops the start, not after it."""
        self._starting = asyncio.ensure_future(self.startup())
        try:
            return await self._starting
        except asyncio.CancelledError:
            if not (self._stop.is_set() or self._start_interrupted):
                raise  # serve itself was cancelled
            logger.info("Stopped during the start (exit code {})", self.exit_code)
            return False

    def request_stop(self, code: int = 0) -> None:
        """Stop with at least exit code ``code``. A second request to stop without an error
        (a second SIGTERM or Ctrl-C) exits at once: the requests not answered yet stay
        unacknowledged, and the broker redelivers them to the next start."""
        self.exit_code = max(self.exit_code, code)
        if self._stop.is_set() and code == 0:
            pending = self.service.pending if self.service is not None else 0
            logger.warning(
                "Second stop signal: exiting now ({} unanswered request(s) left for the next start)", pending
            )
            remove_files()
            os._exit(1)
        self._stop.set()
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()

    def _on_signal(self, sig: int) -> None:
        self._signal = signal.Signals(sig)
        self.request_stop()

    def _start_holds_the_loop(self) -> bool:
        """Whether the engine start holds the event loop: vLLM started in this process does
        (system/children.py); vLLM started in the engine's own process (engine/remote.py) only
        waits for it, and the loop's signal handlers stop the start as any await."""
        return self._engine_starter is not start_vllm or not frontend_apart(self.config)

    @contextlib.contextmanager
    def _signals_cancel_the_start(self, *, holding: bool = True) -> Iterator[None]:
        """For an engine start that holds the event loop (and must: system/children.py), so
        that the loop's own signal handlers run only once it is over, minutes for a large
        model: a stop signal meanwhile raises CancelledError where the start is, which unwinds
        it as a cancelled start. The loop still sees the signal once it runs again (signals
        also reach its wakeup fd) and requests the stop then. Not for a start that only waits
        (``holding`` False): raised while the loop waits in its selector, the CancelledError
        would end the loop itself instead of the start (seen: a traceback, exit 1, and the
        engine's process left to start on its own)."""
        if not holding or threading.current_thread() is not threading.main_thread():
            yield
            return

        def interrupt(signum: int, frame: object) -> None:
            self._start_interrupted = True
            raise asyncio.CancelledError(f"{signal.Signals(signum).name} during the engine start")

        previous = {sig: signal.signal(sig, interrupt) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _triggered(self, trigger: asyncio.Future[None]) -> None:
        if not trigger.cancelled():  # cancelled at the end of the run: no request to stop
            self.request_stop()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGTERM and SIGINT request the stop while the server runs; the handlers that were
        there before are put back afterwards (signals reach only the main thread: elsewhere,
        e.g. a test's thread, the server runs without)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        loop = asyncio.get_running_loop()
        previous = {sig: signal.getsignal(sig) for sig in HANDLED_SIGNALS}
        for sig in HANDLED_SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig, handler in previous.items():
                loop.remove_signal_handler(sig)
                if handler is not None:  # None: not set from Python; the loop left SIG_DFL
                    signal.signal(sig, handler)

    # -- start --------------------------------------------------------------------------

    async def startup(self) -> bool:
        """Open everything, step by step in the order of the module's docstring, each resource
        onto the exit stack as it is opened. False when the start cannot go on (``exit_code``
        2), or was stopped while it waited for the broker."""
        self._log_start()
        self.config = with_sampling_defaults(self.config)  # once, for the engine, the warm-up and requests
        try:
            if not await self._check_broker():
                logger.info("Stopped while waiting for the broker (exit code {})", self.exit_code)
                return False
            self._import_engine_libraries()
            self._open_metrics()
            store = self._open_store()
            route_library_logging()
            # The engine start holds this thread (and the event loop) until the model is
            # loaded; it must stay on this thread: vLLM's processes die when the thread that
            # started them ends.
            with self.notifier.extending_timeout():
                renderer = await self._load_tokenizer()
                tools = self._tool_support(renderer)
                if tools.parser is None and (
                    self.config.tools.mqtt or self.config.tools.mcp or self.config.tools.mcp_mqtt.server_filter
                ):
                    logger.warning(
                        "Worker tools are configured ([tools]), but the model cannot call tools ({}): "
                        "requests with workerTools will be refused",
                        tools.unsupported or "no tool parser",
                    )
                engine = await self._start_engine(renderer)
                await self._warm_up(engine)
            route_library_logging()
            service = await self._connect(engine, renderer, tools, store)
        except CannotStart as exc:
            if str(exc):
                logger.error("{}", exc)
            self.exit_code = 2
            return False
        self._resources.callback(gc.unfreeze)  # a stopped server's objects may be collected again
        freeze_startup_heap()
        self._spawn_background_tasks(service)
        return True

    def _log_start(self) -> None:
        config = self.config
        logger.info(
            "Worker {} {} starting: model {}, broker {}:{}, store {}",
            self.worker_id,
            __version__,
            config.engine.model,
            config.mqtt.host,
            config.mqtt.port,
            config.history.store,
        )
        # The whole configuration is some 80 lines: at DEBUG (--check-config prints it too).
        logger.debug("Configuration:\n{}", render_toml(config.masked(), comments=False).rstrip())

    async def _check_broker(self) -> bool:
        """One login, before the model load, which takes minutes: a broker that is down or
        refuses the login is found at once. False when stopped while waiting for it (with
        --wait-for-broker, or under systemd); CannotStart when it does not accept the login
        (``broker_accepts`` has said why)."""
        from .transport.mqtt import MqttSettings, check_broker  # paho only: imports in milliseconds

        config = self.config
        settings = MqttSettings.from_config(config, self.topics, self.worker_id)
        wait = config.mqtt.wait_for_broker or self.notifier.enabled
        if await broker_accepts(settings, check_broker, self.notifier, self._stop, wait=wait):
            return True
        if self._stop.is_set():
            return False
        raise CannotStart()

    def _import_engine_libraries(self) -> None:
        """vLLM, torch and transformers; then the engine.extra keys are checked against this
        vLLM's engine arguments, before the model load (vLLM refused one 12 s into its start)."""
        with start_phase(self.notifier, "Importing vLLM, torch and transformers", "Imported"):
            from .engine.tokenizer import ChatTokenizer  # noqa: F401 - imports transformers
            from .engine.vllm import unknown_engine_arguments  # imports vLLM (and torch): after CUDA_VISIBLE_DEVICES
        if unknown := unknown_engine_arguments(self.config.engine.extra):
            raise CannotStart(f"Cannot start the engine: {'; '.join(unknown)}")
        self._check_parallelism()

    def _check_parallelism(self) -> None:
        """Several visible GPUs and a model that fits one: refused before the model load, with
        the commands that use every GPU (engine/limits.py parallelism_plan); tensor parallel
        for such a model: a warning with its measured cost."""
        from .engine.vllm import host_facts, plan_parallelism

        plan = plan_parallelism(self.config.engine, host_facts(), self.config.mqtt.share_group)
        if plan.refuse:
            raise CannotStart(f"Cannot start: {plan.refuse}")
        if plan.warning:
            logger.warning("GPUs: {}", plan.warning)

    def _open_metrics(self) -> None:
        """The Prometheus endpoint, where ``stats.metrics_port`` is set: before the model load,
        so that a port in use fails fast."""
        from .system.metrics import MetricsEndpoint

        stats = self.config.stats
        try:
            self.metrics = MetricsEndpoint.start(stats)  # None unless metrics_port is set
        except OSError as exc:
            raise CannotStart(f"Cannot serve metrics on {stats.metrics_host}:{stats.metrics_port}: {exc}") from exc
        if self.metrics is not None:
            self._resources.callback(self.metrics.close)

    def _open_store(self) -> HistoryStore:
        """The session store: before the model load, so that a bad state_dir or an unreachable
        Redis fails fast. Closed after the drain: every stored turn is committed."""
        from .store import open_store
        from .store.port import StoreError

        config = self.config
        try:
            store = open_store(config.history, config.redis, config.mqtt.topic_prefix)
        except StoreError as exc:  # locked for longer than the start waits, read-only, a newer schema
            raise CannotStart(f"Cannot use the session store: {exc}") from exc
        except Exception as exc:
            if config.history.store != "redis":
                raise
            raise CannotStart(f"Cannot use the Redis store: {exc}") from exc
        self._resources.callback(store.close)
        return store

    async def _load_tokenizer(self) -> ChatTokenizer:
        from .engine.tokenizer import ChatTokenizer

        model = self.config.engine.model
        assert model is not None
        with start_phase(self.notifier, "Loading the tokenizer", "Tokenizer loaded", detail=model):
            return await asyncio.to_thread(ChatTokenizer, model)

    def _tool_support(self, renderer: ChatTokenizer) -> ToolSupport:
        """How the model calls tools (engine.tool_parser, or the parser its chat template's call
        format matches): a parser vLLM does not have fails before the engine start."""
        from .engine.vllm import tool_support

        engine = self.config.engine
        assert engine.model is not None
        try:
            return tool_support(engine.tool_parser, renderer, engine.model)
        except ValueError as exc:
            raise CannotStart(f"Cannot use tool_parser {engine.tool_parser!r}: {exc}") from exc

    async def _start_engine(self, renderer: ChatTokenizer) -> ServedEngine:
        model = self.config.engine.model
        starting = start_phase(self.notifier, "Starting the engine", "Engine ready", detail=f"vLLM is loading {model}")
        with starting, self._signals_cancel_the_start(holding=self._start_holds_the_loop()):
            engine = self.engine = await self._engine_starter(self.config, renderer.stop_token_ids)
        self._resources.push_async_callback(engine.shutdown)
        short = pending_limit_short(self.config.limits.max_pending_requests, engine.info.max_requests)
        if short is not None:
            logger.warning(short)
        return engine

    async def _warm_up(self, engine: ServedEngine) -> None:
        """Before online: the first real burst must not wait for kernels compiled on first use."""
        config = self.config
        plan = WarmupPlan(
            mode=config.engine.warmup,
            temperature=config.generation.temperature,
            top_p=config.generation.top_p,
            max_batch=config.engine.warmup_max_batch,
            timeout_s=config.engine.warmup_timeout,
        )
        with start_phase(self.notifier, "Warming the engine up", "Warm-up phase over", announce=False):
            await engine.warm_up(plan)

    async def _connect(
        self, engine: ServedEngine, renderer: ChatTokenizer, tools: ToolSupport, store: HistoryStore
    ) -> Service:
        """The service, wired to the broker (worker/wiring.py), and MQTT for good: in a group on
        Redis the intake joins first. The retained ``online`` status comes with the connection."""
        from .wiring import wire

        config = self.config
        self.notifier.status(f"Model loaded; connecting to {config.mqtt.host}:{config.mqtt.port}")
        parts = wire(config, engine, renderer, store, self.request_stop, tools=tools)
        self.transport, self.service = parts.transport, parts.service
        self._attach_metrics(parts.service, engine)
        try:
            await parts.join_group(self._resources)  # before the broker connection: requests are routed from the first
        except Exception as exc:
            raise CannotStart(f"Cannot join the group in Redis: {exc}") from exc
        self.intake = parts.intake
        parts.connect(self._resources)
        await parts.start_tools(self._resources)
        return parts.service

    def _attach_metrics(self, service: Service, engine: ServedEngine) -> None:
        if self.metrics is None:
            return
        from .system.metrics import LiveSources

        info = engine.info
        self.metrics.attach(
            service.stats,
            LiveSources(
                engine.peek_stats,
                sessions=lambda: len(service.sessions),
                pending=lambda: service.pending,
                info={"version": __version__, "engine": f"{info.name} {info.version}", "model": info.model},
            ),
        )

    def _spawn_background_tasks(self, service: Service) -> None:
        self._spawn(service.consume(), "consume")
        self._spawn(service.publish_stats_forever(), "publish stats")
        self._spawn(service.expire_sessions_forever(), "expire sessions")
        self._spawn(self.announce_ready(), "announce ready")
        self._spawn(self.notifier.watchdog_forever(self.health), "watchdog")
        self._spawn(self.watch_engine(), "watch engine")

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        self._tasks.append(asyncio.create_task(coro, name=name))

    async def announce_ready(self) -> None:
        assert self.transport is not None
        config = self.config
        await self.transport.wait_subscribed()  # a request published from now on is delivered
        subscriptions = ", ".join(self.topics.subscriptions(config.mqtt.share_group))
        logger.info("Listening on {} via {}:{}", subscriptions, config.mqtt.host, config.mqtt.port)
        serving = f"Serving {config.engine.model} as {self.worker_id} via {config.mqtt.host}:{config.mqtt.port}"
        logger.info("{} (ready {:.1f} s after start)", serving, time.monotonic() - self._started_at)
        self.notifier.ready(serving)

    def health(self) -> str | None:
        """What is wrong, for systemd's watchdog; None while healthy."""
        assert self.transport is not None and self.engine is not None
        if not self.transport.loop_alive:
            return "the MQTT network loop has stopped"
        if not self.engine.is_alive():
            return "the engine is dead"
        return None

    async def watch_engine(self) -> None:
        """A dead engine stops the worker whether or not it was generating: it publishes
        offline, leaves what it holds unacknowledged (redelivered to the restart) and exits
        non-zero, for systemd (Restart=on-failure) to start it again."""
        assert self.engine is not None
        while self.engine.is_alive():
            await asyncio.sleep(ENGINE_CHECK_INTERVAL)
        logger.error("The engine died; stopping the worker (whatever is in flight is left for the restart)")
        self._engine_died.set()
        self.request_stop(1)

    # -- serve and stop ------------------------------------------------------------------

    async def main_loop(self) -> None:
        """Serve: the work runs in the tasks startup spawned; this waits for the stop."""
        await self._stop.wait()

    async def shutdown(self) -> None:
        """The graceful part of the stop; the closing follows in ``serve``."""
        assert self.transport is not None and self.service is not None and self.engine is not None
        config = self.config
        if self._signal is None:
            logger.info("Stopping")
        else:  # the signal may be a Ctrl-C that did not mean to stop everything: how to go on
            again = "Ctrl-C again" if self._signal == signal.SIGINT else f"a second {self._signal.name}"
            logger.info(
                "Stopping on {}; {} stops at once, leaving the requests not answered yet for the next start",
                "Ctrl-C (SIGINT)" if self._signal == signal.SIGINT else self._signal.name,
                again,
            )
        self.notifier.stopping("Stopping: finishing running generations")
        if config.mqtt.share_group is not None:
            # The broker gives this member's share to the others from now on (a single worker
            # stays subscribed: its persistent session queues for its restart).
            self.transport.unsubscribe()
        # A dead engine finishes nothing: no grace period, the rest stays unacknowledged.
        engine_dead = self._engine_died.is_set() or not self.engine.is_alive()
        await self.service.drain(0 if engine_dead else config.limits.drain_timeout)
        if config.stats.interval > 0:
            self.service.publish_stats()
