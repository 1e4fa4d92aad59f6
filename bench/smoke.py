"""A smoke run of a live worker through MQTT, as chat frontends use it.

Phase 1: one session, several turns in sequence (history growth, prefix cache).
Phase 2: many sessions at once, a few turns each (continuous batching).
Prints per-turn and per-phase numbers and writes them as JSON. Not a benchmark harness:
no baselines, no plots; it proves the pipeline works on a machine and shows its order of speed.

    python bench/smoke.py --port 1883 --worker-id w1 [--turns 4] [--sessions 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from worker.transport import set_tcp_nodelay

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven curious engineers measure latency "
    "throughput cache hits and batch sizes on a long winter night near the quiet mountain lake"
).split()


def text(words: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(words))


@dataclass
class Result:
    session: str
    turn: int
    client_ms: float
    reply: dict[str, Any]


class Driver:
    def __init__(self, host: str, port: int, prefix: str) -> None:
        self.prefix = prefix
        self.replies: queue.Queue[tuple[float, str, dict[str, Any]]] = queue.Queue()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        self.client.on_message = lambda c, u, m: self.replies.put((time.perf_counter(), m.topic, json.loads(m.payload)))
        self.client.connect(host, port)
        set_tcp_nodelay(self.client)  # or every round trip waits for delayed ACKs
        self.client.loop_start()
        self.client.subscribe(f"{prefix}/bench/+/reply", qos=1)
        time.sleep(0.3)

    def send(self, session: str, payload: dict[str, Any]) -> float:
        sent = time.perf_counter()
        self.client.publish(f"{self.prefix}/bench/{session}/request", json.dumps(payload), qos=1)
        return sent

    def run_turns(self, sessions: list[str], turns: int, system: str, user_words: int, max_tokens: int) -> list[Result]:
        """Each session sends its next turn as soon as its previous reply arrives."""
        results: list[Result] = []
        sent_at: dict[str, float] = {}
        turn_of = dict.fromkeys(sessions, 0)
        for i, session in enumerate(sessions):
            payload = {"message": text(user_words, i), "maxTokens": max_tokens, "systemPrompt": system}
            sent_at[session] = self.send(session, payload)
        while len(results) < len(sessions) * turns:
            received, topic, reply = self.replies.get(timeout=600)
            session = topic.split("/")[-2]
            if "error" in reply:
                raise RuntimeError(f"error reply: {reply}")
            results.append(Result(session, turn_of[session], (received - sent_at[session]) * 1000, reply))
            turn_of[session] += 1
            if turn_of[session] < turns:
                sent_at[session] = self.send(
                    session, {"message": text(user_words, turn_of[session] + 17), "maxTokens": max_tokens}
                )
        return results


def summarize(results: list[Result], wall_s: float) -> dict[str, Any]:
    latencies = sorted(r.client_ms for r in results)
    completion = sum(r.reply["usage"]["completionTokens"] for r in results)
    prompt = sum(r.reply["usage"]["promptTokens"] for r in results)
    cached = sum(r.reply["usage"]["cachedTokens"] for r in results)
    return {
        "requests": len(results),
        "wall_s": round(wall_s, 2),
        "p50_ms": round(statistics.median(latencies), 1),
        "p95_ms": round(latencies[max(0, int(len(latencies) * 0.95) - 1)], 1),
        "completion_tok_per_s": round(completion / wall_s, 1),
        "requests_per_s": round(len(results) / wall_s, 2),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_share": round(cached / prompt, 3) if prompt else 0.0,
        "mqtt_overhead_p50_ms": round(
            statistics.median(r.client_ms - r.reply["latency"]["totalMs"] for r in results), 2
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=1883)
    parser.add_argument("--prefix", default="chat")
    parser.add_argument("--worker-id", required=True, help="to read the worker's stats topic")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--sessions", type=int, nargs="+", default=[8])
    parser.add_argument("--system-words", type=int, default=350)
    parser.add_argument("--user-words", type=int, default=110)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--wait-online", type=float, default=0, help="first wait this long for the worker's status")
    args = parser.parse_args()

    driver = Driver(args.host, args.port, args.prefix)
    if args.wait_online:
        status: queue.Queue[bytes] = queue.Queue()
        driver.client.message_callback_add(
            f"{args.prefix}/_worker/{args.worker_id}/status", lambda c, u, m: status.put(m.payload)
        )
        driver.client.subscribe(f"{args.prefix}/_worker/{args.worker_id}/status", qos=1)
        deadline = time.monotonic() + args.wait_online
        while status.get(timeout=max(0.1, deadline - time.monotonic())) != b"online":
            pass
    system = text(args.system_words, 99)
    out: dict[str, Any] = {"args": vars(args)}

    session = "one-" + uuid.uuid4().hex[:8]
    started = time.perf_counter()
    sequential = driver.run_turns([session], args.turns, system, args.user_words, args.max_tokens)
    out["multi_turn"] = {
        "turns": [
            {"turn": r.turn + 1, "client_ms": round(r.client_ms, 1), **r.reply["usage"], **r.reply["latency"]}
            for r in sequential
        ],
        **summarize(sequential, time.perf_counter() - started),
    }
    print("multi-turn, one session:")
    for t in out["multi_turn"]["turns"]:
        print(
            f"  turn {t['turn']}: {t['client_ms']:8.1f} ms client, ttft {t['ttftMs']:7.1f} ms, "
            f"prompt {t['promptTokens']} ({t['cachedTokens']} cached), {t['completionTokens']} generated"
        )
    out["concurrent"] = []
    for count in args.sessions:
        sessions = [f"c{count}-{i}-{uuid.uuid4().hex[:6]}" for i in range(count)]
        started = time.perf_counter()
        results = driver.run_turns(sessions, 3, system, args.user_words, args.max_tokens)
        summary = {"sessions": count, **summarize(results, time.perf_counter() - started)}
        out["concurrent"].append(summary)
        print(f"{count} sessions x 3 turns: {json.dumps(summary)}")

    stats_box: queue.Queue[dict[str, Any]] = queue.Queue()
    driver.client.on_message = lambda c, u, m: stats_box.put(json.loads(m.payload))
    driver.client.subscribe(f"{args.prefix}/_worker/{args.worker_id}/stats", qos=1)
    try:
        out["worker_stats"] = stats_box.get(timeout=60)
        print("worker stats:", json.dumps(out["worker_stats"]))
    except queue.Empty:
        print("no stats message within 60 s", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
