"""The worker's lifecycle (worker/server.py), in this process against real mosquitto brokers:
a start that fails at a step closes what the steps before it opened (the metrics port is free
again, the SQLite store's file is closed, the engine shut down) and ends with its exit code;
a normal stop and a dead engine's stop close everything too; the stop waits for the tasks it
cancelled, up to a limit; the signal handlers that were there before are put back.

No vLLM engine is started: the failures are caused for real before it (a broker that refuses
the login, a Redis that nothing listens on) or in vLLM's own configuration check (a model
length the model does not have), and the runs past the engine use the Server's
``start_engine`` with the fake engine of test_service (a vLLM start adds minutes)."""

from __future__ import annotations

import asyncio
import gc
import itertools
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from loguru import logger

from devtools.fakes import FakeEngine
from devtools.mosquitto import Mosquitto, password_file
from devtools.mqtt_client import Client
from devtools.net import free_port
from devtools.redis_server import RedisServer
from devtools.waiting import PATIENCE
from worker.config.models import WorkerConfig
from worker.engine.port import EngineStats, WarmupPlan
from worker.protocol.topics import Topics
from worker.server import Server, cancel_and_wait

_ids = itertools.count()


class ServedFakeEngine(FakeEngine):
    """test_service's fake, with what the server needs beyond the service's port."""

    def __init__(self) -> None:
        super().__init__()
        self.alive = True
        self.shut_down = False
        self.warm_up_error: Exception | None = None

    def is_alive(self) -> bool:
        return self.alive

    async def warm_up(self, plan: WarmupPlan) -> None:
        if self.warm_up_error is not None:
            raise self.warm_up_error

    def peek_stats(self) -> EngineStats:
        return EngineStats()

    async def shutdown(self) -> None:
        self.shut_down = True


def starter(engine: ServedFakeEngine) -> Any:
    async def start(config: WorkerConfig, stop_token_ids: list[int]) -> ServedFakeEngine:
        return engine

    return start


@pytest.fixture
def log() -> Iterator[list[str]]:
    lines: list[str] = []
    sink = logger.add(lambda message: lines.append(message.record["message"]), level="DEBUG")
    yield lines
    logger.remove(sink)


@pytest.fixture
def previous_handler() -> Iterator[Any]:
    """A SIGTERM handler of the test's own, there before the server runs (and put back after
    the test)."""

    def handler(signum: int, frame: Any) -> None:
        raise AssertionError("the test's own SIGTERM handler was called")

    before = signal.signal(signal.SIGTERM, handler)
    yield handler
    signal.signal(signal.SIGTERM, before)


@pytest.fixture(scope="module")
def locked_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    workdir = tmp_path_factory.mktemp("lifecycle-locked-broker")
    passwords = password_file(workdir / "passwd", {"worker": "right-pass"})
    # keep_root: mosquitto, run as root, would otherwise drop to a user that cannot read the file.
    broker = Mosquitto(
        workdir, f"password_file {passwords}\nallow_anonymous false\n", keep_root=True, autosave="default"
    )
    broker.start()
    yield broker
    broker.stop()


def config_for(broker_port: int, model: Path, tmp_path: Path, **sections: dict[str, Any]) -> WorkerConfig:
    """A worker on its own topic prefix, with the SQLite store under tmp_path and metrics on a
    free port (sections: overrides)."""
    n = next(_ids)
    base: dict[str, dict[str, Any]] = {
        "engine": {"model": str(model)},
        "mqtt": {"port": broker_port, "topic_prefix": f"life{n}", "worker_id": f"life-{n}", "session_expiry": 0},
        "history": {"store": "sqlite", "state_dir": str(tmp_path / "state")},
        "stats": {"interval": 0, "metrics_port": free_port()},
        "limits": {"drain_timeout": 5},
    }
    for name, values in sections.items():
        base[name] = base.get(name, {}) | values
    return WorkerConfig.model_validate(base)


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def open_files_under(directory: Path) -> list[str]:
    """The files under directory that this process holds open."""
    found = []
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed while listed
            continue
        if target.startswith(str(directory)):
            found.append(target)
    return found


def opened_metrics_and_store(log: list[str], config: WorkerConfig) -> bool:
    """Whether the start got as far as opening the metrics endpoint and the SQLite store."""
    port = config.stats.metrics_port
    return any(f":{port}/metrics" in line for line in log) and any("Sessions are stored in" in line for line in log)


def assert_closed(config: WorkerConfig) -> None:
    assert config.stats.metrics_port is not None
    assert port_is_free(config.stats.metrics_port), "the metrics endpoint still holds its port"
    assert open_files_under(config.history.state_dir) == [], "the SQLite store is still open"


# -- starts that fail ----------------------------------------------------------------------


def test_a_refused_login_ends_the_start_with_2_before_anything_is_opened(
    locked_broker: Mosquitto, tmp_path: Path, log: list[str], previous_handler: Any
) -> None:
    config = config_for(locked_broker.port, tmp_path / "model", tmp_path, mqtt={"username": "worker"})
    assert asyncio.run(Server(config).serve()) == 2
    assert any(line.startswith("Cannot use the MQTT broker") for line in log), log
    assert not any("Importing vLLM" in line for line in log)
    assert_closed(config)
    assert signal.getsignal(signal.SIGTERM) is previous_handler


def test_an_unreachable_redis_ends_the_start_with_2_and_closes_the_metrics_endpoint(
    broker: Mosquitto, tmp_path: Path, log: list[str], previous_handler: Any
) -> None:
    nothing_listens = f"redis://127.0.0.1:{free_port()}/0"
    config = config_for(broker.port, tmp_path / "model", tmp_path, history={"store": "redis"})
    config = config.model_copy(update={"redis": config.redis.model_copy(update={"url": nothing_listens})})
    assert asyncio.run(Server(config).serve()) == 2
    assert config.stats.metrics_port is not None
    assert any(f":{config.stats.metrics_port}/metrics" in line for line in log), "metrics were not opened"
    assert any(line.startswith("Cannot use the Redis store") for line in log), log
    assert not any("Loading the tokenizer" in line for line in log)
    assert_closed(config)
    assert signal.getsignal(signal.SIGTERM) is previous_handler


def test_an_engine_extra_key_vllm_does_not_know_ends_the_start_with_2_before_the_load(
    broker: Mosquitto, tmp_path: Path, log: list[str], previous_handler: Any
) -> None:
    """Found once vLLM is imported, named with the closest engine argument, before the metrics
    endpoint, the store and the model (it failed 12 s into vLLM's engine start)."""
    config = config_for(broker.port, tmp_path / "model", tmp_path, engine={"extra": {"max_num_seq": 4}})
    assert asyncio.run(Server(config).serve()) == 2
    (line,) = [line for line in log if line.startswith("Cannot start the engine")]
    assert "'max_num_seq' is not an engine argument of vLLM" in line and "did you mean 'max_num_seqs'?" in line
    assert not any("Loading the tokenizer" in line for line in log)
    assert_closed(config)
    assert signal.getsignal(signal.SIGTERM) is previous_handler


def test_a_model_vllm_refuses_closes_the_store_and_the_metrics_endpoint(
    broker: Mosquitto, tiny_model: Path, tmp_path: Path, log: list[str], previous_handler: Any
) -> None:
    """vLLM refuses a model length beyond the model's (4,096) in its configuration check,
    before any engine process starts; the error is raised, as it was before (a traceback and
    exit code 1 from ``python -m worker``)."""
    config = config_for(broker.port, tiny_model, tmp_path, engine={"max_model_len": 1 << 20})
    with pytest.raises(Exception, match="max_model_len"):
        asyncio.run(Server(config).serve())
    assert opened_metrics_and_store(log, config), log
    assert any("Tokenizer loaded" in line for line in log)
    assert_closed(config)
    assert signal.getsignal(signal.SIGTERM) is previous_handler


def test_a_failed_warm_up_shuts_the_engine_down_and_closes_what_came_before(
    broker: Mosquitto, tiny_model: Path, tmp_path: Path, log: list[str]
) -> None:
    engine = ServedFakeEngine()
    engine.warm_up_error = RuntimeError("warm-up failed")
    config = config_for(broker.port, tiny_model, tmp_path)
    with pytest.raises(RuntimeError, match="warm-up failed"):
        asyncio.run(Server(config, start_engine=starter(engine)).serve())
    assert opened_metrics_and_store(log, config), log
    assert engine.shut_down
    assert_closed(config)


def test_a_group_that_cannot_be_joined_in_redis_ends_the_start_with_2_and_closes_the_rest(
    broker: Mosquitto, tiny_model: Path, tmp_path: Path, log: list[str]
) -> None:
    """A Redis user that may PING (the store's check at start) but not write: the intake's
    join fails after the engine started. Nothing reaches the broker: no online status."""
    import redis

    server = RedisServer(tmp_path / "redis")
    server.workdir.mkdir()
    server.start()
    try:
        redis.Redis(port=server.port).acl_setuser("pinger", enabled=True, passwords=["+pw"], commands=["+ping"])
        engine = ServedFakeEngine()
        config = config_for(broker.port, tiny_model, tmp_path, history={"store": "redis"})
        url = f"redis://pinger:pw@127.0.0.1:{server.port}/0"
        config = config.model_copy(update={"redis": config.redis.model_copy(update={"url": url})})
        watcher = Client(broker.port, [f"{config.mqtt.topic_prefix}/#"])
        try:
            assert asyncio.run(Server(config, start_engine=starter(engine)).serve()) == 2
            assert any(line.startswith("Cannot join the group in Redis") for line in log), log
            assert engine.shut_down
            assert_closed(config)
            # A marker after it: an online status, had one been published, came before.
            watcher.publish(f"{config.mqtt.topic_prefix}/marker", b"m")
            watcher.wait_topic(f"{config.mqtt.topic_prefix}/marker", timeout=PATIENCE)
            assert not watcher.received(lambda m: True), [m.topic for m in watcher.seen]
        finally:
            watcher.close()
    finally:
        server.stop()


# -- runs that stop ------------------------------------------------------------------------


def status_of(config: WorkerConfig) -> str:
    return Topics(config.mqtt.topic_prefix).status(config.effective_worker_id)


def test_a_stopped_run_closes_everything_and_exits_0(
    broker: Mosquitto, tiny_model: Path, tmp_path: Path, log: list[str], previous_handler: Any
) -> None:
    engine = ServedFakeEngine()
    config = config_for(broker.port, tiny_model, tmp_path)
    watcher = Client(broker.port, [status_of(config)])
    try:
        frozen_while_serving: list[int] = []

        async def until_online() -> None:
            await asyncio.to_thread(watcher.wait_for, lambda m: m.payload == b"online", PATIENCE)
            frozen_while_serving.append(gc.get_freeze_count())

        assert asyncio.run(Server(config, start_engine=starter(engine)).serve(until_online)) == 0
        watcher.wait_for(lambda m: m.payload == b"offline", PATIENCE)
    finally:
        watcher.close()
    assert "Stopped (exit code 0)" in log
    # The heap as it was once started is out of the collector's reach while it serves (full
    # collections walk only what came after), and is handed back at the stop.
    assert frozen_while_serving[0] > 10_000 and gc.get_freeze_count() == 0
    assert engine.shut_down
    assert_closed(config)
    assert signal.getsignal(signal.SIGTERM) is previous_handler


def test_a_dead_engine_stops_the_run_with_1(
    broker: Mosquitto, tiny_model: Path, tmp_path: Path, log: list[str]
) -> None:
    """The trigger never returns: the engine's death alone stops the run, and the trigger is
    cancelled with the other tasks (it is no second request to stop, which would exit)."""
    engine = ServedFakeEngine()
    config = config_for(broker.port, tiny_model, tmp_path)
    watcher = Client(broker.port, [status_of(config)])
    try:

        async def kill_engine_once_online() -> None:
            await asyncio.to_thread(watcher.wait_for, lambda m: m.payload == b"online", PATIENCE)
            engine.alive = False
            await asyncio.Event().wait()

        assert asyncio.run(Server(config, start_engine=starter(engine)).serve(kill_engine_once_online)) == 1
        watcher.wait_for(lambda m: m.payload == b"offline", PATIENCE)
    finally:
        watcher.close()
    assert any(line.startswith("The engine died") for line in log), log
    assert "Stopped (exit code 1)" in log
    assert engine.shut_down
    assert_closed(config)


# -- cancelled tasks -----------------------------------------------------------------------


def test_a_cancelled_task_that_takes_a_moment_to_end_is_waited_for(log: list[str]) -> None:
    finished: list[str] = []

    async def cleans_up_when_cancelled() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.sleep(0.2)  # its clean-up, ignoring the cancellation a moment
            finished.append("cleaned up")
            raise

    async def run() -> set[asyncio.Future[Any]]:
        task = asyncio.create_task(cleans_up_when_cancelled(), name="slow to end")
        await asyncio.sleep(0)
        return await cancel_and_wait([task], timeout=30)

    assert asyncio.run(run()) == set()
    assert finished == ["cleaned up"]
    assert not any("left behind" in line for line in log)


def test_a_cancelled_task_that_hangs_is_logged_and_left() -> None:
    warnings: list[str] = []
    sink = logger.add(lambda message: warnings.append(message.record["message"]), level="WARNING")

    async def run() -> tuple[list[str], bool]:
        release = asyncio.Event()

        async def hangs_when_cancelled() -> None:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                await release.wait()  # until the test lets it go
                raise

        task = asyncio.create_task(hangs_when_cancelled(), name="hangs")
        await asyncio.sleep(0)
        left = await cancel_and_wait([task], timeout=0.2)
        was_running = not task.done()
        release.set()
        await asyncio.wait([task])
        return [t.get_name() for t in left if isinstance(t, asyncio.Task)], was_running

    try:
        assert asyncio.run(run()) == (["hangs"], True)
    finally:
        logger.remove(sink)
    (warning,) = [line for line in warnings if "left behind" in line]
    assert "hangs" in warning
