"""Streams while the session database is locked: the gaps between a stream's deltas while
another process holds SQLite's write lock.

    python -m bench.storelock --out DIR [--rounds 5] [--hold 2] [--max-tokens 500] [--model DIR]

One worker process (the real small model on the CPU engine, the tests' engine settings, the
SQLite store in ``DIR/state``) and a real mosquitto. Each round:

1. session ``a<r>`` asks for a long streamed reply; the benchmark records when each of its
   stream deltas arrives;
2. a second after its first delta, another process opens the worker's database and takes the
   write lock (``BEGIN IMMEDIATE``) for ``--hold`` seconds, as an operator's ``sqlite3`` shell
   or a backup does;
3. once the lock is held, a new session ``b<r>`` sends a request: counting its delivery is a
   write, which waits for the lock (the store's busy timeout, 1 s a try).

Reported per round and over all rounds: the gaps between consecutive deltas of ``a<r>`` (p50,
p99, max), the largest gap while the lock was held, and when ``b<r>`` was answered. With the
store on the event loop the lock wait stops every stream for as long as the store waits; with
the store on its own thread the stream goes on at the stream interval (50 ms by default).

The model is the real small one (``python -m worker.prepare_model smollm2``), at temperature 0
on a prompt that it answers at length: its stream is steady text. The tiny random model's
replies turn into runs of newlines, which the tokenizer's decoder holds back until the reply
ends: its streams stall by themselves, lock or not.

Results: DIR/storelock.json, and a summary on stdout.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from devtools.mqtt_client import Client, Received
from devtools.worker_process import engine_args
from worker.store.sqlite import DATABASE_NAME

from .common import REPO, percentile
from .runs import STOP_TIMEOUT, start_broker, start_worker

USER = "bench"
# SmolLM2-135M-Instruct goes on for thousands of tokens on this one (measured: 3000 of 3000).
PROMPT = (
    "Write a long, detailed essay on the history of the Roman Empire, from its founding to its fall, "
    "with many sections."
)
# Another process holding the write lock: what an operator's ``sqlite3`` shell does with
# BEGIN IMMEDIATE. It says "locked" once it holds the lock, and releases it after ARGV[2] s.
LOCKER = """
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)
db.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
db.execute("COMMIT")
db.close()
print("released", flush=True)
"""


def topic(session: str, kind: str) -> str:
    return f"chat/{USER}/{session}/{kind}"


class Locker:
    """Another process holding the database's write lock for ``seconds``, from ``start``
    (which returns once the lock is held) until it lets go; ``locked_at`` and
    ``released_at`` in time.perf_counter, as the client's arrival times."""

    def __init__(self, database: Path, seconds: float) -> None:
        self.database, self.seconds = database, seconds
        self.locked_at = self.released_at = 0.0
        self._done = threading.Thread(target=self._wait_release, daemon=True)
        self._proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", LOCKER, str(self.database), str(self.seconds)], stdout=subprocess.PIPE, text=True
        )
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        assert line.strip() == "locked", f"the locker said {line!r}"
        self.locked_at = time.perf_counter()
        self._done.start()

    def _wait_release(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        line = self._proc.stdout.readline()
        self.released_at = time.perf_counter()
        assert line.strip() == "released", f"the locker said {line!r}"

    def join(self) -> None:
        self._done.join(30)
        assert self._proc is not None
        self._proc.wait(10)


def gaps_ms(times: list[float]) -> list[float]:
    return [round((later - earlier) * 1000, 1) for earlier, later in itertools.pairwise(times)]


def summary(gaps: list[float]) -> dict[str, float]:
    return {
        "count": len(gaps),
        "p50_ms": percentile(gaps, 50),
        "p99_ms": percentile(gaps, 99),
        "max_ms": max(gaps, default=float("nan")),
    }


def run_round(client: Client, database: Path, number: int, hold: float, max_tokens: int) -> dict[str, Any]:
    """One round: a long stream in session a<number>, the lock, session b<number>'s request."""
    streaming, waiting = f"a{number}", f"b{number}"
    client.publish(
        topic(streaming, "request"),
        {"message": PROMPT, "maxTokens": max_tokens, "stream": True, "temperature": 0, "requestId": streaming},
    )
    first = client.wait_for(lambda m: m.topic in (topic(streaming, "stream"), topic(streaming, "reply")), 120)
    assert first.topic.endswith("/stream"), f"no stream: {first.payload!r}"
    deltas = [first]
    time.sleep(1.0)  # a second of the stream before the lock
    locker = Locker(database, hold)
    locker.start()
    sent_b = time.perf_counter()
    client.publish(topic(waiting, "request"), {"message": "hello", "maxTokens": 4, "requestId": waiting})
    replies: dict[str, Received] = {}
    deadline = time.monotonic() + 300
    while len(replies) < 2:
        message = client.wait_for(
            lambda m: m.topic.endswith(("/stream", "/reply")), timeout=deadline - time.monotonic()
        )
        if message.topic == topic(streaming, "stream"):
            deltas.append(message)
        elif message.topic.endswith("/reply"):
            replies[message.topic.split("/")[2]] = message
    locker.join()
    locked_at, released_at = locker.locked_at, locker.released_at
    times = [d.at for d in deltas]
    gaps = gaps_ms(times)
    pairs = zip(gaps, itertools.pairwise(times), strict=True)
    during: list[float] = []  # the gaps that overlap the lock
    outside: list[float] = []
    for gap, (earlier, later) in pairs:
        (during if later > locked_at and earlier < released_at else outside).append(gap)
    reply_a, reply_b = replies[streaming].json(), replies[waiting].json()
    return {
        "round": number,
        "deltas": len(deltas),
        "stream_s": round(times[-1] - times[0], 2),
        "stream_covers_lock": times[0] < locked_at and times[-1] > released_at,
        "lock_held_s": round(released_at - locked_at, 2),
        "gaps": summary(gaps),
        "largest_gap_while_locked_ms": max(during, default=float("nan")),
        "gaps_without_lock": summary(outside),
        "a_finish": reply_a.get("finishReason") or reply_a.get("error", {}).get("code"),
        "b_answer": "reply" if "reply" in reply_b else reply_b.get("error", {}).get("code"),
        "b_answered_after_s": round(replies[waiting].at - sent_b, 2),
        "b_answered_after_release_s": round(replies[waiting].at - released_at, 2),
        "gaps_ms": gaps,
        "gaps_outside_ms": outside,
        "gaps_while_locked_ms": during,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mosquitto", default=shutil.which("mosquitto") or "/usr/sbin/mosquitto")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hold", type=float, default=2.0, help="seconds the other process holds the lock")
    # 500 tokens: some 10 s of stream at the ~50 tokens/s of the CPU engine here.
    parser.add_argument("--max-tokens", type=int, default=500, help="the streamed reply's length")
    parser.add_argument("--model", type=Path, default=REPO / ".cache" / "models" / "smollm2-135m-instruct")
    parser.add_argument("--label", default="", help="what this run measures (e.g. before, after)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if not (model / "config.json").exists():
        parser.error(f"no model in {model}: prepare it with python -m worker.prepare_model smollm2")
    state = args.out / "state"
    shutil.rmtree(state, ignore_errors=True)
    (args.out / "broker").mkdir(exist_ok=True)
    broker = start_broker(args.mosquitto, args.out / "broker")
    worker_args = [*engine_args(model), "--state-dir", str(state), "--stats-interval", "0"]
    worker_args += ["--max-tokens-limit", str(args.max_tokens)]
    worker = start_worker(worker_args, broker.port, args.out / "worker.log")
    client = Client(broker.port, [f"chat/{USER}/#"])
    rounds: list[dict[str, Any]] = []
    try:
        database = state / DATABASE_NAME
        for number in range(args.rounds):
            result = run_round(client, database, number, args.hold, args.max_tokens)
            rounds.append(result)
            print(
                f"round {number}: gaps p50 {result['gaps']['p50_ms']} ms, p99 {result['gaps']['p99_ms']} ms, "
                f"max {result['gaps']['max_ms']} ms (p99 without the lock {result['gaps_without_lock']['p99_ms']}); "
                f"largest while locked {result['largest_gap_while_locked_ms']} ms; "
                f"b: {result['b_answer']} after {result['b_answered_after_s']} s",
                flush=True,
            )
    finally:
        client.close()
        worker.stop(STOP_TIMEOUT)
        broker.stop()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    pooled = [gap for result in rounds for gap in result["gaps_ms"]]
    # The same stream's gaps outside the lock: what the machine's load costs on its own.
    unlocked = [gap for result in rounds for gap in result.pop("gaps_outside_ms")]
    locked = [gap for result in rounds for gap in result.pop("gaps_while_locked_ms")]
    results = {
        "meta": {
            "label": args.label,
            "commit": commit,
            "machine": platform.platform(),
            "cpus": len(os.sched_getaffinity(0)),
            "hold_s": args.hold,
            "max_tokens": args.max_tokens,
            "model": str(model),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        "gaps": summary(pooled),
        "gaps_while_locked": summary(locked),
        "gaps_without_lock": summary(unlocked),
        "rounds": rounds,
    }
    (args.out / "storelock.json").write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps({k: v for k, v in results.items() if k != "rounds"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
