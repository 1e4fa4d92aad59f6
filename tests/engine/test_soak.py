"""Soak: 50 chat sessions x 20 turns through a real mosquitto and the vLLM CPU engine, with a
broker restart and a SIGKILL of the worker at random points in the middle. Afterwards every request has exactly
one answer (copies of it are byte-identical: a redelivered request is answered from the store)
and every session's stored history is a consistent suffix of its conversation. Copies still on
their way are waited for with one more turn per session, a marker: the worker answers a
session's turns in order, so a copy comes before the marker's answer."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from devtools.mosquitto import Mosquitto
from devtools.waiting import PATIENCE, eventually
from devtools.worker_process import WorkerProcess, engine_args
from worker.store.port import parse_session
from worker.store.sqlite import DATABASE_NAME

pytestmark = pytest.mark.e2e
SESSIONS = 50
TURNS = 20
MAX_HISTORY_TURNS = 6


class Conversations:
    """Every session sends its next turn as soon as the previous one is answered. The client
    keeps a persistent session (clean_start False, session expiry), so answers published while
    it reconnects after the broker's restart are queued for it."""

    def __init__(self, port: int) -> None:
        self.answers: dict[str, list[bytes]] = defaultdict(list)
        self.next_turn = dict.fromkeys(range(SESSIONS), 0)
        self.lock = threading.Lock()
        self.done = threading.Event()  # every session answered its TURNS turns
        self.settled = threading.Event()  # and its marker turn
        subscribed = threading.Event()
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="soak-frontend", protocol=mqtt.MQTTv5)
        client.on_connect = lambda c, u, f, r, p: c.subscribe("soak/+/+/reply", qos=1)
        client.on_subscribe = lambda *args: subscribed.set()
        client.on_message = self._on_message
        client.reconnect_delay_set(1, 1)
        props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        props.SessionExpiryInterval = 600
        client.connect("127.0.0.1", port, keepalive=10, clean_start=False, properties=props)
        client.loop_start()
        self.client = client
        assert subscribed.wait(PATIENCE), "the broker did not acknowledge the subscription"

    def start(self) -> None:
        for session in range(SESSIONS):
            self._send(session, 0)

    def send_markers(self) -> None:
        for session in range(SESSIONS):
            self._send(session, TURNS)

    def _send(self, session: int, turn: int) -> None:
        request = {"message": f"turn {turn} of session {session}", "maxTokens": 8, "requestId": f"s{session}-t{turn}"}
        self.client.publish(f"soak/user/s{session}/request", json.dumps(request).encode(), qos=1)

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        reply = json.loads(message.payload)
        session, turn = (int(part[1:]) for part in reply["requestId"].split("-"))
        with self.lock:
            self.answers[reply["requestId"]].append(bytes(message.payload))
            if self.next_turn[session] != turn:
                return  # a copy of an answer already counted
            self.next_turn[session] = turn + 1
            if turn + 1 < TURNS:
                self._send(session, turn + 1)
            elif all(t == TURNS for t in self.next_turn.values()):
                self.done.set()
            elif all(t == TURNS + 1 for t in self.next_turn.values()):
                self.settled.set()

    def answered(self) -> int:
        with self.lock:
            return sum(self.next_turn.values())

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def start_worker(model: Path, broker: Mosquitto, workdir: Path, name: str) -> WorkerProcess:
    args = [
        *engine_args(model),
        "--mqtt-port",
        str(broker.port),
        "--topic-prefix",
        "soak",
        "--worker-id",
        "soak",
        "--state-dir",
        str(workdir / "state"),
        "--max-history-turns",
        str(MAX_HISTORY_TURNS),
        "--mqtt-reconnect-max-delay",
        "1",
        "--max-requests-per-user-per-minute",  # one user sends every session's turns
        "0",
    ]
    return WorkerProcess(args, workdir / f"{name}.log")


@pytest.fixture
def soak_broker(tmp_path: Path) -> Iterator[Mosquitto]:
    broker = Mosquitto(tmp_path, keep_root=True, autosave="changes")  # survives its restart
    broker.start()
    yield broker
    broker.stop()


def test_soak_with_a_broker_restart_and_a_worker_kill(tiny_model: Path, soak_broker: Mosquitto, tmp_path: Path) -> None:
    total = SESSIONS * TURNS
    # The faults strike at random points; the seed is printed (shown on a failure) for a rerun.
    seed = int(os.environ.get("SOAK_SEED", time.time_ns() % 2**32))
    print(f"SOAK_SEED={seed}")
    rng = random.Random(seed)
    broker_restart_at, worker_kill_at = int(total * rng.uniform(0.15, 0.45)), int(total * rng.uniform(0.55, 0.85))
    workers = [start_worker(tiny_model, soak_broker, tmp_path, "first")]
    chats = Conversations(soak_broker.port)
    try:
        workers[0].wait_log("MQTT connected")
        chats.start()
        eventually(lambda: chats.answered() >= broker_restart_at, lambda: f"stuck at {chats.answered()}", interval=0.1)
        soak_broker.stop()  # SIGTERM: mosquitto saves its sessions and queued messages
        time.sleep(1)  # the fault: a second without a broker (not a wait for anything)
        soak_broker.restart()
        eventually(lambda: chats.answered() >= worker_kill_at, lambda: f"stuck at {chats.answered()}", interval=0.1)
        workers[0].proc.send_signal(signal.SIGKILL)  # mid-generation of a whole batch
        workers[0].proc.wait(PATIENCE)
        workers.append(start_worker(tiny_model, soak_broker, tmp_path, "second"))
        assert chats.done.wait(400), f"{chats.answered()} of {total} answered"
        chats.send_markers()
        assert chats.settled.wait(PATIENCE), f"{chats.answered()} of {total + SESSIONS} answered"
    finally:
        chats.close()
        for worker in workers:
            worker.stop(30)
        logs = "\n".join(w.log()[-2000:] for w in workers)
    assert len(chats.answers) == total + SESSIONS
    for request_id, copies in chats.answers.items():
        assert len(set(copies)) == 1, f"{request_id} got different answers: {copies}"
        assert "error" not in json.loads(copies[0]), (copies[0], logs)
    check_stored_histories(tmp_path / "state" / DATABASE_NAME, chats.answers)


def check_stored_histories(database: Path, answers: dict[str, list[bytes]]) -> None:
    """Each session's kept turns are the last turns of its conversation (its marker the last),
    in order, with the text its client received; every answer is stored under its request key."""
    db = sqlite3.connect(database)
    states = dict(db.execute("SELECT name, state FROM sessions").fetchall())
    stored_answers = {(s, k): p for s, k, p in db.execute("SELECT session, key, payload FROM answers")}
    assert len(states) == SESSIONS
    for session in range(SESSIONS):
        name = f"user/s{session}"
        _, turns, _, _ = parse_session(name, states[name])
        keys = [t.key for t in turns]
        assert 1 <= len(keys) <= MAX_HISTORY_TURNS and keys == [
            f"s{session}-t{t}" for t in range(TURNS + 1 - len(keys), TURNS + 1)
        ]
        for turn in turns:
            assert turn.assistant == json.loads(answers[turn.key][0])["reply"]
        for t in range(TURNS + 1):
            key = f"s{session}-t{t}"
            assert stored_answers[(name, key)] in answers[key]
