"""A worker's restarts and faults against a real mosquitto and the vLLM CPU engine: requests
sent while it is down are answered after it starts, and its retained status follows it (clean
stop, freeze, kill). The first start also speaks systemd's notify protocol to a socket the
test owns; the kill leaves none of the engine's processes behind, and the request it
interrupted is answered once by the next start, which also finds the sessions' history in
its store; a killed engine core makes the worker exit non-zero, and its request is answered
once after the restart.
One worker id and state directory, four worker processes in sequence (each engine start
costs ~40 s)."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from conftest import engine_args
from support import Client, Mosquitto, NotifyListener, WorkerProcess

pytestmark = pytest.mark.e2e
KEEPALIVE = 5
STATUS = "chat/_worker/steady/status"


def start_worker(model: Path, broker: Mosquitto, log: Path, env: dict[str, str] | None = None) -> WorkerProcess:
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
        ],
        log,
        env,
    )
    return worker


def wait_status(watcher: Client, payload: bytes, timeout: float) -> float:
    """Seconds until the retained status topic carries ``payload``."""
    started = time.monotonic()
    watcher.wait_for(lambda m: m.topic == STATUS and m.payload == payload, timeout=timeout)
    return time.monotonic() - started


@pytest.fixture(scope="module")
def watcher(broker: Mosquitto) -> Iterator[Client]:
    client = Client(broker.port, [STATUS, "chat/+/+/reply"])
    yield client
    client.close()


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("steady")


@pytest.fixture(scope="module")
def workers() -> Iterator[list[WorkerProcess]]:
    """The workers this module starts; whatever a failing test leaves running is killed."""
    started: list[WorkerProcess] = []
    yield started
    for worker in started:
        worker.stop(timeout=10)


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
    first = start_worker(tiny_model, broker, logs / "first.log", env)
    workers.append(first)
    try:
        ready = notify.wait_for("READY=1", timeout=300)
        check_notify_sequence(notify, ready, watcher)
        wait_status(watcher, b"online", timeout=10)
    finally:
        assert first.stop() == 0
        notify.close()
    stopping = notify.times("STOPPING=1")
    assert stopping and stopping[0] > ready, notify.lines()
    wait_status(watcher, b"offline", timeout=10)  # a clean stop publishes it itself
    for session in ("down-a", "down-b"):
        for turn in range(2):
            sender.publish(
                f"chat/carl/{session}/request",
                {"message": f"turn {turn}", "maxTokens": 8, "requestId": f"{session}-{turn}"},
            )
    sender.close()
    second = start_worker(tiny_model, broker, logs / "second.log")
    workers.append(second)  # the next test freezes and kills it
    wait_status(watcher, b"online", timeout=300)
    answered: dict[str, list[str]] = {"down-a": [], "down-b": []}
    for _ in range(4):
        reply = watcher.wait_for(
            lambda m: m.topic.startswith("chat/carl/") and m.topic.endswith("/reply"), timeout=120
        ).json()
        assert "error" not in reply, reply
        answered[reply["sessionId"]].append(reply["requestId"])
    assert answered == {"down-a": ["down-a-0", "down-a-1"], "down-b": ["down-b-0", "down-b-1"]}
    assert "session resumed" in second.log()


def check_notify_sequence(notify: NotifyListener, ready: float, watcher: Client) -> None:
    """systemd's view of the start: the start timeout extended while the model loaded, READY
    once the broker has acknowledged the subscriptions, then a watchdog ping every second."""
    extended = notify.times("EXTEND_TIMEOUT_USEC=")
    assert extended and extended[0] < ready, notify.lines()
    assert notify.at_arrival["READY=1"] is None  # published
    reply = watcher.wait_for(lambda m: m.topic == "chat/nina/ready/reply", timeout=120).json()
    assert reply.get("requestId") == "ready-0" and "error" not in reply, reply
    time.sleep(max(0.0, ready + 3.5 - time.monotonic()))
    pings = [t for t in notify.times("WATCHDOG=1") if t > ready]
    assert len(pings) >= 3, notify.lines()


def test_status_follows_freeze_and_kill(watcher: Client, workers: list[WorkerProcess], broker: Mosquitto) -> None:
    assert len(workers) == 2, "needs the worker the previous test started"
    worker = workers[1]
    assert worker.alive()
    # Frozen, its TCP connection stays open: only the keepalive can tell the broker, which
    # then publishes the Will. MQTT says after 1.5 x keepalive without a packet; Debian's
    # mosquitto 2.0.11 took 6-10.6 s here with a keepalive of 5 s (the bound below allows
    # for that; the 1.5 x target is the reliability issue's to pin down).
    worker.proc.send_signal(signal.SIGSTOP)
    try:
        waited = wait_status(watcher, b"offline", timeout=KEEPALIVE * 4)
        assert waited <= KEEPALIVE * 2.5, waited
    finally:
        worker.proc.send_signal(signal.SIGCONT)
    wait_status(watcher, b"online", timeout=30)  # reconnects by itself
    engine_processes = psutil.Process(worker.proc.pid).children(recursive=True)
    assert engine_processes, "vLLM's engine runs in child processes"
    # Killed in the middle of a generation: the next test checks it is answered once.
    start_long_generation(broker, KILLED)
    # The worker's own pid only: its children must follow by themselves (outside systemd
    # nothing else kills them; the workers fixture kills the whole group, but only later).
    worker.proc.send_signal(signal.SIGKILL)
    wait_status(watcher, b"offline", timeout=KEEPALIVE * 3)  # the Will, on the broken connection
    _, left = psutil.wait_procs(engine_processes, timeout=10)
    assert not left, f"outlived the worker: {[(p.pid, p.name()) for p in left]}"


KILLED = ("kim", "killed", "killed-0")
ENGINE_DEATH = ("kim", "engine", "engine-0")


def start_long_generation(broker: Mosquitto, where: tuple[str, str, str]) -> None:
    """Publish a long streamed request and return once its first tokens are out."""
    user, session, request_id = where
    client = Client(broker.port, [f"chat/{user}/{session}/stream"])
    try:
        request = {"message": "tell me everything", "maxTokens": 1000, "stream": True, "requestId": request_id}
        client.publish(f"chat/{user}/{session}/request", request)
        client.wait_topic(f"chat/{user}/{session}/stream", timeout=60)
    finally:
        client.close()


def replies_to(watcher: Client, where: tuple[str, str, str], settle: float) -> list[dict[str, object]]:
    """Every reply to the request within settle seconds after the first (which must come)."""
    user, session, request_id = where
    topic = f"chat/{user}/{session}/reply"
    found = [watcher.wait_for(lambda m: m.topic == topic, timeout=180).json()]
    deadline = time.monotonic() + settle
    while (left := deadline - time.monotonic()) > 0:
        try:
            found.append(watcher.wait_for(lambda m: m.topic == topic, timeout=left).json())
        except TimeoutError:
            break
    assert all(r.get("requestId") == request_id for r in found), found
    return found


def test_work_interrupted_by_a_kill_or_a_dead_engine_is_answered_once_after_a_restart(
    tiny_model: Path, broker: Mosquitto, watcher: Client, workers: list[WorkerProcess], logs: Path
) -> None:
    assert len(workers) == 2 and not workers[1].alive(), "needs the worker the previous test killed"
    third = start_worker(tiny_model, broker, logs / "third.log")
    workers.append(third)
    # The request the SIGKILL interrupted: stored nowhere as answered, left unacknowledged,
    # so the broker delivers it again; generated and answered exactly once.
    (reply,) = replies_to(watcher, KILLED, settle=3)
    assert "error" not in reply, reply
    # The history the killed worker stored: down-a had two turns, a new session none.
    sender = Client(broker.port, [])
    for session in ("down-a", "fresh"):
        request = {"message": "and now?", "maxTokens": 4, "requestId": f"{session}-later"}
        sender.publish(f"chat/carl/{session}/request", request)
    prompts = {}
    for _ in range(2):
        answer = watcher.wait_for(
            lambda m: m.topic.startswith("chat/carl/") and m.json().get("requestId", "").endswith("-later"),
            timeout=120,
        ).json()
        prompts[answer["sessionId"]] = answer["usage"]["promptTokens"]
    assert prompts["down-a"] > prompts["fresh"] + 10, prompts  # two turns came back from the store

    # The engine core dies in the middle of a generation (killed, as the OOM killer would):
    # the worker answers nothing, exits non-zero for systemd to restart it.
    engine_core = [p for p in psutil.Process(third.proc.pid).children(recursive=True) if "EngineCore" in p.name()]
    assert engine_core, [p.name() for p in psutil.Process(third.proc.pid).children(recursive=True)]
    start_long_generation(broker, ENGINE_DEATH)
    engine_core[0].kill()
    code = third.proc.wait(60)
    assert code != 0, third.log()[-3000:]
    assert "engine" in third.log().lower()
    fourth = start_worker(tiny_model, broker, logs / "fourth.log")
    workers.append(fourth)
    (reply,) = replies_to(watcher, ENGINE_DEATH, settle=3)
    assert "error" not in reply, reply
    sender.close()
    assert fourth.stop() == 0
