"""Several GPUs on one host, against one worker on one GPU, same geometry, same runs.

    python -m bench.multigpu --profile gpu --geometry qwen2.5-7b --out OUT --phases single,dp
    python -m bench.multigpu --profile gpu --geometry qwq-32b --out OUT --phases single,tp
    python -m bench.multigpu --profile gpu --geometry qwen3-1.7b --gpus 0,1,2,3 --out OUT \
        --phases burst_single,burst_dp --redis-server PATH --worker-args "--store redis ..."
    python -m bench.multigpu --profile smoke --out /tmp/multi     # CPU: two workers, tiny model

Phases (each writes OUT/<phase>.json and is skipped when that file exists, like the bench):
  single  one worker, --visible-devices of the profile's first GPU
  dp      data parallel: one worker per GPU of the profile (or of --gpus), each with its own
          --visible-devices, worker id and compile cache, all in one --share-group: the broker
          hands each request to one of them
  tp      tensor parallel: one worker with --tensor-parallel-size over the profile's GPUs
  burst_single, burst_dp
          the workers of single and dp, each burst of the profile's multi_burst_sessions N:
          N sessions send a one-turn request at the same moment (bench/burst.py's workload:
          burst_prompt_tokens with the chat markup, burst_max_tokens, replies not streamed),
          and once every reply is in, a second turn of a short message at the same moment (the
          worker adds the history from its store). --clients K splits each burst's sessions
          over K client processes that start each round together (bench/clients.py): one
          Python client can itself limit 1,000 sessions on several GPUs
single, dp and tp run the worker phase's concurrency runs (sessions that send their next turn
when the previous reply arrives) at the profile's multi_concurrency. OUT/multi.json and
OUT/multi.md compare aggregate tokens/s and p50/p95 latency with the single worker; the burst
phases per N and turn: tokens/s, TTFT, latency, and whether the second turn found the first in
the prefix cache.

The workers of a share group must see each session's whole history whichever of them serves a
turn: give them a shared store with --worker-args (``{redis_port}`` is replaced by the port of
the redis-server that --redis-server starts). Each run counts the later turns whose prompt was
shorter than the turn before's prompt and reply (served without their history; a lower
bound): 0 with one worker.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import os
import re
import shlex
import shutil
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from devtools.worker_process import WorkerProcess

from .burst import ENGINE_LINE, KV_TOKENS, burst_summary, seeded, worker_outcome
from .clients import ClientPool, ClientResult, client_cpu, merge
from .common import REPO, Record, Workload, load, phase_list, run_metadata, save
from .harness import prepare_model, stamped
from .profiles import PROFILES, Profile
from .runs import STOP_TIMEOUT, start_broker, start_redis, start_worker, timed, wait_ready

CONCURRENCY_PHASES = ("single", "dp", "tp")
BURST_PHASES = ("burst_single", "burst_dp")
PHASES = CONCURRENCY_PHASES + BURST_PHASES
SHARE_GROUP = "bench"
BLOCK_SIZE = re.compile(r"Engine: .*\bblock_size=(\d+)")
DEFAULT_BLOCK_SIZE = 16  # vLLM's on a GPU, where a worker's log does not say


def worker_commands(
    phase: str, profile: Profile, common: list[str], state: Path
) -> list[tuple[str, list[str], dict[str, str]]]:
    """(worker id, flags, environment) of each worker a phase starts. Each has its own store
    (state_dir) as each instance of the systemd template has: what the workers of a group
    share is only what --worker-args makes them share. A burst phase starts the workers of the
    phase it is named after."""
    setup = phase.removeprefix("burst_")
    if setup == "single":
        args = ["--visible-devices", profile.gpus[0], "--state-dir", str(state / phase)]
        return [("bench", [*common, *args], {})]
    if phase == "tp":
        devices = ",".join(profile.gpus[: max(profile.tensor_parallel_size, 1)])
        size = str(profile.tensor_parallel_size)
        args = ["--visible-devices", devices, "--tensor-parallel-size", size, "--state-dir", str(state / "tp")]
        return [("bench", [*common, *args], {})]
    if setup == "dp":
        # Each its own compile cache too: two engines compiling the same graphs at once never
        # write the same files.
        root = os.environ["VLLM_CACHE_ROOT"]
        return [
            (
                f"bench-gpu{gpu}",
                [
                    *common,
                    *["--visible-devices", gpu, "--share-group", SHARE_GROUP],
                    *["--state-dir", str(state / f"{phase}-gpu{gpu}")],
                ],
                {"VLLM_CACHE_ROOT": f"{root}/dp-gpu{gpu}"},
            )
            for gpu in profile.gpus
        ]
    raise ValueError(f"unknown phase {phase!r}, expected one of {', '.join(PHASES)}")


def turns_without_history(records: list[Record]) -> int:
    """Later turns whose prompt is shorter than the turn before's prompt and reply: served by a
    worker that did not have the session's latest history. A lower bound: a turn served with
    an older history that is still longer than the turn before's (after a turn that lacked
    its own) is not recognised."""
    by_session: dict[int, list[Record]] = defaultdict(list)
    for record in records:
        by_session[record.session].append(record)
    lost = 0
    for turns in by_session.values():
        turns.sort(key=lambda r: r.turn)
        for before, after in itertools.pairwise(turns):
            lost += after.prompt_tokens < before.prompt_tokens + before.completion_tokens
    return lost


STATS_INTERVAL_S = 1
STATS_WAIT_S = 1.5  # a stats message from each worker after what was measured


def start_workers(
    phase: str,
    profile: Profile,
    model: Path,
    out: Path,
    port: int,
    extra: list[str],
    workers: dict[str, WorkerProcess],
    info: dict[str, Any],
) -> None:
    """The phase's workers, online, into ``workers`` as each starts (a caller's ``finally``
    stops those that did when a later one fails); their flags and start times into ``info``."""
    common = ["--model", str(model), "--stats-interval", str(STATS_INTERVAL_S), *profile.worker_args, *extra]
    for worker_id, args, env in worker_commands(phase, profile, common, out / "state"):
        log = out / f"worker-{phase}-{worker_id}.log"
        workers[worker_id] = start_worker(args, port, log, worker_id=worker_id, env=env, wait=False)
        info[worker_id] = {"args": args[len(common) :] + extra}
    for worker_id, worker in workers.items():
        wait_ready(worker)  # they load at the same time, each on its GPU
        info[worker_id]["start_to_ready_s"] = worker.start_to_ready_s


def processed_by_worker(stats: list[dict[str, Any]]) -> dict[str, int]:
    """Each worker's requests served so far, from its latest stats message."""
    latest = {s["workerId"]: s for s in stats if "workerId" in s}
    return {worker: int(s["processed"]) for worker, s in latest.items() if s.get("processed") is not None}


def record_processed(result: dict[str, Any], stats: list[dict[str, Any]]) -> None:
    """Each worker's requests processed, from its latest stats message, into the phase's result."""
    latest = processed_by_worker(stats)
    for worker_id, info in result["workers"].items():
        info["processed"] = latest.get(worker_id)


def stop_all(driver: Any, workers: dict[str, WorkerProcess], broker: Any) -> None:
    """A phase's benchmark client (None before it connected), workers and broker, on every path."""
    if driver is not None:
        driver.close()
    for worker in workers.values():
        worker.stop(STOP_TIMEOUT)
    broker.stop()


def run_phase(phase: str, profile: Profile, model: Path, out: Path, mosquitto: str, extra: list[str]) -> dict[str, Any]:
    from worker.engine.tokenizer import ChatTokenizer

    from .common import make_workload
    from .mqtt_driver import MqttDriver

    tokenizer = ChatTokenizer(str(model))
    workload = make_workload(tokenizer.count_text, max_tokens=profile.max_tokens)
    broker = start_broker(mosquitto, out)
    workers: dict[str, WorkerProcess] = {}
    result: dict[str, Any] = {"phase": phase, "workers": {}}
    driver: MqttDriver | None = None
    try:
        start_workers(phase, profile, model, out, broker.port, extra, workers, result["workers"])
        driver = active = MqttDriver("127.0.0.1", broker.port)
        total = sum(c * profile.turns for c in profile.multi_concurrency)
        runs: dict[int, Any] = {}
        with tqdm(total=total, desc=phase, unit="req") as bar:
            warm = max(profile.multi_concurrency)
            # Two turns, as in the worker phase: a second turn's shapes compile kernels on first
            # use (at df75700 one GPU's first 50 second turns decoded 3x slower, at C = 100).
            active.run_concurrent("warmup", workload, tokenizer.count_text, sessions=warm, turns=2)
            for count in profile.multi_concurrency:
                client_cpu = time.process_time()
                run = timed(
                    lambda count=count: active.run_concurrent(
                        f"multi-{phase}",
                        workload,
                        tokenizer.count_text,
                        sessions=count,
                        turns=profile.turns,
                        progress=bar.update,
                    )
                )
                run["summary"]["turns_without_history"] = turns_without_history(run["records"])
                # This process receives every session's stream: near 1.0 it limits the run.
                used = (time.process_time() - client_cpu) / run["summary"]["wall_s"]
                run["summary"]["client_cpu_cores"] = round(used, 2)
                runs[count] = run
        time.sleep(STATS_WAIT_S)  # one more stats message from each worker
        record_processed(result, active.stats)
        result["concurrency"] = runs
    finally:
        stop_all(driver, workers, broker)
    return result


RECORD_FIELDS = (
    "session",
    "turn",
    "client_ms",
    "worker_queue_ms",
    "worker_ttft_ms",
    "worker_total_ms",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
)


def block_size_of(log_text: str) -> int:
    """The KV block size from a worker's "Engine:" line (DEFAULT_BLOCK_SIZE where it has none)."""
    match = BLOCK_SIZE.search(log_text)
    return int(match.group(1)) if match else DEFAULT_BLOCK_SIZE


def second_turn_cache(records: list[Record], block_size: int) -> dict[str, Any]:
    """How much of each session's second prompt the engine found in its prefix cache: the mean
    of cachedTokens / promptTokens, and the share of sessions whose second turn found at least
    the first turn's prompt up to its last whole KV block (the part the prefix cache can hold:
    vLLM caches whole blocks). A second turn served without its history, or after the first
    turn's blocks were evicted or computed on another GPU, falls short of it."""
    first = {r.session: r for r in records if r.turn == 0}
    second = [r for r in records if r.turn == 1]
    shares = [r.cached_tokens / r.prompt_tokens for r in second if r.prompt_tokens]
    found = [
        r
        for r in second
        if r.session in first and r.cached_tokens >= first[r.session].prompt_tokens // block_size * block_size
    ]
    return {
        "sessions": len(second),
        "block_size": block_size,
        "cached_over_prompt_mean": round(sum(shares) / len(shares), 3) if shares else None,
        "first_turn_found": round(len(found) / len(second), 3) if second else None,
    }


def burst_turns_summary(records: list[Record], walls: list[float], block_size: int) -> dict[str, Any]:
    """One two-turn burst: each turn's tokens/s, TTFT, latency and wall (bench/burst.py's
    burst_summary over its replies and ``walls``: each turn's time from its first request sent
    to its last reply), both turns' tokens over both walls, the second turn's prefix-cache hit
    and the turns served without their history."""
    summary: dict[str, Any] = {}
    for turn, wall in enumerate(walls):
        outcomes = [worker_outcome(r) for r in records if r.turn == turn]
        summary[f"turn{turn + 1}"] = burst_summary(outcomes, wall)
    tokens, wall = sum(r.completion_tokens for r in records), sum(walls)
    summary["both"] = {
        "tok_per_s": round(tokens / wall, 1) if wall > 0 else None,
        "completion_tokens": tokens,
        "wall_s": round(wall, 2),
    }
    summary["cache"] = second_turn_cache(records, block_size)
    summary["turns_without_history"] = turns_without_history(records)
    return summary


def _burst_line(summary: dict[str, Any]) -> str:
    parts = [
        f"turn {turn}: {s['tok_per_s']} tok/s, TTFT p50 {s['ttft_p50_ms']} ms, wall {s['wall_s']} s"
        for turn, s in ((1, summary["turn1"]), (2, summary["turn2"]))
    ]
    cache = summary["cache"]
    return "; ".join(
        [
            *parts,
            f"both {summary['both']['tok_per_s']} tok/s",
            f"turn 2 cached/prompt {cache['cached_over_prompt_mean']}, first turn found {cache['first_turn_found']}",
            f"without history {summary['turns_without_history']}",
            _clients_text(summary),
        ]
    )


def _clients_text(summary: dict[str, Any]) -> str:
    """The clients' CPU: all of them together, and the busiest (near 1.0 it limits the burst)."""
    clients = summary.get("clients", 1)
    total = summary.get("client_cpu_cores")
    busiest = summary.get("client_cpu_cores_max", total)
    return f"{clients} client{'s' if clients != 1 else ''}: CPU {total} cores, busiest client {busiest}"


BurstRun = Callable[[str, int], list[ClientResult]]


def burst_runs(
    phase: str, driver: Any, pool: ClientPool | None, tokenizer: Any, workload: Workload, followup: Workload, bar: Any
) -> BurstRun:
    """A two-turn burst of a label and a number of sessions: in this process through ``driver``
    (one client), or split over ``pool``'s clients."""

    def burst(label: str, sessions: int) -> list[ClientResult]:
        # Other messages for each N (the warm-up's: seed 0): no burst finds its prompts in the
        # prefix cache from an earlier one.
        seed = sessions if label != "warm" else 0
        name, opening, then = f"burst-{phase}-{label}", seeded(workload, seed), seeded(followup, seed)
        if pool is not None:
            results = pool.run_rounds(name, opening, then, sessions)
            bar.update(sum(len(result.records) for result in results))
            return results
        cpu = time.process_time()
        records = driver.run_rounds(name, opening, tokenizer.count_text, sessions=sessions, turns=2, stream=False,
                                    followup=then, progress=bar.update)  # fmt: skip
        return [ClientResult(records, list(driver.round_spans), time.process_time() - cpu)]

    return burst


def summarise_burst(results: list[ClientResult], block_size: int) -> tuple[dict[str, Any], list[Record]]:
    """One burst's summary over every client's replies (burst_turns_summary over the merged
    walls) with the clients' CPU, and the replies."""
    records, walls, cores = merge(results)
    summary = burst_turns_summary(records, walls, block_size)
    summary.update(client_cpu(cores))
    return summary, records


def run_burst_phase(
    phase: str, profile: Profile, model: Path, out: Path, mosquitto: str, extra: list[str], clients: int = 1
) -> dict[str, Any]:
    """burst_single or burst_dp: the workers of single or dp; a warm-up burst of
    multi_burst_warmup sessions (two turns, not recorded), then for each N of
    multi_burst_sessions a two-turn burst (see the module's doc), sent by ``clients``
    benchmark clients (bench/clients.py; one: this process)."""
    from worker.engine.tokenizer import ChatTokenizer

    from .burst import model_burst_workload
    from .mqtt_driver import MqttDriver

    tokenizer = ChatTokenizer(str(model))
    workload = model_burst_workload(profile, tokenizer)
    short = profile.multi_burst_followup_tokens
    followup = dataclasses.replace(workload, user_tokens=(short, short))
    broker = start_broker(mosquitto, out)
    workers: dict[str, WorkerProcess] = {}
    result: dict[str, Any] = {
        "phase": phase,
        "workers": {},
        "prompt_tokens": profile.burst_prompt_tokens,
        "max_tokens": profile.burst_max_tokens,
        "followup_tokens": short,
        "clients": clients,
    }
    driver: MqttDriver | None = None
    pool: ClientPool | None = None
    try:
        start_workers(phase, profile, model, out, broker.port, extra, workers, result["workers"])
        block_size = read_engine_facts(next(iter(workers.values())), result)
        # This process keeps the workers' stats; with several clients they receive the replies.
        driver = MqttDriver("127.0.0.1", broker.port, replies=clients == 1)
        pool = ClientPool(clients, broker.port, model) if clients > 1 else None
        total = 2 * (profile.multi_burst_warmup + sum(profile.multi_burst_sessions))
        with tqdm(total=total, desc=phase, unit="req") as bar:
            burst = burst_runs(phase, driver, pool, tokenizer, workload, followup, bar)
            result["bursts"] = run_bursts(phase, profile, burst, driver, list(workers), block_size)
        record_processed(result, driver.stats)
    finally:
        if pool is not None:
            pool.close()
        stop_all(driver, workers, broker)
    return result


def read_engine_facts(worker: WorkerProcess, result: dict[str, Any]) -> int:
    """The first worker's "Engine:" line and KV cache size into ``result``; its block size."""
    log = worker.log_path.read_bytes()[worker.log_offset :].decode(errors="replace")
    engine, kv = ENGINE_LINE.search(log), KV_TOKENS.search(log)
    result["engine_log"] = engine.group(1) if engine else None
    # Per worker: at 1,000 sessions one GPU's cache may not hold every first turn until its
    # second comes (the hit falls short there), N GPUs' caches do.
    result["kv_cache_tokens"] = int(kv.group(1)) if kv else None
    block_size = result["block_size"] = block_size_of(log)
    return block_size


def run_bursts(
    phase: str, profile: Profile, burst: BurstRun, driver: Any, workers: list[str], block_size: int
) -> dict[int, Any]:
    """The warm-up burst, then one two-turn burst per N of multi_burst_sessions: each N's
    summary with its records and the requests each worker served (``driver``'s stats)."""
    if profile.multi_burst_warmup:
        # Two turns, as the runs: a second turn's shapes (prefix-cache hits) compile too.
        warm, _ = summarise_burst(burst("warm", profile.multi_burst_warmup), block_size)
        tqdm.write(f"{phase} warm-up ({profile.multi_burst_warmup} sessions): {_burst_line(warm)}")
        time.sleep(STATS_WAIT_S)
    bursts: dict[int, Any] = {}
    for count in profile.multi_burst_sessions:
        before = processed_by_worker(driver.stats)
        summary, records = summarise_burst(burst("run", count), block_size)
        time.sleep(STATS_WAIT_S)  # the stats messages covering the burst's end
        after = processed_by_worker(driver.stats)
        summary["processed"] = {w: after.get(w, 0) - before.get(w, 0) for w in workers}
        summary["record_fields"] = RECORD_FIELDS
        summary["records"] = [[getattr(r, f) for f in RECORD_FIELDS] for r in records]
        bursts[count] = summary
        tqdm.write(f"{phase} {count} sessions: {_burst_line(summary)}")
    return bursts


def compare(out: Path) -> dict[str, Any]:
    """Each phase's runs beside the single worker's at the same concurrency; the burst phases'
    beside each other at the same number of sessions."""
    phases = {p: load(out / f"{p}.json") for p in CONCURRENCY_PHASES if (out / f"{p}.json").exists()}
    single = phases.get("single", {}).get("concurrency", {})
    table: dict[str, Any] = {}
    for phase, data in phases.items():
        rows = {}
        for count, run in data["concurrency"].items():
            summary = dict(run["summary"])
            base = single.get(count, {}).get("summary")
            if base and phase != "single":
                summary["tokens_per_s_vs_single"] = _ratio(summary["tokens_per_s"], base["tokens_per_s"])
                summary["p50_vs_single"] = _ratio(summary["p50_ms"], base["p50_ms"])
                summary["p95_vs_single"] = _ratio(summary["p95_ms"], base["p95_ms"])
            rows[count] = summary
        table[phase] = {"workers": data["workers"], "commit": data.get("commit"), "runs": rows}
    meta = load(out / "meta.json") if (out / "meta.json").exists() else {}
    bursts = {p: load(out / f"{p}.json") for p in BURST_PHASES if (out / f"{p}.json").exists()}
    return {"meta": meta, "phases": table, "bursts": burst_comparison(bursts)}


BURST_PARTS = ("turn1", "turn2", "both")


def burst_comparison(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The burst phases' results (``burst_single``, ``burst_dp``) per number of sessions, side by
    side, without their records, and burst_dp's tokens/s over burst_single's per turn and for
    both turns."""
    sessions: dict[str, dict[str, Any]] = {}
    for phase, result in results.items():
        for count, summary in result.get("bursts", {}).items():
            row = {k: v for k, v in summary.items() if k not in ("records", "record_fields")}
            sessions.setdefault(str(count), {})[phase] = row
    for row in sessions.values():
        single, dp = row.get("burst_single"), row.get("burst_dp")
        if single and dp:
            row["dp_over_single"] = {
                part: _ratio(dp[part]["tok_per_s"], single[part]["tok_per_s"]) for part in BURST_PARTS
            }
    return {
        "phases": {
            phase: {
                "workers": result.get("workers", {}),
                "engine_log": result.get("engine_log"),
                "block_size": result.get("block_size"),
                "kv_cache_tokens": result.get("kv_cache_tokens"),
                "prompt_tokens": result.get("prompt_tokens"),
                "max_tokens": result.get("max_tokens"),
                "followup_tokens": result.get("followup_tokens"),
                "clients": result.get("clients", 1),
                "commit": result.get("commit"),
            }
            for phase, result in results.items()
        },
        "sessions": dict(sorted(sessions.items(), key=lambda item: int(item[0]))),
    }


def _ratio(value: float | None, base: float | None) -> float | None:
    return round(value / base, 2) if value and base else None


def _workers_line(workers: dict[str, Any]) -> str:
    return ", ".join(
        f"{wid} ({' '.join(info['args'])}; ready in {info.get('start_to_ready_s')} s; "
        f"{info.get('processed')} requests served)"
        for wid, info in workers.items()
    )


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    lines = [
        "# Several GPUs on one host",
        "",
        f"{meta.get('gpu', '?')}; vLLM {meta.get('vllm', '?')}; model {Path(meta.get('model', '?')).name}; "
        f"commit {meta.get('git_commit', '?')}.",
        "",
    ]
    if result["phases"]:
        lines += [
            "Concurrency runs: sessions that send their next turn when the previous reply arrives; "
            "tokens/s over each run's wall time; latency per request (client: publish to reply). Ratios "
            "against the single worker at the same concurrency. Client CPU: cores the benchmark's one "
            "client process used (it receives every stream delta); near 1.0 the client, not the workers, "
            "limits the run.",
            "",
        ]
    for phase, data in result["phases"].items():
        lines += [f"## {phase}", "", f"Workers: {_workers_line(data['workers'])}.", ""]
        lines += [
            "| sessions | requests | tokens/s | p50 ms | p95 ms | tokens/s vs single | p50 vs single | "
            "p95 vs single | turns without history | client CPU |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for count, s in data["runs"].items():
            cells = [
                count,
                s["requests"],
                s["tokens_per_s"],
                s["p50_ms"],
                s["p95_ms"],
                s.get("tokens_per_s_vs_single", ""),
                s.get("p50_vs_single", ""),
                s.get("p95_vs_single", ""),
                s.get("turns_without_history", ""),
                s.get("client_cpu_cores", ""),
            ]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        lines.append("")
    bursts = result.get("bursts") or {}
    if bursts.get("sessions"):
        lines += burst_markdown(bursts)
    return "\n".join(lines)


def _pair(a: Any, b: Any) -> str:
    return f"{a} / {b}"


def _burst_rows(summary: dict[str, Any]) -> list[tuple[str, Any]]:
    """(label, cell) of one phase's burst: the rows of the table per number of sessions."""
    t1, t2, cache = summary["turn1"], summary["turn2"], summary["cache"]
    processed = summary.get("processed") or {}
    return [
        ("tokens/s, turn 1", f"{t1['tok_per_s']:,.0f}" if t1["tok_per_s"] else None),
        ("tokens/s, turn 2", f"{t2['tok_per_s']:,.0f}" if t2["tok_per_s"] else None),
        ("tokens/s, both turns", f"{summary['both']['tok_per_s']:,.0f}" if summary["both"]["tok_per_s"] else None),
        ("TTFT p50 / p95, turn 1 (ms)", _pair(t1["ttft_p50_ms"], t1["ttft_p95_ms"])),
        ("TTFT p50 / p95, turn 2 (ms)", _pair(t2["ttft_p50_ms"], t2["ttft_p95_ms"])),
        ("latency p50 / p95, turn 1 (ms)", _pair(t1["latency_p50_ms"], t1["latency_p95_ms"])),
        ("latency p50 / p95, turn 2 (ms)", _pair(t2["latency_p50_ms"], t2["latency_p95_ms"])),
        ("wall, turn 1 / turn 2 (s)", _pair(t1["wall_s"], t2["wall_s"])),
        ("turn 2: cached / prompt tokens (mean)", cache["cached_over_prompt_mean"]),
        ("turn 2: sessions that found turn 1 in the prefix cache", cache["first_turn_found"]),
        ("turns without history", summary["turns_without_history"]),
        ("requests per worker", ", ".join(str(n) for n in processed.values()) or None),
        ("benchmark clients", summary.get("clients", 1)),
        ("client CPU, all clients (cores)", summary.get("client_cpu_cores")),
        # Results from before several clients: one client, whose CPU is the busiest's.
        ("client CPU, busiest client (cores)", summary.get("client_cpu_cores_max", summary.get("client_cpu_cores"))),
    ]


def burst_markdown(bursts: dict[str, Any]) -> list[str]:
    """One table per number of sessions: burst_single and burst_dp side by side, with dp's
    tokens/s over single's."""
    phases = bursts["phases"]
    any_phase = next(iter(phases.values()))
    lines = [
        "## Bursts: one worker against one worker per GPU",
        "",
        f"N sessions each send a first turn of {any_phase.get('prompt_tokens')} prompt tokens (chat markup "
        f"included; at most {any_phase.get('max_tokens')} reply tokens) at the same moment; once every reply "
        f"is in, each sends a second turn of a {any_phase.get('followup_tokens')}-token message at the same "
        "moment (the worker adds the history from its store). Replies are not streamed. tokens/s: generated "
        "tokens over the turn's wall (its first request sent to its last reply); both turns: both turns' "
        "tokens over both walls. TTFT: the client's time to the reply less the worker's time from the first "
        "token on. Turn 2's prefix-cache hit: the mean of cachedTokens / promptTokens, and the share of "
        "sessions whose cachedTokens cover the first turn's prompt up to its last whole KV block. Turns "
        "without history: second turns whose prompt is shorter than the first turn's prompt and reply. "
        "Benchmark clients: the processes that sent the sessions, split among them (each round starts in "
        "all of them together, its wall from the first send in any to the last reply in any); client CPU: "
        "the cores they used over both walls, all together and the busiest one, which near 1.0 is what "
        "limits the burst.",
        "",
    ]
    for phase, info in phases.items():
        lines += [
            f"- `{phase}` (KV cache {info.get('kv_cache_tokens')} tokens per worker, blocks of "
            f"{info.get('block_size')}): {_workers_line(info['workers'])}.",
            f"  - Engine: {info.get('engine_log')}",
        ]
    lines.append("")
    names = list(phases)
    for count, row in bursts["sessions"].items():
        ratios = row.get("dp_over_single", {})
        lines += [
            f"### {count} sessions",
            "",
            "| | " + " | ".join(names) + " | burst_dp / burst_single |",
            "|---|" + "---:|" * (len(names) + 1),
        ]
        cells = {name: dict(_burst_rows(row[name])) for name in names if name in row}
        labels = [label for label, _ in _burst_rows(next(iter(row[n] for n in names if n in row)))]
        ratio_of = dict(zip(labels[:3], (ratios.get(part) for part in BURST_PARTS), strict=True))
        for label in labels:
            values = [cells.get(name, {}).get(label) for name in names]
            ratio = ratio_of.get(label)
            row_cells = [label, *("" if v is None else str(v) for v in values), f"{ratio}x" if ratio else ""]
            lines.append("| " + " | ".join(row_cells) + " |")
        lines.append("")
    return lines


def write_report(out: Path) -> dict[str, Any]:
    result = compare(out)
    save(out / "multi.json", result)
    (out / "multi.md").write_text(markdown(result))
    print((out / "multi.md").read_text())
    return result


def gpu_list(text: str) -> tuple[str, ...]:
    """An argparse type for ``--gpus``: comma separated GPU ids (CUDA_VISIBLE_DEVICES style)."""
    gpus = tuple(g.strip() for g in text.split(",") if g.strip())
    if not gpus or len(set(gpus)) != len(gpus):
        raise argparse.ArgumentTypeError(f"expected distinct GPU ids separated by commas, e.g. 0,1,2,3; got {text!r}")
    return gpus


def positive_int(text: str) -> int:
    """An argparse type for ``--clients``: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def with_gpus(profile: Profile, gpus: tuple[str, ...] | None) -> Profile:
    """The profile on these GPUs: dp starts a worker on each, and tp (where the profile splits
    the model at all: not the CPU profiles, whose tensor-parallel size is 1) spans them all."""
    if not gpus:
        return profile
    size = len(gpus) if profile.tensor_parallel_size > 1 else profile.tensor_parallel_size
    return dataclasses.replace(profile, gpus=gpus, tensor_parallel_size=size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.multigpu", description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="smoke")
    parser.add_argument("--model", type=Path, help="model directory (default: generated per profile)")
    parser.add_argument("--geometry", help="generate a real geometry (dummy weights), e.g. qwen2.5-7b")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--phases", type=phase_list(PHASES), default="single,dp", help=f"comma separated, of {', '.join(PHASES)}"
    )
    parser.add_argument("--mosquitto", default=shutil.which("mosquitto") or "/usr/sbin/mosquitto")
    parser.add_argument("--worker-args", default="", help="more worker flags for every phase, e.g. a shared store")
    parser.add_argument("--redis-server", help="start this redis-server per phase; {redis_port} in --worker-args")
    parser.add_argument(
        "--gpus",
        type=gpu_list,
        help="comma separated GPU ids for the phases (dp: one worker each; tp: over all of them; single: the "
        "first), instead of the profile's, e.g. 0,1,2,3",
    )
    parser.add_argument(
        "--clients",
        type=positive_int,
        default=1,
        help="benchmark client processes that share each burst's sessions (burst phases; default 1: this "
        "process). One Python client may itself limit a burst at 1,000 sessions on several GPUs",
    )
    parser.add_argument("--report", action="store_true", help="only rewrite multi.json and multi.md")
    args = parser.parse_args(argv)
    out: Path = args.out
    if args.report:
        write_report(out)
        return 0
    profile = with_gpus(PROFILES[args.profile], args.gpus)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VLLM_CACHE_ROOT", str(REPO / ".cache" / "vllm"))
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    model = args.model or prepare_model(args.geometry, out)
    if not (out / "meta.json").exists():
        meta = run_metadata(model, profile.engine_overrides)
        save(
            out / "meta.json",
            {**meta, "profile": args.profile, "worker_args": profile.worker_args, "gpus": list(profile.gpus)},
        )
    for phase in args.phases:
        path = out / f"{phase}.json"
        if path.exists():
            print(f"{phase}: done before ({path})")
            continue
        redis = start_redis(args.redis_server, out) if args.redis_server else None
        extra = shlex.split(args.worker_args.replace("{redis_port}", str(redis.port) if redis else "{redis_port}"))
        started = time.perf_counter()
        run = functools.partial(run_burst_phase, clients=args.clients) if phase in BURST_PHASES else run_phase
        try:
            save(path, stamped(run(phase, profile, model, out, args.mosquitto, extra)))
        finally:
            if redis is not None:
                redis.stop()
        print(f"{phase}: {time.perf_counter() - started:.0f} s", flush=True)
    write_report(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
