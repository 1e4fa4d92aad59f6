"""systemd's notify protocol (notify.py), the transport's readiness and liveness, and the
engine's child processes dying with their parent (children.py); no engine is started here.
The whole sequence from a real worker is checked in test_reliability.py."""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from devtools import REPO
from devtools.mosquitto import Mosquitto
from devtools.systemd import NotifyListener
from devtools.waiting import PATIENCE, eventually
from worker.system.children import PARENT_ENV, die_with_parent, set_parent_death_signal
from worker.system.notify import Notifier
from worker.transport.mqtt import MqttSettings, MqttTransport


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[NotifyListener]:
    sock = NotifyListener(str(tmp_path / "notify.sock"))
    yield sock
    sock.close()


def test_without_notify_socket_nothing_is_sent() -> None:
    env: dict[str, str] = {"WATCHDOG_USEC": "1000000"}
    notifier = Notifier.from_environment(env)
    assert not notifier.enabled and notifier.watchdog_interval is None
    assert notifier.send("READY=1") is False
    with notifier.extending_timeout(every=0.01):
        pass  # no thread, no error


def test_messages_reach_a_path_socket_and_the_variables_are_not_inherited(listener: NotifyListener) -> None:
    env = {"NOTIFY_SOCKET": listener.address, "WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(os.getpid())}
    notifier = Notifier.from_environment(env)
    assert env == {}  # the engine's child processes must not notify in the worker's name
    assert notifier.watchdog_interval == 1.5  # half of WATCHDOG_USEC
    notifier.ready("Serving")
    notifier.stopping("Stopping")
    listener.wait_for("STOPPING=1")
    assert [message for _, message in listener.received] == [
        ["READY=1", "STATUS=Serving"],
        ["STOPPING=1", "STATUS=Stopping"],
    ]


def test_abstract_namespace_socket() -> None:
    listener = NotifyListener(f"@worker-test-{uuid.uuid4().hex}")
    try:
        assert Notifier(listener.address).send("STATUS=abstract")
        listener.wait_for("STATUS=abstract")
    finally:
        listener.close()


def test_watchdog_meant_for_another_process_is_not_ours(listener: NotifyListener) -> None:
    env = {"NOTIFY_SOCKET": listener.address, "WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "1"}
    assert Notifier.from_environment(env).watchdog_interval is None


def test_a_vanished_socket_is_logged_not_raised(tmp_path: Path) -> None:
    assert Notifier(str(tmp_path / "gone.sock")).send("READY=1") is False


def test_start_timeout_is_extended_while_the_block_runs_even_if_it_holds_the_event_loop(
    listener: NotifyListener,
) -> None:
    notifier = Notifier(listener.address)
    with notifier.extending_timeout(every=0.05, extension=30):
        # Like vLLM's engine start, nothing else runs on this thread while it waits.
        listener.wait_for("EXTEND_TIMEOUT_USEC=30000000", count=4)
    # Stopped with the block: its thread is gone, and nothing it sent comes after a marker
    # sent now (a datagram socket keeps their order).
    assert not [t for t in threading.enumerate() if t.name == "systemd-extend-timeout"]
    assert notifier.send("STATUS=after the block")
    listener.wait_for("STATUS=after the block")
    lines = listener.lines()
    assert not [line for line in lines[lines.index("STATUS=after the block") :] if line.startswith("EXTEND")], lines


def test_extensions_stop_at_the_limit(listener: NotifyListener) -> None:
    notifier = Notifier(listener.address)
    with notifier.extending_timeout(every=0.05, limit=0.12):
        # The block outlasts the limit: the thread ends by itself, before the block does.
        eventually(lambda: not [t for t in threading.enumerate() if t.name == "systemd-extend-timeout"], "no stop")
    # One at the start, then one each 0.05 s while under 0.12 s have passed: at most three (a
    # busy machine may leave time for fewer).
    assert 1 <= len(listener.times("EXTEND_TIMEOUT_USEC=")) <= 3, listener.lines()


def test_watchdog_pings_only_while_healthy(listener: NotifyListener) -> None:
    notifier = Notifier(listener.address, watchdog_usec=100_000)  # a ping every 0.05 s
    problem: list[str | None] = [None]
    checks = [0]  # how often the watchdog asked health()

    def health() -> str | None:
        checks[0] += 1
        return problem[0]

    async def run() -> None:
        task = asyncio.ensure_future(notifier.watchdog_forever(health))
        await asyncio.to_thread(listener.wait_for, "WATCHDOG=1", count=3)
        problem[0] = "the engine is dead"
        unhealthy_from = checks[0]

        # Three more rounds of the watchdog, each one that would have pinged had it been healthy.
        async def rounds() -> None:
            while checks[0] < unhealthy_from + 3:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(rounds(), PATIENCE)
        task.cancel()

    asyncio.run(run())
    assert notifier.send("STATUS=marker")  # after everything the watchdog sent
    listener.wait_for("STATUS=marker")
    lines = listener.lines()
    unhealthy = lines.index("STATUS=Unhealthy: the engine is dead")
    assert "WATCHDOG=1" not in lines[unhealthy:], "pinged while unhealthy"


def test_ready_waits_for_the_suback_not_the_connack() -> None:
    """The handover from paho's callbacks, with a stand-in client: connected is not subscribed."""
    settings = MqttSettings("localhost", 1883, "w", None, None, 5, 1, 2, 60, ("chat/+/+/request",), "s")

    class StandInClient:
        def socket(self) -> None:
            return None

        def subscribe(self, topics: Any) -> tuple[int, int]:
            return 0, 17

        def publish(self, *args: Any, **kwargs: Any) -> None:
            pass

    async def run() -> list[bool]:
        transport = MqttTransport(settings, asyncio.get_running_loop())
        client: Any = StandInClient()
        success = SimpleNamespace(is_failure=False, value=0)
        states = []
        transport._on_connect(client, None, SimpleNamespace(session_present=False), success, None)  # type: ignore[arg-type]
        await asyncio.sleep(0.01)
        states.append(transport.connected and not transport._subscribed.is_set())
        transport._on_subscribe(client, None, 16, [success], None)  # type: ignore[list-item]
        await asyncio.sleep(0.01)
        states.append(not transport._subscribed.is_set())  # not the SUBACK of our SUBSCRIBE
        transport._on_subscribe(client, None, 17, [success], None)  # type: ignore[list-item]
        await asyncio.wait_for(transport.wait_subscribed(), 1)
        return states

    assert asyncio.run(run()) == [True, True]


def test_the_network_loop_is_seen_alive_until_closed(broker: Mosquitto) -> None:
    settings = MqttSettings(
        "127.0.0.1", broker.port, f"loop-{uuid.uuid4().hex[:8]}", None, None, 5, 1, 2, 0, ("t/loop",), "t/status"
    )

    async def run() -> list[bool]:
        transport = MqttTransport(settings, asyncio.get_running_loop())
        seen = [transport.loop_alive]
        transport.start()
        await asyncio.wait_for(transport.wait_subscribed(), 10)
        seen.append(transport.loop_alive)
        await transport.close()
        seen.append(transport.loop_alive)
        return seen

    assert asyncio.run(run()) == [False, True, False]


# A process that ties itself to its parent the way vLLM's processes do (logs.LoguruHandler).
# Both sleep longer than any test waits (PATIENCE): a child that outlives its parent is seen.
CHILD = (
    "import time\nfrom worker.children import die_with_parent\n"
    "die_with_parent()\nprint('up', flush=True)\ntime.sleep(3600)\n"
)
# A parent that starts CHILD, reports its pid, and waits to be killed.
PARENT = (
    "import os, subprocess, sys, time\n"
    f"os.environ[{PARENT_ENV!r}] = str(os.getpid())\n"
    f"child = subprocess.Popen([sys.executable, '-c', {CHILD!r}], stdout=subprocess.PIPE, text=True)\n"
    "child.stdout.readline()\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(3600)\n"
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_dies_with_its_killed_parent() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, cwd=REPO)
    child_pid = int(parent.stdout.readline())  # type: ignore[union-attr]
    try:
        parent.send_signal(signal.SIGKILL)
        parent.wait(PATIENCE)
        eventually(lambda: not pid_alive(child_pid), "the child outlived its parent")
    finally:
        if pid_alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)


def test_a_child_whose_parent_died_before_it_could_ask_exits() -> None:
    # The expected parent is not its parent: the one that started it is already gone.
    env = {**os.environ, PARENT_ENV: "1" if os.getpid() != 1 else "2"}
    result = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=PATIENCE, cwd=REPO
    )
    assert result.returncode == 1 and "up" not in result.stdout, result.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_worker_itself_is_not_tied_to_its_parent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PARENT_ENV, str(os.getpid()))  # what expect_children() sets in the worker
    try:
        die_with_parent()
        assert parent_death_signal() == 0
    finally:
        set_parent_death_signal(0)


def parent_death_signal() -> int:
    value = ctypes.c_int(-1)
    ctypes.CDLL(None).prctl(2, ctypes.byref(value), 0, 0, 0)  # PR_GET_PDEATHSIG
    return value.value


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False
