"""A worker's restarts and faults against a real mosquitto and the vLLM CPU engine: requests
sent while it is down are answered after it starts; a graceful stop drains for its grace
period, aborts the rest and leaves it and what arrives while stopping unacknowledged, publishes
its final stats and its own `offline` (a clean DISCONNECT: no Will), and the next start
answers each of those requests once; its retained status follows it (clean stop, freeze,
kill). The first start also speaks systemd's notify protocol to a socket the test owns; the
kill leaves none of the engine's processes behind, and the request it interrupted is answered
once by the next start, which also finds the sessions' history in its store; an engine core
that dies, idle or with a request in flight, makes the worker publish offline and exit
non-zero, and the request is answered once after the restart; a second stop signal ends a
draining worker at once, and the request that exit interrupted is poison to a start that
allows one delivery: a final engine_error, not generated again.
One worker id and state directory. Each test runs on its own: one that needs a running
worker takes the one the test before left running, or starts one (each engine start costs
~40 s, so six starts in all when they run in order)."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import Client
from devtools.net import free_port
from devtools.systemd import NotifyListener
from devtools.waiting import PATIENCE, eventually
from devtools.worker_process import WorkerProcess, engine_args, pending_requests
from worker.store.sqlite import DATABASE_NAME

pytestmark = pytest.mark.e2e
KEEPALIVE = 5
STATUS = "chat/_worker/steady/status"
STATS = "chat/_worker/steady/stats"
# When mosquitto 2.0.11 (Debian 12's) publishes the Will of a client that went silent, in
# seconds after the last packet it got from it (docs/reliability.md, "Presence"): it times a
# client out once now - last > keepalive * 3 / 2 in whole seconds, but checks only every 6 s
# (keepalive.c: when last_check + 5 < now). Measured (scripts/will_timing.py), keepalive
# 2/5/10: 4.3-9.1, 7.1-12.9, 15.2-21.0 s.
WILL_AFTER_SILENCE = (KEEPALIVE * 3 // 2, KEEPALIVE * 3 // 2 + 6)


def start_worker(
    model: Path, broker: Mosquitto, log: Path, env: dict[str, str] | None = None, extra: tuple[str, ...] = ()
) -> WorkerProcess:
    worker = WorkerProcess(
        [
            *engine_args(model),
            "--state-dir",
            str(log.parent / "state"),  # every start of the module: one directory
            "--mqtt-port",
            str(broker.port),
            "--worker-id",
            "steady",
            "--mqtt-keepalive",
            str(KEEPALIVE),
            "--mqtt-reconnect-max-delay",
            "2",
            *extra,
        ],
        log,
        env,
    )
    return worker


def wait_status(watcher: Client, payload: bytes, timeout: float = PATIENCE) -> None:
    """Until the retained status topic carries ``payload``."""
    watcher.wait_for(lambda m: m.topic == STATUS and m.payload == payload, timeout=timeout)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    """This module's own broker, with its log written (keep_root): the tests read how the
    worker's connections ended."""
    mosquitto = Mosquitto(tmp_path_factory.mktemp("mosquitto"), keep_root=True)
    mosquitto.start()
    yield mosquitto
    mosquitto.stop()


@pytest.fixture(scope="module")
def watcher(broker: Mosquitto) -> Iterator[Client]:
    client = Client(broker.port, [STATUS, STATS, "chat/+/+/reply"])
    yield client
    client.close()


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("steady")


@pytest.fixture
def serving_worker(
    tiny_model: Path, broker: Mosquitto, workers: list[WorkerProcess], logs: Path
) -> Callable[[], WorkerProcess]:
    """A running worker, ready to serve: the one the previous test left running, else a new
    one (so that every test can run alone)."""

    def get() -> WorkerProcess:
        if workers and workers[-1].alive():
            return workers[-1]
        worker = start_worker(tiny_model, broker, logs / f"start-{len(workers)}.log")
        workers.append(worker)
        worker.wait_log("Serving ")
        return worker

    return get


def test_requests_sent_while_the_worker_is_down_are_answered(
    tiny_model: Path,
    broker: Mosquitto,
    watcher: Client,
    workers: list[WorkerProcess],
    logs: Path,
) -> None:
    notify = NotifyListener(str(logs / "notify.sock"))
    sender = Client(broker.port, [])
    # Published the moment READY arrives: answered only if the broker already holds the
    # subscription (this client id's first session has none before; the broker would drop it).
    request = {"message": "hi", "maxTokens": 4, "requestId": "ready-0"}
    notify.on_arrival["READY=1"] = lambda: sender.publish("chat/nina/ready/request", request)
    # WATCHDOG_USEC as systemd sets it for WatchdogSec=2: a ping every second.
    env = {"NOTIFY_SOCKET": notify.address, "WATCHDOG_USEC": "2000000"}
    # A stats interval that never comes: the only stats message is the final one. A grace
    # period of 1 s: the long generation cannot finish in it.
    first = start_worker(
        tiny_model, broker, logs / "first.log", env, extra=("--stats-interval", "3600", "--drain-timeout", "1")
    )
    workers.append(first)
    late = {"message": "too late", "maxTokens": 4, "requestId": LATE[2]}
    notify.on_arrival["STOPPING=1"] = lambda: sender.publish(topic_of(LATE, "request"), late)
    try:
        ready = notify.wait_for("READY=1")
        check_notify_sequence(notify, ready, watcher)
        wait_status(watcher, b"online")
        start_long_generation(broker, ABORTED)
        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(PATIENCE) == 0, first.log()[-3000:]
    finally:
        first.stop()
        notify.close()
    stopping = notify.times("STOPPING=1")
    assert stopping and stopping[0] > ready, notify.lines()
    assert notify.at_arrival["STOPPING=1"] is None  # published while the worker drained
    check_graceful_stop(first, broker, watcher)
    check_store_flushed(logs / "state" / DATABASE_NAME)
    # At the default [logging] vllm_level (WARNING) the start is the worker's own lines: none
    # of vLLM's INFO lines (its configuration, each step of the load), no progress bars.
    log = first.log()
    assert not re.search(r"^\S+ \S+ \| INFO +\| vllm\.", log, re.M), log[:6000]
    assert "checkpoint shards" not in log, log[:6000]
    for session in ("down-a", "down-b"):
        for turn in range(2):
            sender.publish(
                f"chat/carl/{session}/request",
                {"message": f"turn {turn}", "maxTokens": 8, "requestId": f"{session}-{turn}"},
            )
    sender.close()
    second = start_worker(tiny_model, broker, logs / "second.log")
    workers.append(second)  # left running for the next test
    wait_status(watcher, b"online")
    answered: dict[str, list[str]] = {"down-a": [], "down-b": []}
    for _ in range(4):
        reply = watcher.wait_for(
            lambda m: m.topic.startswith("chat/carl/") and m.topic.endswith("/reply"), timeout=PATIENCE
        ).json()
        assert "error" not in reply, reply
        answered[reply["sessionId"]].append(reply["requestId"])
    assert answered == {"down-a": ["down-a-0", "down-a-1"], "down-b": ["down-b-0", "down-b-1"]}
    assert "session resumed" in second.log()
    # What the stop left unacknowledged: answered once each, by this start.
    for where in (ABORTED, LATE):
        (reply,) = replies_to(broker, watcher, where)
        assert "error" not in reply, reply


def check_store_flushed(database: Path) -> None:
    """The store was closed: its WAL checkpointed into the database (and removed), which holds
    the turn the stopped worker answered."""
    assert not database.with_name(database.name + "-wal").exists()
    with contextlib.closing(sqlite3.connect(database)) as db:
        (state,) = db.execute("SELECT state FROM sessions WHERE name = 'nina/ready'").fetchone()
    assert [turn["key"] for turn in json.loads(state)["turns"]] == ["ready-0"], state


def check_graceful_stop(worker: WorkerProcess, broker: Mosquitto, watcher: Client) -> None:
    """After SIGTERM with a running generation and a request arriving while it drained: the
    generation aborted after the grace period and the request not taken, both unanswered;
    the final stats and the worker's own offline published; a clean disconnect."""
    log = worker.log()
    assert "Stopped 1 unfinished request(s)" in log, log[-3000:]
    # A clean stop is not an error: no traceback (vLLM's output handler was stopped first).
    assert "Traceback" not in log and "| ERROR" not in log, log[-3000:]
    assert "Stopping: a message left unacknowledged for the next start" in log, log[-3000:]
    final = watcher.wait_for(lambda m: m.topic == STATS, timeout=PATIENCE).json()
    assert final["processed"] == 1 and final["workerId"] == "steady", final  # ready-0
    wait_status(watcher, b"offline")
    # A DISCONNECT (the broker then discards the Will): the offline is the worker's own.
    # (The line ends there: the start's check of the broker, steady-check, disconnects too.)
    assert re.search(r"Received DISCONNECT from steady$", broker.log.read_text(), re.M)
    # The worker's own offline is the last thing it published: a reply would have come before.
    unanswered = (topic_of(ABORTED, "reply"), topic_of(LATE, "reply"))
    assert not watcher.received(lambda m: m.topic in unanswered)


def check_notify_sequence(notify: NotifyListener, ready: float, watcher: Client) -> None:
    """systemd's view of the start: the start timeout extended while the model loaded, READY
    once the broker has acknowledged the subscriptions, then watchdog pings (one a second: how
    often is tests/broker/test_notify.py's to check, not a busy machine's)."""
    extended = notify.times("EXTEND_TIMEOUT_USEC=")
    assert extended and extended[0] < ready, notify.lines()
    # The start phases, as `systemctl status` shows them.
    phases = [notify.times(line) for line in ("STATUS=Starting the engine: ", "STATUS=Engine ready in ")]
    assert all(phases) and phases[0][0] < phases[1][0] < ready, notify.lines()
    assert notify.at_arrival["READY=1"] is None  # published
    reply = watcher.wait_for(lambda m: m.topic == "chat/nina/ready/reply", timeout=PATIENCE).json()
    assert reply.get("requestId") == "ready-0" and "error" not in reply, reply
    notify.wait_for("WATCHDOG=1", count=3, after=ready)


def test_status_follows_freeze_and_kill_and_a_killed_workers_request_is_answered_once_after_a_restart(
    tiny_model: Path,
    watcher: Client,
    serving_worker: Callable[[], WorkerProcess],
    workers: list[WorkerProcess],
    broker: Mosquitto,
    logs: Path,
) -> None:
    worker = serving_worker()
    # Two turns of a session the restart must find in the store.
    sender = Client(broker.port, [])
    for turn in range(2):
        sender.publish(
            "chat/carl/kept/request", {"message": f"turn {turn}", "maxTokens": 8, "requestId": f"kept-{turn}"}
        )
        reply = watcher.wait_topic("chat/carl/kept/reply", timeout=PATIENCE).json()
        assert reply.get("requestId") == f"kept-{turn}", reply
        assert "error" not in reply, reply
    # Frozen right after the broker got a packet from it (the error reply to a bad request),
    # its TCP connection stays open: only the keepalive can tell the broker, which then
    # publishes the Will. MQTT says after 1.5 x keepalive without a packet; mosquitto 2.0.11
    # checks every 6 s, so up to 6 s later (WILL_AFTER_SILENCE).
    sender.publish("chat/carl/ping/request", b"not json")
    watcher.wait_for(lambda m: m.topic == "chat/carl/ping/reply", timeout=PATIENCE)
    worker.proc.send_signal(signal.SIGSTOP)
    try:
        wait_status(watcher, b"offline")
    finally:
        worker.proc.send_signal(signal.SIGCONT)
    # The broker's own word for why (not how long it took: on a busy machine the broker's
    # checks and the deliveries come late; WILL_AFTER_SILENCE is what an idle one measured).
    assert "Client steady has exceeded timeout" in broker.log.read_text()
    wait_status(watcher, b"online")  # reconnects by itself
    # A reconnect is not an error: paho's "Client is not connected" is not logged at ERROR.
    assert "| ERROR" not in worker.log(), worker.log()[-3000:]
    engine_processes = psutil.Process(worker.proc.pid).children(recursive=True)
    assert engine_processes, "vLLM's engine runs in child processes"
    # Killed in the middle of a generation.
    start_long_generation(broker, KILLED)
    # The worker's own pid only: its children must follow by themselves (outside systemd
    # nothing else kills them; the workers fixture kills the whole group, but only later).
    worker.proc.send_signal(signal.SIGKILL)
    # The kernel closes its socket: the Will at once, no keepalive to wait for (the broker's
    # log says which it was).
    wait_status(watcher, b"offline")
    assert "Client steady closed its connection" in broker.log.read_text()
    _, left = psutil.wait_procs(engine_processes, timeout=PATIENCE)
    assert not left, f"outlived the worker: {[(p.pid, p.name()) for p in left]}"

    restart = start_worker(tiny_model, broker, logs / "after-kill.log")
    workers.append(restart)
    # The request the SIGKILL interrupted: stored nowhere as answered, left unacknowledged,
    # so the broker delivers it again; generated and answered exactly once.
    (reply,) = replies_to(broker, watcher, KILLED)
    assert "error" not in reply, reply
    # The history the killed worker stored: "kept" had two turns, a new session none.
    for session in ("kept", "fresh"):
        sender.publish(
            f"chat/carl/{session}/request", {"message": "and now?", "maxTokens": 4, "requestId": f"{session}-later"}
        )
    prompts = {}
    for _ in range(2):
        answer = watcher.wait_for(
            lambda m: m.topic.startswith("chat/carl/") and m.json().get("requestId", "").endswith("-later"),
            timeout=PATIENCE,
        ).json()
        prompts[answer["sessionId"]] = answer["usage"]["promptTokens"]
    assert prompts["kept"] > prompts["fresh"] + 10, prompts  # two turns came back from the store
    sender.close()


ABORTED = ("lena", "long", "long-0")  # running when the first start stops
LATE = ("lena", "late", "late-0")  # sent while the first start drains
KILLED = ("kim", "killed", "killed-0")
ENGINE_DEATH = ("kim", "engine", "engine-0")
FORCED = ("kim", "forced", "forced-0")  # running when the fourth start gets two stop signals
AFTER = ("kim", "after", "after-0")


def topic_of(where: tuple[str, str, str], kind: str) -> str:
    user, session, _ = where
    return f"chat/{user}/{session}/{kind}"


def start_long_generation(broker: Mosquitto, where: tuple[str, str, str]) -> None:
    """Publish a long streamed request and return once its first tokens are out."""
    user, session, request_id = where
    client = Client(broker.port, [f"chat/{user}/{session}/stream"])
    try:
        request = {"message": "tell me everything", "maxTokens": 1000, "stream": True, "requestId": request_id}
        client.publish(f"chat/{user}/{session}/request", request)
        client.wait_topic(f"chat/{user}/{session}/stream", timeout=PATIENCE)
    finally:
        client.close()


def replies_to(broker: Mosquitto, watcher: Client, where: tuple[str, str, str]) -> list[dict[str, object]]:
    """Every reply to the request (the first must come) up to the reply to a marker request
    sent after it in the same session: the worker answers a session's requests in order, so a
    second answer to the request (a redelivery generated again) would come before the
    marker's. The marker's reply is not among those returned."""
    user, session, request_id = where
    topic = f"chat/{user}/{session}/reply"
    found = [watcher.wait_for(lambda m: m.topic == topic, timeout=PATIENCE).json()]
    marker = f"{request_id}-marker"
    sender = Client(broker.port, [])
    sender.publish(f"chat/{user}/{session}/request", {"message": "and?", "maxTokens": 2, "requestId": marker})
    sender.close()
    while (reply := watcher.wait_for(lambda m: m.topic == topic, timeout=PATIENCE).json()).get("requestId") != marker:
        found.append(reply)
    assert all(r.get("requestId") == request_id for r in found), found
    return found


def test_a_dead_engine_stops_the_worker_idle_or_busy_and_its_request_is_answered_once_after_a_restart(
    tiny_model: Path,
    broker: Mosquitto,
    watcher: Client,
    serving_worker: Callable[[], WorkerProcess],
    workers: list[WorkerProcess],
    logs: Path,
) -> None:
    # Idle: no generation runs when the engine core dies (killed, as the OOM killer would).
    idle = serving_worker()
    wait_status(watcher, b"online")
    idle.engine_cores()[0].kill()
    assert idle.proc.wait(PATIENCE) == 1, idle.log()[-3000:]  # for systemd to restart it
    wait_status(watcher, b"offline")
    assert "The engine died" in idle.log(), idle.log()[-3000:]

    # Busy, with no race: the engine core is frozen before the request is sent, so its
    # generation cannot finish; the worker has taken the request (its pending gauge says so)
    # when the frozen core is killed. This worker runs vLLM's frontend in a process of its own
    # (the default on a GPU): the death comes to it through that process, which ends too.
    metrics = free_port()
    busy = start_worker(
        tiny_model,
        broker,
        logs / "engine-death.log",
        extra=("--metrics-port", str(metrics), "--frontend-process", "on"),
    )
    workers.append(busy)
    busy.wait_log("Serving ")
    below = psutil.Process(busy.proc.pid).children(recursive=True)
    assert "EngineFrontend" in [p.name() for p in below], [p.name() for p in below]
    core = busy.engine_cores()[0]
    core.suspend()
    sender = Client(broker.port, [])
    sender.publish(topic_of(ENGINE_DEATH, "request"), {"message": "hi", "maxTokens": 8, "requestId": ENGINE_DEATH[2]})
    eventually(lambda: pending_requests(metrics) >= 1, lambda: busy.log()[-3000:], interval=0.1)
    core.kill()
    assert busy.proc.wait(PATIENCE) == 1, busy.log()[-3000:]
    _, left = psutil.wait_procs(below, timeout=PATIENCE)
    assert not left, f"outlived the worker: {[(p.pid, p.name()) for p in left]}"
    wait_status(watcher, b"offline")
    # Nothing answered (the offline came after whatever the worker published): the request is
    # left for the restart.
    assert not watcher.received(lambda m: m.topic == topic_of(ENGINE_DEATH, "reply"))
    sender.close()
    restart = start_worker(tiny_model, broker, logs / "after-engine-death.log")
    workers.append(restart)
    (reply,) = replies_to(broker, watcher, ENGINE_DEATH)
    assert "error" not in reply, reply


def test_a_second_signal_forces_the_exit_and_a_request_interrupted_too_often_is_poison(
    tiny_model: Path,
    broker: Mosquitto,
    watcher: Client,
    serving_worker: Callable[[], WorkerProcess],
    workers: list[WorkerProcess],
    logs: Path,
) -> None:
    fourth = serving_worker()
    # A second stop signal while it drains (the default grace is 60 s) ends it at once.
    engine_processes = psutil.Process(fourth.proc.pid).children(recursive=True)
    start_long_generation(broker, FORCED)
    fourth.proc.send_signal(signal.SIGTERM)
    fourth.wait_log("Draining ")
    fourth.proc.send_signal(signal.SIGINT)
    # A drained stop (the second signal ignored) would be 0, after the 60 s grace at most.
    assert fourth.proc.wait(PATIENCE) == 1, fourth.log()[-3000:]
    assert "Second stop signal: exiting now" in fourth.log()
    _, left = psutil.wait_procs(engine_processes, timeout=PATIENCE)
    assert not left, f"outlived the worker: {[(p.pid, p.name()) for p in left]}"

    # That exit left the request counted as delivered once and unanswered. A start that allows
    # one delivery takes it for poison: a final engine_error instead of a second generation,
    # and the worker goes on serving.
    fifth = start_worker(tiny_model, broker, logs / "fifth.log", extra=("--max-deliveries", "1"))
    workers.append(fifth)
    (reply,) = replies_to(broker, watcher, FORCED)
    assert reply.get("error", {}).get("code") == "engine_error", reply
    assert "never completed" in reply["error"]["message"], reply
    assert "is poison" in fifth.log()
    sender = Client(broker.port, [])
    sender.publish(topic_of(AFTER, "request"), {"message": "still there?", "maxTokens": 4, "requestId": AFTER[2]})
    sender.close()
    (reply,) = replies_to(broker, watcher, AFTER)
    assert "error" not in reply, reply
    assert fifth.stop() == 0
