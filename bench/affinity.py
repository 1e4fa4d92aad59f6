"""What session affinity is worth: two workers of one share group on the shared Redis store,
with and without routing each request to its session's owner (issue 7, point 2).

    python -m bench.affinity --out bench/results/affinity      # CPU engine, tiny model

mosquitto hands a group's requests round robin, so without the owner routing a session's turns
alternate between the workers, and a turn finds in its worker's prefix cache only what that
worker computed for the session. Per mode: two worker starts (at once), 2 x SESSIONS conversations
of TURNS turns, each turn sent when the previous one is answered (the client waits, so turns
stay in order in both modes); half of them share one system prompt (which every worker then
has cached), half have their own. Measured from vLLM's own counts: each reply's cachedTokens
(vLLM's num_cached_tokens) against its promptTokens, turns >= 2, and each worker's
prefixCacheHitRateTotal (vLLM's prefix-cache counters, from its stats).
"""

from __future__ import annotations

import argparse
import itertools
import json
import queue
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from devtools.mqtt_client import Client, Received
from devtools.worker_process import WorkerProcess

from .common import make_workload
from .runs import start_broker, start_redis

SESSIONS = 8
TURNS = 6
BLOCK = 32


def start_workers(mode: str, model: Path, port: int, redis_port: int, workdir: Path) -> list[WorkerProcess]:
    workers = []
    for name in ("a", "b"):
        worker_id = f"{mode}-{name}"
        args = [
            *("--model", str(model), "--enforce-eager", "--block-size", str(BLOCK)),
            *("--gpu-memory-utilization", "0.1", "--max-model-len", "2048", "--max-num-seqs", "16"),
            *("--mqtt-port", str(port), "--topic-prefix", mode, "--worker-id", worker_id),
            *("--share-group", mode, "--mqtt-session-expiry", "0", "--stats-interval", "1"),
            *("--store", "redis", "--redis-url", f"redis://127.0.0.1:{redis_port}/0"),
            "--redis-route-to-owner" if mode == "owner" else "--no-redis-route-to-owner",
            *("--max-requests-per-user-per-minute", "0"),
        ]
        status = (port, f"{mode}/_worker/{worker_id}/status")
        workers.append(WorkerProcess(args, workdir / f"{worker_id}.log", status=status))
    return workers


def run_mode(mode: str, model: Path, port: int, redis_port: int, workdir: Path) -> dict[str, Any]:
    from worker.engine.tokenizer import ChatTokenizer

    tokenizer = ChatTokenizer(str(model))
    workload = make_workload(tokenizer.count_text, system_tokens=300, user_tokens=(60, 120), max_tokens=32)
    client = Client(port, [f"{mode}/+/+/reply", f"{mode}/_worker/+/stats"])
    workers = start_workers(mode, model, port, redis_port, workdir)
    stats: dict[str, dict[str, Any]] = {}
    try:
        for worker in workers:
            worker.wait_online(900)  # they load at the same time
        records: list[dict[str, Any]] = []
        turn_of = dict.fromkeys(range(2 * SESSIONS), 0)
        # Sessions 0..SESSIONS-1 share one system prompt (cached on every worker once it has
        # served any of them); the others have one of their own each.
        own_prompts = [make_workload(tokenizer.count_text, system_tokens=300, seed=100 + s) for s in range(SESSIONS)]

        def send(session: int) -> None:
            turn = turn_of[session]
            request = {"message": workload.user_message(session, turn, tokenizer.count_text), "maxTokens": 32}
            if turn == 0:
                shared = session < SESSIONS
                request["systemPrompt"] = (workload if shared else own_prompts[session - SESSIONS]).system_prompt
            request["requestId"] = f"s{session}-t{turn}"
            client.publish(f"{mode}/bench/s{session}/request", request)

        for session in range(2 * SESSIONS):
            send(session)
        while len(records) < 2 * SESSIONS * TURNS:
            message = _get(client, 300)
            assert message is not None, "no reply within 300 s"
            if message.topic.endswith("/stats"):
                stats[message.topic] = message.json()
                continue
            reply = message.json()
            assert "error" not in reply, reply
            session = int(reply["sessionId"][1:])
            records.append({"session": session, "turn": turn_of[session], **reply["usage"]})
            turn_of[session] += 1
            if turn_of[session] < TURNS:
                send(session)
        time.sleep(2.5)  # two more stats intervals: the counters after the last turn
        while (message := _get(client, 0.1)) is not None:
            if message.topic.endswith("/stats"):
                stats[message.topic] = message.json()
    finally:
        for worker in workers:
            worker.stop(120)
        client.close()
    return summarize(mode, records, stats, workdir)


def _get(client: Client, timeout: float) -> Received | None:
    try:
        return client.messages.get(timeout=timeout)
    except queue.Empty:
        return None


def hit_rates(records: list[dict[str, Any]]) -> dict[str, Any]:
    later = [r for r in records if r["turn"] >= 1]
    prompt = sum(r["promptTokens"] for r in later)
    cached = sum(r["cachedTokens"] for r in later)
    sessions = sorted({r["session"] for r in records})
    by_session = [sorted((r for r in records if r["session"] == s), key=lambda r: r["turn"]) for s in sessions]
    reuse = []  # of the previous turn's prompt, in whole blocks: what a warm cache would give
    for turns in by_session:
        for previous, current in itertools.pairwise(turns):
            reusable = previous["promptTokens"] // BLOCK * BLOCK
            reuse.append(min(1.0, current["cachedTokens"] / reusable) if reusable else 0.0)
    return {
        "turn_2_plus_prompt_tokens": prompt,
        "turn_2_plus_cached_tokens": cached,
        "turn_2_plus_uncached_tokens": prompt - cached,  # what the engines had to prefill
        "turn_2_plus_hit_rate": round(cached / prompt, 3) if prompt else None,
        "previous_prompt_reused": round(sum(reuse) / len(reuse), 3) if reuse else None,
    }


def summarize(mode: str, records: list[dict[str, Any]], stats: dict[str, Any], workdir: Path) -> dict[str, Any]:
    served = {}
    for name in ("a", "b"):
        served[name] = (workdir / f"{mode}-{name}.log").read_text(errors="replace").count("Replied ")
    return {
        "mode": mode,
        "sessions": 2 * SESSIONS,
        "turns": TURNS,
        "shared_system_prompt": hit_rates([r for r in records if r["session"] < SESSIONS]),
        "own_system_prompt": hit_rates([r for r in records if r["session"] >= SESSIONS]),
        "replies_per_worker": served,
        "vllm_prefix_cache_hit_rate_total": {
            topic.split("/")[2]: s.get("prefixCacheHitRateTotal") for topic, s in sorted(stats.items())
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mosquitto", default=shutil.which("mosquitto") or "/usr/sbin/mosquitto")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    from devtools.tinymodel import generate_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model = generate_tiny_model(workdir / "model")
        broker, redis = start_broker(args.mosquitto, workdir), start_redis(None, workdir)
        try:
            results = [run_mode(mode, model, broker.port, redis.port, workdir) for mode in ("owner", "receiver")]
        finally:
            broker.stop()
            redis.stop()
            for log in workdir.glob("*.log"):
                shutil.copy(log, args.out / log.name)
    (args.out / "affinity.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
