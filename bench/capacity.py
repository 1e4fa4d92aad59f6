"""The capacity phases: more sessions than the GPU's KV cache holds, users who come back.

``capacity`` runs one worker without the host-memory KV tier (``--kv-offload-gib 0``),
``capacity_offload`` one with it (the profile's ``capacity_offload_gib``). Each worker first
answers bursts of ten first turns sharing a long system prompt (the first right after it is
online, on whatever compile caches the machine has, then the same again: the first burst's
cost over the later one's), then runs N sessions at 1x, 3x and 10x what its KV cache holds.

Each session has the long system prompt and a history that grows by one exchange a turn.
Users think between turns for a pause drawn per session and turn (common.think_time, as
``--think-time`` draws it), first turns included, with a mean that grows with N (N divided by
the profile's ``capacity_rate``): the arrival rate stays about the same at every N, so what
changes with N is how much other traffic passes through the KV cache while a user thinks,
not how many arrive at once. Reported for the returning turns (turn 2 and later): the share
of the reusable prefix (the previous turn's prompt and reply) found cached, the share of the
prompt found cached, TTFT p50/p95, turn latency p50/p95 and tokens/s, and from the worker's
stats messages where the prompt tokens' KV came from (GPU prefix cache, host tier, computed).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import time
from pathlib import Path
from typing import Any

from devtools.mosquitto import Mosquitto
from devtools.worker_process import WorkerProcess

from .common import Record, make_workload, percentile
from .profiles import Profile

KV_TOKENS = re.compile(r"Engine: .*KV cache (\d+) tokens")
WARMUP_DONE = re.compile(r"Warm-up done in (\d+\.\d) s: (\d+) of (\d+) steps, (\d+) requests")
TIER = re.compile(r"KV offloading to host memory: (.*)$", re.M)
BURST_SESSIONS = 10
JIT_WARNING = "Triton kernel JIT compilation during inference"


def _cache_dirs() -> dict[str, bool]:
    """Whether each compile cache the engine uses was empty (a cold start) when the phase began."""
    dirs = {
        "vllm": os.environ.get("VLLM_CACHE_ROOT", str(Path.home() / ".cache" / "vllm")),
        "triton": os.environ.get("TRITON_CACHE_DIR", str(Path.home() / ".triton" / "cache")),
        "inductor": os.environ.get("TORCHINDUCTOR_CACHE_DIR", f"/tmp/torchinductor_{os.environ.get('USER', 'root')}"),
    }
    return {name: not any(Path(path).glob("*")) for name, path in dirs.items()}


def sessions_held(kv_tokens: int, system_tokens: int, per_session_tokens: int) -> int:
    """Sessions whose whole prompt fits the KV cache at once: the shared system prompt once,
    each session's own history beside it."""
    return max(1, (kv_tokens - system_tokens) // max(1, per_session_tokens))


def returning_summary(records: list[Record], wall_s: float) -> dict[str, Any]:
    """The returning turns of one run: prefix reuse, TTFT, latency, tokens/s."""
    by_session: dict[int, list[Record]] = {}
    for record in records:
        by_session.setdefault(record.session, []).append(record)
    reuse: list[float] = []
    for turns in by_session.values():
        turns.sort(key=lambda r: r.turn)
        for previous, current in itertools.pairwise(turns):
            reusable = previous.prompt_tokens + previous.completion_tokens
            reuse.append(min(1.0, current.cached_tokens / reusable) if reusable else 0.0)
    back = [r for r in records if r.turn > 0]
    ttfts = [r.client_ttft_ms for r in back if r.client_ttft_ms is not None]
    latencies = [r.client_ms for r in back]
    prompt = sum(r.prompt_tokens for r in back)
    decode = [
        (r.completion_tokens - 1) / ((r.worker_total_ms - r.worker_ttft_ms) / 1000)
        for r in back
        if r.worker_total_ms and r.worker_ttft_ms is not None and r.worker_total_ms > r.worker_ttft_ms
    ]
    return {
        "returning_turns": len(back),
        "prefix_reuse": round(sum(reuse) / len(reuse), 3) if reuse else None,
        "prefix_reuse_p10": round(percentile(reuse, 10), 3) if reuse else None,
        "prompt_share_cached": round(sum(r.cached_tokens for r in back) / prompt, 3) if prompt else None,
        "recomputed_tokens_per_turn": round(sum(r.prompt_tokens - r.cached_tokens for r in back) / len(back), 1)
        if back
        else None,
        "ttft_p50_ms": round(percentile(ttfts, 50), 1) if ttfts else None,
        "ttft_p95_ms": round(percentile(ttfts, 95), 1) if ttfts else None,
        "latency_p50_ms": round(percentile(latencies, 50), 1) if latencies else None,
        "latency_p95_ms": round(percentile(latencies, 95), 1) if latencies else None,
        "decode_tok_per_s_p50": round(percentile(decode, 50), 1) if decode else None,
        "returning_tokens_per_s": round(sum(r.completion_tokens for r in back) / wall_s, 1) if wall_s > 0 else None,
        "wall_s": round(wall_s, 1),
    }


def _stats_sources(stats: list[dict[str, Any]]) -> dict[str, int]:
    """Prompt tokens by where their KV came from, summed over the worker's stats messages."""
    keys = {"gpu_hit": "gpuHitTokens", "host_hit": "hostHitTokens", "computed": "computedPromptTokens"}
    return {name: int(sum(s.get(key, 0) for s in stats)) for name, key in keys.items()}


def _start(model: Path, out: Path, mosquitto: str, name: str, flags: list[str], tier_gib: float | None) -> Started:
    """A broker and a worker with these flags and the host tier at ``tier_gib`` (0: off; None:
    the worker's default, sized from the host's memory at start), and what its start logged."""
    from .runs import start_broker, start_worker

    caches_empty = _cache_dirs()
    tier = [] if tier_gib is None else ["--kv-offload-gib", str(tier_gib)]
    args = ["--model", str(model), *flags, *tier]
    broker = start_broker(mosquitto, out)
    log = out / f"worker-{name}.log"
    offset = log.stat().st_size if log.exists() else 0
    worker = start_worker(args, broker.port, log)
    text = log.read_text(errors="replace")[offset:]
    kv = KV_TOKENS.search(text)
    warm = WARMUP_DONE.search(text)
    tier_line = TIER.search(text)
    result: dict[str, Any] = {
        "offload_gib": tier_gib,
        "engine_args": flags,
        "tier_log": tier_line.group(1) if tier_line else None,
        "caches_empty_at_start": caches_empty,
        "start_to_ready_s": worker.start_to_ready_s,
        "warmup_s": float(warm.group(1)) if warm else None,
        "warmup_steps": int(warm.group(2)) if warm else None,
        "warmup_requests": int(warm.group(4)) if warm else None,
        "kv_cache_tokens": int(kv.group(1)) if kv else None,
    }
    return Started(broker, worker, log, offset, result)


def _capacity_flags(profile: Profile) -> list[str]:
    return ["--stats-interval", "2", *profile.capacity_worker_args]


def _tier(profile: Profile, offload: bool) -> float | None:
    return profile.capacity_offload_gib if offload else 0


@dataclasses.dataclass
class Started:
    broker: Mosquitto
    worker: WorkerProcess
    log: Path
    offset: int  # where this start's lines begin in the log
    result: dict[str, Any]

    def stop(self) -> None:
        from .runs import STOP_TIMEOUT

        self.worker.stop(STOP_TIMEOUT)
        self.broker.stop()


def capacity_phase(profile: Profile, model: Path, out: Path, mosquitto: str, *, offload: bool) -> dict[str, Any]:
    from worker.engine.tokenizer import ChatTokenizer

    from .mqtt_driver import MqttDriver

    name = "capacity_offload" if offload else "capacity"
    tokenizer = ChatTokenizer(str(model))
    started_worker = _start(model, out, mosquitto, name, _capacity_flags(profile), _tier(profile, offload))
    log, offset, result = started_worker.log, started_worker.offset, started_worker.result
    driver = MqttDriver("127.0.0.1", started_worker.broker.port)
    try:
        # The first bursts after online: new sessions, a long shared system prompt.
        burst_workload = make_workload(
            tokenizer.count_text, system_tokens=profile.burst_system_tokens, max_tokens=profile.max_tokens
        )
        bursts = []
        for index in range(3 if profile.capacity_bursts else 0):
            # New messages each burst (another seed; the system prompt is the same text): a
            # later burst must compute as much as the first, or it measures its prefix cache.
            workload_now = dataclasses.replace(burst_workload, seed=burst_workload.seed + index)
            started = time.perf_counter()
            records = driver.run_concurrent(
                f"burst{index}", workload_now, tokenizer.count_text, sessions=BURST_SESSIONS, turns=1
            )
            wall = time.perf_counter() - started
            ttfts = [r.client_ttft_ms for r in records if r.client_ttft_ms is not None]
            bursts.append(
                {
                    "wall_s": round(wall, 3),
                    "prompt_tokens": sum(r.prompt_tokens for r in records),
                    "cached_tokens": sum(r.cached_tokens for r in records),
                    "ttft_p50_ms": round(percentile(ttfts, 50), 1) if ttfts else None,
                    "ttft_max_ms": round(max(ttfts), 1) if ttfts else None,
                    "records": records,
                }
            )
            time.sleep(profile.capacity_burst_pause_s)
        result["bursts"] = bursts
        if bursts:
            result["first_burst_over_later"] = round(bursts[0]["wall_s"] / min(b["wall_s"] for b in bursts[1:]), 3)
        # Sessions that outnumber the KV cache.
        workload = make_workload(
            tokenizer.count_text,
            system_tokens=profile.capacity_system_tokens,
            user_tokens=profile.capacity_user_tokens,
            max_tokens=profile.capacity_max_tokens,
            seed=7,
        )
        system_tokens = tokenizer.count_text(workload.system_prompt)
        turns = profile.capacity_turns
        per_session = turns * (sum(profile.capacity_user_tokens) // 2 + 10 + profile.capacity_max_tokens)
        held = sessions_held(
            result["kv_cache_tokens"] or profile.capacity_kv_tokens_fallback, system_tokens, per_session
        )
        result.update({"system_tokens": system_tokens, "per_session_tokens": per_session, "sessions_held": held})
        # 1x: the profile's fixed N where it sets one (runs of other starts and KV dtypes compare
        # at the same N), else what this start's KV cache holds.
        one_x = profile.capacity_sessions_1x or held
        result["sessions_1x"] = one_x
        runs: dict[str, Any] = {}
        for multiple in profile.capacity_multiples:
            sessions = min(multiple * one_x, profile.capacity_max_sessions)
            think_s = sessions / profile.capacity_rate
            before = len(driver.stats)
            started = time.perf_counter()
            records = driver.run_concurrent(
                f"capacity{multiple}",
                workload,
                tokenizer.count_text,
                sessions=sessions,
                turns=turns,
                think_s=think_s,
                stagger_first=True,
            )
            wall = time.perf_counter() - started
            time.sleep(2.5)  # the stats message covering the run's last turns
            runs[f"{multiple}x"] = {
                "multiple": multiple,
                "sessions": sessions,
                "think_mean_s": round(think_s, 2),
                **returning_summary(records, wall),
                "engine_prompt_tokens": _stats_sources(driver.stats[before:]),
                "records": records,
            }
            print(f"{name} {multiple}x ({sessions} sessions): {_line(runs[f'{multiple}x'])}", flush=True)
        result["runs"] = runs
        decode = driver.run_concurrent(
            "decode", burst_workload, tokenizer.count_text, sessions=1, turns=1, max_tokens=profile.decode_tokens
        )[0]
        from .runs import decode_rate

        result["decode_batch1_tok_per_s"] = decode_rate(decode)
    finally:
        driver.close()
        started_worker.stop()
    # vLLM warns of each kernel it compiles while serving: before online (the warm-up) or after.
    text = log.read_text(errors="replace")[offset:]
    before, _, after = text.partition("worker.server: Serving ")
    result["jit_compilations"] = {
        "before_online": before.count(JIT_WARNING),
        "after_online": after.count(JIT_WARNING),
        "kernels_after_online": sorted(set(re.findall(JIT_WARNING + r": (\w+)", after))),
    }
    return result


def returning_phase(profile: Profile, model: Path, out: Path, mosquitto: str, *, offload: bool) -> dict[str, Any]:
    """Sessions that all return at the same moment: ``returning_sessions`` users sharing a long
    system prompt send a first turn at once and, when every one is answered, a second at once
    (``returning`` without the host tier, ``returning_offload`` with the profile's). Reported:
    the second round's prefix reuse against a run of as many sessions as the GPU's KV cache holds
    with both rounds (all resident, the same worker just before), TTFT and the round's time."""
    from worker.engine.tokenizer import ChatTokenizer

    from .mqtt_driver import MqttDriver

    name = "returning_offload" if offload else "returning"
    tokenizer = ChatTokenizer(str(model))
    started_worker = _start(model, out, mosquitto, name, _capacity_flags(profile), _tier(profile, offload))
    result = started_worker.result
    workload = make_workload(
        tokenizer.count_text,
        system_tokens=profile.returning_system_tokens,
        user_tokens=profile.returning_user_tokens,
        max_tokens=profile.returning_max_tokens,
        seed=11,
    )
    system_tokens = tokenizer.count_text(workload.system_prompt)
    # A session's own tokens in its second prompt: two messages (and their chat markup), a reply.
    own = 2 * (sum(profile.returning_user_tokens) // 2 + 10) + profile.returning_max_tokens
    kv_tokens = result["kv_cache_tokens"] or profile.capacity_kv_tokens_fallback
    resident = min(sessions_held(kv_tokens, system_tokens, own), profile.returning_sessions)
    result.update({"system_tokens": system_tokens, "own_tokens_round2": own, "resident_sessions": resident})
    driver = MqttDriver("127.0.0.1", started_worker.broker.port)
    try:
        runs: dict[str, Any] = {}
        # The all-resident reference first, with other messages (another seed; the same system
        # prompt): the later run's sessions find none of their own text cached from it.
        for label, sessions, seed in (("resident", resident, 12), ("all", profile.returning_sessions, 11)):
            before = len(driver.stats)
            started = time.perf_counter()
            records = driver.run_rounds(
                label, dataclasses.replace(workload, seed=seed), tokenizer.count_text, sessions=sessions, turns=2
            )
            wall = time.perf_counter() - started
            time.sleep(2.5)  # the stats message covering the last replies
            second = [r for r in records if r.turn == 1]
            round2_prompt = sum(r.prompt_tokens for r in second)
            runs[label] = {
                "sessions": sessions,
                **returning_summary(records, wall),
                "round2_prompt_tokens": round2_prompt,
                "round2_over_kv_cache": round(round2_prompt / kv_tokens, 2),
                "round2_wall_s": round(max(r.client_ms for r in second) / 1000, 2) if second else None,
                "engine_prompt_tokens": _stats_sources(driver.stats[before:]),
                "records": records,
            }
            print(f"{name} {label} ({sessions} sessions): {_line(runs[label])}", flush=True)
        result["runs"] = runs
        reference = runs["resident"]["prefix_reuse"]
        reuse = runs["all"]["prefix_reuse"]
        result["share_of_resident"] = round(reuse / reference, 3) if reference and reuse is not None else None
    finally:
        driver.close()
        started_worker.stop()
    return result


def fp8_phase(profile: Profile, model: Path, out: Path, mosquitto: str) -> dict[str, Any]:
    """FP8 weights and KV cache: the engine's KV-cache size and batch-1 decode (the worker's
    defaults otherwise: the whole GPU, no host tier). Dummy weights: speed and memory only."""
    from worker.engine.tokenizer import ChatTokenizer

    from .mqtt_driver import MqttDriver
    from .runs import decode_rate

    tokenizer = ChatTokenizer(str(model))
    started_worker = _start(model, out, mosquitto, "fp8", profile.fp8_worker_args, 0)
    driver = MqttDriver("127.0.0.1", started_worker.broker.port)
    workload = make_workload(tokenizer.count_text, max_tokens=profile.max_tokens)
    try:
        driver.run_concurrent("warm", workload, tokenizer.count_text, sessions=1, turns=1)
        decode = driver.run_concurrent(
            "decode", workload, tokenizer.count_text, sessions=1, turns=1, max_tokens=profile.decode_tokens
        )[0]
    finally:
        driver.close()
        started_worker.stop()
    return {
        "args": profile.fp8_worker_args,
        "start_to_ready_s": started_worker.result["start_to_ready_s"],
        "kv_cache_tokens": started_worker.result["kv_cache_tokens"],
        "decode_batch1_tok_per_s": decode_rate(decode),
        "record": decode,
    }


def _line(run: dict[str, Any]) -> str:
    keys = ("prefix_reuse", "prompt_share_cached", "ttft_p50_ms", "ttft_p95_ms", "latency_p50_ms", "wall_s")
    return ", ".join(f"{k}={run.get(k)}" for k in keys) + f", engine={run.get('engine_prompt_tokens')}"


def sources_cell(src: dict[str, int]) -> str:
    """Where the prompt tokens' KV came from, as a table cell."""
    return f"{src['gpu_hit']} / {src['host_hit']} / {src['computed']}"


def capacity_markdown(results: dict[str, dict[str, Any]]) -> str:
    """A table per phase: the bursts, then each multiple's returning turns."""
    lines: list[str] = []
    for name, result in results.items():
        if name == "fp8":
            lines += [
                "## fp8",
                "",
                f"args {' '.join(result['args'])}: KV cache {result['kv_cache_tokens']} tokens, batch-1 decode "
                f"{result['decode_batch1_tok_per_s']} tok/s, start to ready {result['start_to_ready_s']} s",
                "",
            ]
            continue
        if name.startswith("returning"):
            lines += _returning_markdown(name, result)
            continue
        bursts = ", ".join(f"{b['wall_s']:.2f} s (TTFT p50 {b['ttft_p50_ms']} ms)" for b in result["bursts"])
        lines += [
            f"## {name}",
            "",
            f"host tier {result['tier_log']}; KV cache {result['kv_cache_tokens']} tokens, holds "
            f"{result['sessions_held']} sessions of ~{result['per_session_tokens']} tokens beside a "
            f"{result['system_tokens']}-token system prompt; caches empty at start: {result['caches_empty_at_start']}; "
            f"start to ready {result['start_to_ready_s']} s, warm-up {result['warmup_s']} s; "
            f"1x = {result.get('sessions_1x', result['sessions_held'])} sessions",
            "",
            f"bursts of {BURST_SESSIONS} first turns: {bursts or 'not run'}; first over later: "
            f"{result.get('first_burst_over_later')}; kernels compiled while serving: {result.get('jit_compilations')}",
            "",
            "| N | sessions | think mean | reuse of prefix | prompt cached | recomputed/turn | TTFT p50 | TTFT p95 | "
            "latency p50 | latency p95 | tok/s returning | GPU hit / host hit / computed tokens |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for key, run in result["runs"].items():
            lines.append(
                f"| {key} | {run['sessions']} | {run['think_mean_s']} s | {run['prefix_reuse']} | "
                f"{run['prompt_share_cached']} | {run['recomputed_tokens_per_turn']} | {run['ttft_p50_ms']} ms | "
                f"{run['ttft_p95_ms']} ms | {run['latency_p50_ms']} ms | {run['latency_p95_ms']} ms | "
                f"{run['returning_tokens_per_s']} | {sources_cell(run['engine_prompt_tokens'])} |"
            )
        lines += ["", f"batch-1 decode {result.get('decode_batch1_tok_per_s')} tok/s", ""]
    return "\n".join(lines)


def _returning_markdown(name: str, result: dict[str, Any]) -> list[str]:
    lines = [
        f"## {name}",
        "",
        f"host tier {result['tier_log']}; KV cache {result['kv_cache_tokens']} tokens; "
        f"{result['system_tokens']}-token system prompt, ~{result['own_tokens_round2']} tokens of a session's own "
        f"in its second prompt; caches empty at start: {result['caches_empty_at_start']}; "
        f"start to ready {result['start_to_ready_s']} s, warm-up {result['warmup_s']} s",
        "",
        f"second-round reuse over the all-resident run's: **{result['share_of_resident']}**",
        "",
        "| run | sessions | round 2 prompt tokens | of the KV cache | reuse of prefix | prompt cached | "
        "TTFT p50 | TTFT p95 | round 2 | GPU hit / host hit / computed tokens |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, run in result["runs"].items():
        lines.append(
            f"| {key} | {run['sessions']} | {run['round2_prompt_tokens']} | {run['round2_over_kv_cache']}x | "
            f"{run['prefix_reuse']} | {run['prompt_share_cached']} | {run['ttft_p50_ms']} ms | "
            f"{run['ttft_p95_ms']} ms | {run['round2_wall_s']} s | {sources_cell(run['engine_prompt_tokens'])} |"
        )
    return [*lines, ""]
