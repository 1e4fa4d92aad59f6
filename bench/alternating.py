"""The burst_alt phase: the worker over MQTT and raw AsyncLLM side by side on one GPU, each
engine with half of its memory, their bursts taking turns.

The burst phases (bench/burst.py) run every burst of the worker, then every burst of raw
AsyncLLM, minutes apart. On H200 machines the spread between such runs was larger than the
differences they measure: raw AsyncLLM's single request ran at 443 tok/s in one run and at 250
in the next on the same machine, and worker / raw at 320 sessions ranged from 0.42 to 1.30 over
six runs (docs/performance.md, "Admission"). Here both engines are up at once and each burst
size runs on one side right after the other, the order swapped every time (worker then raw,
then raw then worker), ``alternating_repeats`` times: whatever drifts over minutes falls on
both sides alike, and each size gives that many worker / raw ratios of bursts a few seconds
apart. An engine waits without using the GPU or a CPU while the other side's burst runs.

The price: each engine has half of the GPU's memory (``alternating_engine``: gpu_memory_utilization
0.45, and no host-memory KV tier, which both would size from the same host memory), so the
largest burst is what half the KV cache holds (1,000 sessions of 428 tokens on an H200, not
2,000).
"""

from __future__ import annotations

import asyncio
import json
import statistics
from pathlib import Path
from typing import Any

from .burst import (
    KV_TOKENS,
    RAW_SIDES,
    burst_settings,
    burst_summary,
    fitting_sessions,
    model_burst_workload,
    raw_burst,
    raw_output_kinds,
    render_burst,
    start_burst_worker,
    worker_burst,
    worker_outcome,
)
from .profiles import Profile

REPEAT_SEED_STEP = 100_003  # another burst's messages for each repeat (seeded() adds the size)
PAUSE_S = 1.5  # between bursts: the stats message covering a burst's end, the engines idle


def turns_order(
    sizes: list[int], repeats: int, sides: tuple[str, ...] = ("worker", "raw")
) -> list[tuple[int, int, tuple[str, ...]]]:
    """(repeat, sessions, the sides in the order they run): every size in every repeat on every
    side, the order rotated from one burst group to the next (each side goes first, second...
    as often as the others over len(sides) groups)."""
    order: list[tuple[int, int, tuple[str, ...]]] = []
    for repeat in range(repeats):
        for count in sizes:
            shift = len(order) % len(sides)
            order.append((repeat, count, sides[shift:] + sides[:shift]))
    return order


def burst_seed(count: int, repeat: int) -> int:
    """The seed of a burst's messages (seeded()), the same on both sides: a repeat never finds
    the one before it in the prefix cache; 0 is the warm-up's."""
    return count + repeat * REPEAT_SEED_STEP


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [run[key] for run in runs if run.get(key) is not None]
    return round(statistics.median(values), 1) if values else None


# Where the worker's TTFT goes (burst.legs): outside the worker's total (MQTT both ways and the
# session's commit before the reply is published), its queue, its own TTFT from receipt.
WORKER_LEGS = ("transit_p50_ms", "transit_max_ms", "queue_p50_ms", "worker_ttft_p50_ms", "worker_ttft_p95_ms")


def summarize_pairs(runs: dict[str, dict[int, list[dict[str, Any]]]]) -> dict[int, dict[str, Any]]:
    """Per size: each repeat's worker / raw tok/s, their median, and the medians of every
    side's TTFT p50 and p95 (with a ``raw_final`` side too: worker / raw_final the same way)."""
    summary: dict[int, dict[str, Any]] = {}
    raw_sides = [side for side in ("raw", "raw_final") if side in runs]
    for count, worker_runs in runs["worker"].items():
        row: dict[str, Any] = {}
        for side in raw_sides:
            ratios = [
                round(w["tok_per_s"] / r["tok_per_s"], 3)
                for w, r in zip(worker_runs, runs[side].get(count, []), strict=False)
                if w.get("tok_per_s") and r.get("tok_per_s")
            ]
            row[f"worker_over_{side}"] = ratios
            row[f"median_worker_over_{side}"] = round(statistics.median(ratios), 3) if ratios else None
        for side in ("worker", *raw_sides):
            for key in ("tok_per_s", "ttft_p50_ms", "ttft_p95_ms"):
                row[f"{side}_{key}_median"] = _median(runs[side].get(count, []), key)
        for key in WORKER_LEGS:
            row[f"worker_{key}_median"] = _median(worker_runs, key)
        summary[count] = row
    return summary


def alternating_phase(profile: Profile, model: Path, out: Path, mosquitto: str) -> dict[str, Any]:
    from worker.config.models import EngineConfig
    from worker.engine.tokenizer import ChatTokenizer

    from .mqtt_driver import MqttDriver
    from .runs import STOP_TIMEOUT

    settings = burst_settings(profile, {**profile.burst_limits["new"], **profile.alternating_engine})
    tokenizer = ChatTokenizer(str(model))
    workload = model_burst_workload(profile, tokenizer)
    broker, worker, text = start_burst_worker(model, out, mosquitto, settings, "worker-burst-alt.log")
    kv = KV_TOKENS.search(text)
    kv_tokens = int(kv.group(1)) if kv else None
    sizes, skipped = fitting_sessions(
        profile.alternating_sessions, kv_tokens, profile.burst_prompt_tokens + profile.burst_max_tokens
    )
    driver = MqttDriver("127.0.0.1", broker.port)
    result: dict[str, Any] = {
        "engine_settings": settings,
        "kv_cache_tokens_worker": kv_tokens,
        "sessions_run": sizes,
        "sessions_skipped_kv_cache_too_small": skipped,
        "repeats": profile.alternating_repeats,
        "raw_output": list(raw_output_kinds()),
    }
    try:
        config = EngineConfig(model=str(model), **settings)
        result.update(asyncio.run(_alternate(profile, config, tokenizer, workload, driver, sizes)))
    finally:
        driver.close()
        worker.stop(STOP_TIMEOUT)
        broker.stop()
    result["summary"] = summarize_pairs(result["runs"])
    return result


async def _alternate(
    profile: Profile, config: Any, tokenizer: Any, workload: Any, driver: Any, sizes: list[int]
) -> dict[str, Any]:
    """Raw AsyncLLM started beside the worker, then the bursts in turns (one event loop: the
    engine's output handler lives on the loop of its first request)."""
    from .inprocess import InProcess

    def worker(seed: int, sessions: int) -> dict[str, Any]:
        records, wall = worker_burst(driver, tokenizer, workload, f"burst-alt-{seed}", seed, sessions)
        return burst_summary([worker_outcome(r) for r in records], wall)

    async def raw(seed: int, sessions: int, side: str) -> dict[str, Any]:
        # Both raw sides run the same prompts on one engine: the second must not find the
        # first's in the prefix cache (the first run with two raw sides did: TTFT p50 and p95
        # alike at 177 ms, its whole burst's prompts cached).
        await engine.llm.reset_prefix_cache()
        outcomes, wall = await raw_burst(
            engine.llm,
            render_burst(tokenizer, workload, seed, sessions),
            profile.burst_max_tokens,
            final=side == RAW_SIDES["final"],
        )
        return burst_summary(outcomes, wall)

    engine = InProcess(config, tokenizer)
    scheduler = engine.llm.vllm_config.scheduler_config
    raw_sides = tuple(RAW_SIDES[kind] for kind in raw_output_kinds())
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {side: {} for side in ("worker", *raw_sides)}
    try:
        first = sizes[0] if sizes else 1
        await asyncio.to_thread(worker, 0, first)  # warm-ups, not counted
        for side in raw_sides:
            await raw(0, first, side)
        for repeat, count, sides in turns_order(sizes, profile.alternating_repeats, ("worker", *raw_sides)):
            seed = burst_seed(count, repeat)
            for side in sides:
                await asyncio.sleep(PAUSE_S)
                if side == "worker":
                    run = await asyncio.to_thread(worker, seed, count)
                else:
                    run = await raw(seed, count, side)
                runs[side].setdefault(count, []).append({**run, "repeat": repeat, "first": side == sides[0]})
                keys = ("tok_per_s", "ttft_p50_ms", "ttft_p95_ms", "admission_s", "transit_p50_ms", "queue_p50_ms")
                line = ", ".join(f"{k}={run[k]}" for k in keys if k in run)
                print(f"burst alt {count} repeat {repeat} {side}: {line}", flush=True)
    finally:
        engine.shutdown()
    return {
        "raw_engine_start_s": engine.start_s,
        "raw_limits": [int(scheduler.max_num_seqs), int(scheduler.max_num_batched_tokens)],
        "runs": runs,
    }


RAW_WORDS = {
    "raw": "raw AsyncLLM reading every token as it comes (DELTA)",
    "raw_final": "raw AsyncLLM reading each reply at its end (FINAL_ONLY)",
}


def alternating_markdown(result: dict[str, Any]) -> str:
    rows = sorted(result["summary"].items(), key=lambda item: int(item[0]))
    sides = [side for side in RAW_WORDS if any(f"worker_over_{side}" in row for _, row in rows)]
    lines = [
        "# Bursts, the worker and raw AsyncLLM side by side on one GPU, taking turns",
        "",
        f"Half of the GPU's memory each; {result['repeats']} repeats, the side that goes first "
        "rotating. Each repeat's worker / raw tok/s, and the medians.",
    ]
    for side in sides:
        lines += [
            "",
            f"Against {RAW_WORDS[side]}:",
            "",
            "| sessions | worker / raw, each repeat | median | tok/s worker / raw "
            "| TTFT p50 worker / raw | TTFT p95 worker / raw |",
            "|---|---|---|---|---|---|",
        ]
        for count, row in rows:
            lines.append(
                f"| {count} | {', '.join(str(r) for r in row[f'worker_over_{side}'])} "
                f"| {row[f'median_worker_over_{side}']} | "
                f"{row['worker_tok_per_s_median']} / {row[f'{side}_tok_per_s_median']} | "
                f"{row['worker_ttft_p50_ms_median']} / {row[f'{side}_ttft_p50_ms_median']} ms | "
                f"{row['worker_ttft_p95_ms_median']} / {row[f'{side}_ttft_p95_ms_median']} ms |"
            )
    if any(row.get("worker_transit_p50_ms_median") is not None for _, row in rows):
        lines += [
            "",
            "The worker's replies, medians over the repeats: the time outside the worker's total (the client's "
            "time less the worker's totalMs: the request's way to it and the reply's back over MQTT, and the wait "
            "for the session's commit before the reply is published), the worker's queue "
            "(received to handed to the engine), and its TTFT from receipt:",
            "",
            "| sessions | outside the worker p50 / most | queue p50 | TTFT from receipt p50 / p95 |",
            "|---|---|---|---|",
        ]
        for count, row in rows:
            lines.append(
                f"| {count} | {row['worker_transit_p50_ms_median']} / {row['worker_transit_max_ms_median']} ms "
                f"| {row['worker_queue_p50_ms_median']} ms "
                f"| {row['worker_worker_ttft_p50_ms_median']} / {row['worker_worker_ttft_p95_ms_median']} ms |"
            )
    if result.get("sessions_skipped_kv_cache_too_small"):
        lines += [
            "",
            f"Not run (half the KV cache does not hold them): {result['sessions_skipped_kv_cache_too_small']}",
        ]
    return "\n".join(lines) + "\n"


def write_alternating_report(out: Path) -> None:
    path = out / "burst_alt.json"
    if path.exists():
        (out / "burst_alt.md").write_text(alternating_markdown(json.loads(path.read_text())))
