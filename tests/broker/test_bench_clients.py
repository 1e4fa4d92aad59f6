"""Several benchmark clients (bench/clients.py, ``bench.multigpu --clients``) against a real
mosquitto and a pretend worker that answers every request at once: each client sends and
receives its own sessions, every client's round starts once every client has the round
before's replies, and their replies merge into one burst."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bench.clients import ClientPool, merged_walls
from bench.common import Workload
from bench.mqtt_driver import MqttDriver
from bench.multigpu import burst_runs, summarise_burst
from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import connect


class Answering:
    """A pretend worker: every request answered at once, as a non-streamed reply; when each
    request arrived and each reply left (time.perf_counter(), the clients' clock)."""

    def __init__(self, port: int) -> None:
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str, int, float]] = []  # user, session, turn, arrived
        self.replied: list[tuple[int, float]] = []  # turn, sent
        self.client = connect(port, [("chat/+/+/request", 1)], on_message=self._answer)

    def _answer(self, message: Any) -> None:
        _, user, session, _ = message.topic.split("/")
        request = json.loads(message.payload)
        turn = int(request["requestId"].rsplit("-t", 1)[1])
        with self.lock:
            self.requests.append((user, session, turn, time.perf_counter()))
        reply = {
            "requestId": request["requestId"],
            "text": "ok",
            "finishReason": "stop",
            "usage": {"promptTokens": 100 + 200 * turn, "cachedTokens": 96 * turn, "completionTokens": 4},
            "latency": {"queueMs": 1.0, "ttftMs": 2.0, "totalMs": 3.0},
        }
        sent = time.perf_counter()
        self.client.publish(f"chat/{user}/{session}/reply", json.dumps(reply), qos=1)
        with self.lock:
            self.replied.append((turn, sent))

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def test_clients_share_a_burst_start_each_round_together_and_merge(broker: Mosquitto, tiny_model: Path) -> None:
    worker = Answering(broker.port)
    pool = ClientPool(2, broker.port, tiny_model)
    try:
        workload = Workload("You are terse.", user_tokens=(8, 12), max_tokens=4)
        followup = Workload("You are terse.", user_tokens=(4, 4), max_tokens=4)
        results = pool.run_rounds("burst-test-run", workload, followup, 5)
    finally:
        pool.close()
        worker.close()
    assert [sorted({r.session for r in result.records}) for result in results] == [[0, 1, 2], [3, 4]]
    assert all(len(result.records) == 2 * len({r.session for r in result.records}) for result in results)
    # Each client its own namespace, so each receives only its own sessions' replies.
    assert {user for user, *_ in worker.requests} == {"bench0", "bench1"}
    assert len({(user, session) for user, session, *_ in worker.requests}) == 5
    # The second round started in every client once every first-turn reply was out.
    assert min(at for *_, turn, at in worker.requests if turn == 1) > max(
        at for turn, at in worker.replied if turn == 0
    )
    summary, records = summarise_burst(results, 16)
    assert len(records) == 10 and summary["clients"] == 2 and summary["turns_without_history"] == 0
    assert summary["cache"]["sessions"] == 5 and summary["cache"]["first_turn_found"] == 1.0
    # The walls span both clients' rounds: from the first send in either to the last reply in either.
    walls = merged_walls(results)
    assert all(walls[turn] >= result.spans[turn][1] - result.spans[turn][0] for result in results for turn in (0, 1))
    assert [len(result.spans) for result in results] == [2, 2] and not any(p.is_alive() for p in pool.processes)


def test_one_client_is_this_process_as_before(broker: Mosquitto, tokenizer: Any) -> None:
    """--clients 1: the burst runs in this process on the driver that also receives the
    workers' stats, in the namespace ``bench``, its walls those the driver measured."""
    worker = Answering(broker.port)
    driver = MqttDriver("127.0.0.1", broker.port)
    progress: list[int] = []
    try:
        workload = Workload("You are terse.", user_tokens=(8, 12), max_tokens=4)
        bar = SimpleNamespace(update=progress.append)
        burst = burst_runs("burst_single", driver, None, tokenizer, workload, workload, bar)
        [result] = burst("run", 3)
    finally:
        driver.close()
        worker.close()
    assert sorted((r.session, r.turn) for r in result.records) == [(s, t) for s in range(3) for t in range(2)]
    assert {user for user, *_ in worker.requests} == {"bench"} and sum(progress) == 6
    assert merged_walls([result]) == pytest.approx(driver.round_walls)
