"""Several benchmark clients for bench/multigpu.py's two-turn bursts, each its own process with
its own MqttDriver and MQTT connection.

One Python client receives every reply of a burst on paho's one network thread and parses it
under the GIL: at 1,000 sessions against four workers it kept 1.15 cores busy (0.26 against
one worker), so it may be what limits the workers it measures. With K clients the N sessions
of a burst are split over K processes (consecutive session numbers, so every session keeps
its messages and its records their session number whatever K is), which start each round
together: a barrier that every client passes with its connection up and every request of
the burst rendered. A round's wall runs from its first send in any client to its last reply
in any client (time.perf_counter() is CLOCK_MONOTONIC on Linux, one clock for every process
of the host).

Each client is its own user namespace, bench0, bench1, ... (chat/bench0/<session>/request):
an MQTT wildcard matches whole topic levels, so that is how a client receives its own
sessions' replies and no other's (with one namespace each client would receive, and parse,
every reply of the burst). The worker's admission releases the requests that wait in the
worker (beyond the engine's sequences) user by user in turn, so with several clients those
are released across the namespaces in turn rather than in arrival order.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

from .common import Record, Workload

# A client that passed a round's barrier waits there for the slowest client's round before
# it: up to a whole round (MqttDriver waits 900 s for a reply), twice for slack.
BARRIER_TIMEOUT_S = 1800
STOP_TIMEOUT_S = 10


@dataclass(frozen=True)
class Burst:
    """One client's part of a burst: sessions first .. first + sessions - 1, two turns."""

    label: str
    workload: Workload
    followup: Workload
    first: int
    sessions: int


@dataclass(frozen=True)
class ClientResult:
    """One client's part of a burst: its replies, each round's (first send, last reply) in
    time.perf_counter(), and the CPU time its process used (every thread: paho's too)."""

    records: list[Record]
    spans: list[tuple[float, float]]
    cpu_s: float


def split_sessions(sessions: int, clients: int) -> list[tuple[int, int]]:
    """(first session, sessions) of each client: consecutive ranges whose sizes differ by at
    most one (a client may get none where there are fewer sessions than clients)."""
    if clients < 1:
        raise ValueError(f"clients must be at least 1, got {clients}")
    base, rest = divmod(sessions, clients)
    counts = [base + (k < rest) for k in range(clients)]
    firsts = [sum(counts[:k]) for k in range(clients)]
    return list(zip(firsts, counts, strict=True))


def merged_walls(results: list[ClientResult]) -> list[float]:
    """Each round's wall over every client: its first send in any client to its last reply in
    any client (seconds). A client without sessions has no part in it."""
    spans = [result.spans for result in results if result.records]
    return [max(end for _, end in rounds) - min(start for start, _ in rounds) for rounds in zip(*spans, strict=True)]


def merge(results: list[ClientResult]) -> tuple[list[Record], list[float], list[float]]:
    """The clients' replies as one burst's, its rounds' walls, and each client's CPU in cores
    (its CPU time over the sum of the walls)."""
    walls = merged_walls(results)
    wall = max(sum(walls), 1e-9)
    records = [record for result in results for record in result.records]
    return records, walls, [round(result.cpu_s / wall, 2) for result in results]


def client_cpu(cores: list[float]) -> dict[str, Any]:
    """The summary's client fields: near 1.0 in ``client_cpu_cores_max`` a client, not the
    workers, limits the burst; ``client_cpu_cores`` is what all of them used together."""
    return {
        "clients": len(cores),
        "client_cpu_cores": round(sum(cores), 2),
        "client_cpu_cores_max": max(cores),
        "client_cpu_cores_per_client": cores,
    }


def _run(driver: Any, count_tokens: Any, barrier: Barrier, burst: Burst) -> ClientResult:
    cpu = time.process_time()
    records = driver.run_rounds(
        burst.label,
        burst.workload,
        count_tokens,
        sessions=burst.sessions,
        turns=2,
        stream=False,
        followup=burst.followup,
        first=burst.first,
        before_round=lambda _turn: barrier.wait(BARRIER_TIMEOUT_S),
    )
    return ClientResult(records, list(driver.round_spans), time.process_time() - cpu)


def _client(conn: Connection, barrier: Barrier, port: int, model: str, user: str) -> None:
    """A client process: connect as ``user``, say so (None), then run each Burst it is sent
    until None."""
    from worker.engine.tokenizer import ChatTokenizer

    from .mqtt_driver import MqttDriver

    try:
        tokenizer = ChatTokenizer(model)
        driver = MqttDriver("127.0.0.1", port, user=user, stats=False)
        try:
            conn.send(None)
            while (burst := conn.recv()) is not None:
                conn.send(_run(driver, tokenizer.count_text, barrier, burst))
        finally:
            driver.close()
    except BaseException:
        barrier.abort()  # the others stop waiting for this one; its traceback goes to stderr
        raise


class ClientPool:
    """K client processes (spawned: nothing of the parent's threads or connections), each
    connected to the broker on ``port`` until close()."""

    def __init__(self, clients: int, port: int, model: Path) -> None:
        context = multiprocessing.get_context("spawn")
        self.barrier = context.Barrier(clients)
        self.conns: list[Connection] = []
        self.processes: list[multiprocessing.process.BaseProcess] = []
        for k in range(clients):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=_client,
                args=(theirs, self.barrier, port, str(model), f"bench{k}"),
                name=f"bench-client{k}",
                daemon=True,
            )
            process.start()
            theirs.close()  # so that our recv() sees the end of a client that died
            self.conns.append(ours)
            self.processes.append(process)
        try:
            for k in range(clients):
                self._receive(k)
        except BaseException:
            self.close()  # the others, connected or not
            raise

    def _receive(self, k: int) -> Any:
        try:
            return self.conns[k].recv()
        except EOFError:
            self.processes[k].join(STOP_TIMEOUT_S)
            code = self.processes[k].exitcode
            raise RuntimeError(f"benchmark client {k} exited (code {code}); its traceback is above") from None

    def run_rounds(self, label: str, workload: Workload, followup: Workload, sessions: int) -> list[ClientResult]:
        """A two-turn burst of ``sessions`` split over the clients (see the module's doc)."""
        for conn, (first, count) in zip(self.conns, split_sessions(sessions, len(self.conns)), strict=True):
            conn.send(Burst(label, workload, followup, first, count))
        return [self._receive(k) for k in range(len(self.conns))]

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):  # that client is gone already
                conn.send(None)
        for process in self.processes:
            process.join(STOP_TIMEOUT_S)
            if process.is_alive():
                process.terminate()
                process.join(STOP_TIMEOUT_S)
