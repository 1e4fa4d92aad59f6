"""The burst phases: one-turn sessions, every one at the same moment, through the worker over
MQTT and through vLLM's AsyncLLM in this process, with the same engine settings, in one run.

``burst_<name>`` for each entry of the profile's ``burst_limits`` (``old``: the limits the
worker had before issue 31, max_num_seqs 128 and max_num_batched_tokens 2048; ``new``: what the
worker chooses now from the GPU and the model). Each phase starts one worker, sends a warm-up
burst and then a burst of N sessions for each N of ``burst_sessions`` whose prompts and replies
the KV cache holds at once (from the worker's "Engine:" line), each session one request of
``burst_prompt_tokens`` prompt tokens (chat markup included) and ``burst_max_tokens`` reply
tokens; then stops it and runs the same bursts on an AsyncLLM of the same engine arguments
(``ignore_eos``: each raw reply is exactly burst_max_tokens; the worker's replies end at the
model's end token, which dummy weights draw about once in 150k tokens: the tables count the
tokens each side generated).

Reported per N and side: tokens/s (all generated tokens over the time from the first request
sent to the last reply; each request's times are kept as ``outcomes``: TTFT, total, tokens,
prompt tokens, admitted, in seconds from the burst's start), TTFT p50/p95 (the worker's: its
replies are not streamed, as the one benchmark client receiving every stream delta of 1,000
sessions was what limited the first runs; the client's time to the reply less the worker's
time from the first token on; with BENCH_STREAM_EVERY=N every Nth session streams, and the
TTFT is measured on those, the first delta's arrival, see burst_summary),
latency p50/p95, and admission: the time until the last request reached the engine (raw: its
``add_request`` returned; the worker: its reply's ``queueMs`` after the client's send,
measured as the client's time to the reply less the worker's time from handing it to the
engine to publishing the reply), and from the worker's stats messages the most requests
running and waiting in vLLM.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .common import Record, Workload, history_messages, make_workload, percentile
from .profiles import Profile, engine_flags

LIMITS_LINE = re.compile(r"Engine limits: (.*)$", re.M)
ENGINE_LINE = re.compile(r"Engine: (.*)$", re.M)
KV_TOKENS = re.compile(r"Engine: .*KV cache (\d+) tokens")


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One request of a burst, either side: times from the burst's start (s)."""

    ttft_s: float | None
    total_s: float
    completion_tokens: int
    prompt_tokens: int
    admitted_s: float | None = None  # reached the engine
    # The worker's side only, from its reply's latency fields: the time outside the worker's
    # total (the client's time less it: the request's way to it and the reply's back, and the
    # wait for the session's commit before the reply is published), the worker's queue
    # (received -> handed to the engine) and its own TTFT (from receipt). Where a worker's TTFT
    # goes that raw AsyncLLM's has no part of.
    transit_s: float | None = None
    queue_s: float | None = None
    worker_ttft_s: float | None = None
    # The worker's side: the reply was streamed (BENCH_STREAM_EVERY), so ttft_s is the first
    # delta's arrival, measured, not derived from the reply at its end.
    streamed: bool = False
    # Both sides, by vLLM's own clock (its request stats): the time in its scheduler's queue
    # (queued -> first scheduled) and the prefill (-> first token). The worker's from its reply.
    engine_queue_s: float | None = None
    prefill_s: float | None = None


def burst_summary(outcomes: list[Outcome], wall_s: float) -> dict[str, Any]:
    """tokens/s, TTFT and latency percentiles, admission of one burst. Where some of the
    worker's replies were streamed (BENCH_STREAM_EVERY), its TTFT percentiles are theirs, the
    first delta's arrival as a streaming client sees it (and as vLLM's serving benchmark
    measures TTFT); the others' TTFT derived from the reply at its end go to ``ttft_end_*``:
    it has the burst's end in it (the session's commit, 320 replies written at once), which
    comes after a first token."""
    streamed = [o.ttft_s * 1000 for o in outcomes if o.streamed and o.ttft_s is not None]
    at_end = [o.ttft_s * 1000 for o in outcomes if not o.streamed and o.ttft_s is not None]
    ttfts = streamed or at_end
    totals = [o.total_s * 1000 for o in outcomes]
    admitted = [o.admitted_s for o in outcomes if o.admitted_s is not None]
    tokens = sum(o.completion_tokens for o in outcomes)

    def ms(values: list[float], q: float) -> float | None:
        return round(percentile(values, q), 1) if values else None

    return {
        "sessions": len(outcomes),
        "tok_per_s": round(tokens / wall_s, 1) if wall_s > 0 else None,
        "completion_tokens": tokens,
        "prompt_tokens_mean": round(sum(o.prompt_tokens for o in outcomes) / len(outcomes), 1) if outcomes else None,
        "ttft_p50_ms": ms(ttfts, 50),
        "ttft_p95_ms": ms(ttfts, 95),
        "latency_p50_ms": ms(totals, 50),
        "latency_p95_ms": ms(totals, 95),
        "admission_s": round(max(admitted), 3) if admitted else None,
        "wall_s": round(wall_s, 2),
        **legs(outcomes, ms),
        **(
            {"streamed": len(streamed), "ttft_end_p50_ms": ms(at_end, 50), "ttft_end_p95_ms": ms(at_end, 95)}
            if streamed
            else {}
        ),
    }


def legs(outcomes: list[Outcome], ms: Callable[[list[float], float], float | None]) -> dict[str, Any]:
    """The legs of the requests' time (Outcome), p50 and p95 (and the transit's most): the
    worker's (transit, queue, its own TTFT) and, on both sides where vLLM kept request stats,
    vLLM's scheduler queue and prefill."""
    out: dict[str, Any] = {}
    for name in ("transit", "queue", "worker_ttft", "engine_queue", "prefill"):
        values = [v * 1000 for o in outcomes if (v := getattr(o, f"{name}_s")) is not None]
        if values:
            out[f"{name}_p50_ms"], out[f"{name}_p95_ms"] = ms(values, 50), ms(values, 95)
            if name == "transit":
                out["transit_max_ms"] = round(max(values), 1)
    return out


def worker_outcome(record: Record) -> Outcome:
    """A worker reply as an Outcome: the client's times, and when it reached the engine (the
    client's time to the reply less what the worker spent from handing it to the engine on,
    which leaves the hop there and the worker's queue; every request of a burst is sent within
    a few ms of the first)."""
    admitted = ttft = None
    if record.worker_total_ms is not None and record.worker_queue_ms is not None:
        admitted = max(0.0, record.client_ms - (record.worker_total_ms - record.worker_queue_ms)) / 1000
    if record.client_ttft_ms is not None:
        ttft = record.client_ttft_ms / 1000
    elif record.worker_total_ms is not None and record.worker_ttft_ms is not None:
        # Without stream deltas: the client's time to the reply less the worker's from the
        # first token on (the hops there and back stay in, as in a streamed TTFT).
        ttft = max(0.0, record.client_ms - (record.worker_total_ms - record.worker_ttft_ms)) / 1000
    total, queue, worker_ttft = record.worker_total_ms, record.worker_queue_ms, record.worker_ttft_ms
    return Outcome(
        ttft_s=ttft,
        total_s=record.client_ms / 1000,
        completion_tokens=record.completion_tokens,
        prompt_tokens=record.prompt_tokens,
        admitted_s=admitted,
        transit_s=max(0.0, record.client_ms - total) / 1000 if total is not None else None,
        queue_s=queue / 1000 if queue is not None else None,
        worker_ttft_s=worker_ttft / 1000 if worker_ttft is not None else None,
        streamed=record.client_ttft_ms is not None,
        engine_queue_s=record.engine_queue_ms / 1000 if record.engine_queue_ms is not None else None,
        prefill_s=record.prefill_ms / 1000 if record.prefill_ms is not None else None,
    )


def fitting_sessions(sessions: tuple[int, ...], kv_tokens: int | None, per_session: int) -> tuple[list[int], list[int]]:
    """(the burst sizes whose sessions the KV cache holds at once, the ones it does not)."""
    if not kv_tokens:
        return list(sessions), []
    held = kv_tokens // max(per_session, 1)
    return [n for n in sessions if n <= held], [n for n in sessions if n > held]


def burst_workload(profile: Profile, count_tokens: Any, render_length: Any) -> Workload:
    """Distinct one-turn prompts of about burst_prompt_tokens with the chat markup: a system
    prompt shorter than a KV block (no prefix shared between sessions), the rest the message."""
    base = make_workload(count_tokens, system_tokens=1, user_tokens=(10, 10), max_tokens=profile.burst_max_tokens)
    overhead = render_length(base, 0) - count_tokens(base.user_message(0, 0, count_tokens))
    user = max(1, profile.burst_prompt_tokens - overhead)
    return dataclasses.replace(base, user_tokens=(user, user), seed=31)


def model_burst_workload(profile: Profile, tokenizer: Any) -> Workload:
    """burst_workload measured with the model's tokenizer and chat template (a ChatTokenizer)."""

    def render_length(workload: Workload, index: int) -> int:
        message = workload.user_message(index, 0, tokenizer.count_text)
        return len(tokenizer.render(history_messages(workload, [], message), add_generation_prompt=True))

    return burst_workload(profile, tokenizer.count_text, render_length)


def seeded(workload: Workload, count: int) -> Workload:
    """Other messages for each burst (the warm-up's: 0): a burst must compute its prompts, not
    find them in the prefix cache from the one before."""
    return dataclasses.replace(workload, seed=workload.seed + 1 + count)


def burst_texts(tokenizer: Any, workload: Workload, seed: int, sessions: int) -> list[str]:
    """The prompts of a burst (seeded(workload, seed)) as the model's chat template's text,
    rendered as the worker renders them."""
    burst = seeded(workload, seed)
    messages = (burst.user_message(i, 0, tokenizer.count_text) for i in range(sessions))
    return [tokenizer.render_text(history_messages(workload, [], m), add_generation_prompt=True) for m in messages]


def render_burst(tokenizer: Any, workload: Workload, seed: int, sessions: int) -> list[list[int]]:
    """The prompts of a burst as raw AsyncLLM gets them: token ids, encoded before the burst."""
    return [tokenizer.encode(text) for text in burst_texts(tokenizer, workload, seed, sessions)]


# BENCH_RAW_TEXT: raw AsyncLLM's bursts again with other messages of the same sizes (this seed
# plus the size: no prompt of them is in a cache, on the GPU or in host memory).
TEXT_SEED = 500_009


def raw_text_bursts() -> bool:
    """BENCH_RAW_TEXT=1: after its bursts of token ids, raw AsyncLLM runs each size again given
    the chat template's text, which vLLM tokenizes in ``add_request`` (as it does for a client
    that hands it text, ``vllm serve`` among them), the side ``raw_text``. Raw's token ids are
    encoded before its bursts, so they leave out the tokenizing that the worker does in its
    intake; this side shows what that part costs raw."""
    text = (os.environ.get("BENCH_RAW_TEXT") or "0").strip()
    if text not in ("0", "1"):
        raise SystemExit(f"BENCH_RAW_TEXT: 1 (raw runs each burst again given text) or 0, not {text!r}")
    return text == "1"


def start_burst_worker(
    model: Path, out: Path, mosquitto: str, settings: dict[str, Any], log_name: str
) -> tuple[Any, Any, str]:
    """A broker and the worker on it with these engine settings, once online; and the
    worker's log since its start (its engine and limits lines)."""
    from .runs import start_broker, start_worker

    broker = start_broker(mosquitto, out)
    log = out / log_name
    offset = log.stat().st_size if log.exists() else 0
    worker = start_worker(["--model", str(model), "--stats-interval", "1", *engine_flags(settings)], broker.port, log)
    return broker, worker, log.read_text(errors="replace")[offset:]


def worker_burst(
    driver: Any, tokenizer: Any, workload: Workload, label: str, seed: int, sessions: int
) -> tuple[list[Record], float]:
    """One burst of one-turn sessions through the worker (seeded(workload, seed)): the
    records and the burst's wall time, from the first request sent to the last reply
    (run_concurrent renders every message before it sends the first, seconds for 1,000,
    which is no part of it)."""
    records: list[Record] = driver.run_concurrent(
        label,
        seeded(workload, seed),
        tokenizer.count_text,
        sessions=sessions,
        turns=1,
        stream=False,
        stream_every=stream_every(),
    )
    return records, driver.last_send_s + max(r.client_ms for r in records) / 1000


def stream_every() -> int:
    """BENCH_STREAM_EVERY=N: every Nth session of the worker's bursts streams its reply, so
    that its TTFT is measured (the first delta's arrival) on a sample, while the rest are read
    at their end as before. 0 or unset: none streams (the first runs were limited by the one
    benchmark client receiving every delta of 1,000 streams; one in eight, as runs Y1 and Y2, is light)."""
    text = os.environ.get("BENCH_STREAM_EVERY") or "0"
    if not text.isdigit():
        raise SystemExit(f"BENCH_STREAM_EVERY: a whole number of sessions (0: none streams), not {text!r}")
    return int(text)


def burst_settings(profile: Profile, overrides: dict[str, Any]) -> dict[str, Any]:
    """The engine settings of a burst phase: the profile's, its burst_engine's, the overrides'
    and BENCH_ENGINE_EXTRA's, the extra engine arguments merged."""
    settings = {**profile.engine_overrides, **profile.burst_engine, **overrides}
    settings["extra"] = {
        **profile.engine_overrides.get("extra", {}),
        **profile.burst_engine.get("extra", {}),
        **overrides.get("extra", {}),
        # BENCH_ENGINE_EXTRA (a JSON object): engine arguments for both sides of every burst,
        # to compare one setting on one machine, e.g. '{"stream_interval": 8}'.
        **json.loads(os.environ.get("BENCH_ENGINE_EXTRA") or "{}"),
    }
    return settings


def burst_phase(profile: Profile, model: Path, out: Path, mosquitto: str, name: str) -> dict[str, Any]:
    from worker.config.models import EngineConfig
    from worker.engine.tokenizer import ChatTokenizer

    from .harness import profile_worker
    from .mqtt_driver import MqttDriver
    from .runs import STOP_TIMEOUT

    settings = burst_settings(profile, profile.burst_limits[name])
    tokenizer = ChatTokenizer(str(model))
    workload = model_burst_workload(profile, tokenizer)
    per_session = profile.burst_prompt_tokens + profile.burst_max_tokens
    result: dict[str, Any] = {
        "limits": profile.burst_limits[name],
        "engine_settings": settings,
        "raw_output": raw_output_kinds()[0],
    }
    # The worker over MQTT.
    broker, worker, text = start_burst_worker(model, out, mosquitto, settings, f"worker-burst-{name}.log")
    kv = KV_TOKENS.search(text)
    limits_line, engine_line = LIMITS_LINE.search(text), ENGINE_LINE.search(text)
    kv_tokens = int(kv.group(1)) if kv else None
    wanted = profile.burst_sessions_by_limits.get(name, profile.burst_sessions)
    sizes, skipped = fitting_sessions(wanted, kv_tokens, per_session)
    # The warm-up burst is the first after the start: at burst_first sessions where that is run
    # later too, its tok/s against the later one's shows what the engine's warm-up left out.
    first = profile.burst_first if profile.burst_first in sizes else min(sizes or [1])
    result.update(
        {
            "kv_cache_tokens": kv_tokens,
            "limits_log": limits_line.group(1) if limits_line else None,
            "engine_log": engine_line.group(1) if engine_line else None,
            "start_to_ready_s": worker.start_to_ready_s,
            "sessions_run": sizes,
            "sessions_skipped_kv_cache_too_small": skipped,
        }
    )
    driver = MqttDriver("127.0.0.1", broker.port)
    runs: dict[str, Any] = {"worker": {}, "raw": {}}
    windows: dict[str, dict[int, tuple[float, float]]] = {"worker": {}, "raw": {}}
    try:
        records, wall = worker_burst(driver, tokenizer, workload, "burst-warm", 0, first)
        runs["worker"]["first"] = {**burst_summary([worker_outcome(r) for r in records], wall), "sessions": first}
        print(f"burst {name} worker first burst ({first}): {_line(runs['worker']['first'])}", flush=True)
        time.sleep(1.5)
        for count in sizes:
            before = len(driver.stats)
            # BENCH_PYSPY (bench/harness.py profile_worker): the worker's threads during the
            # largest burst, or the one of BENCH_PYSPY_SESSIONS sessions.
            profiled = count == profiled_size(sizes)
            profiler = profile_worker(worker, out / f"pyspy-burst-{name}-{count}.txt") if profiled else None
            started = time.time()
            load = cpu_snapshot()
            records, wall = worker_burst(driver, tokenizer, workload, f"burst-{name}", count, count)
            load = cpu_usage(load)
            windows["worker"][count] = (started, time.time())
            if profiler is not None:
                profiler.wait(120)
            time.sleep(1.5)  # the stats message covering the burst's end
            stats = driver.stats[before:]
            outcomes = [worker_outcome(r) for r in records]
            runs["worker"][count] = {
                **burst_summary(outcomes, wall),
                "outcomes": [dataclasses.astuple(o) for o in outcomes],
                "send_s": round(driver.last_send_s, 3),
                "max_running": max((s.get("maxRunning", 0) for s in stats), default=None),
                "max_waiting": max((s.get("waiting", 0) for s in stats), default=None),
                "max_pending": max((s.get("pending", 0) for s in stats), default=None),
                **({"cpu": load} if load else {}),
            }
            print(f"burst {name} worker {count}: {_line(runs['worker'][count])}", flush=True)
    finally:
        driver.close()
        worker.stop(STOP_TIMEOUT)
        broker.stop()

    # Raw vLLM in this process, the same engine arguments (the worker's engine_arguments).
    result["runs"] = runs
    first_runs = {"worker": runs["worker"].pop("first")}
    result["first_burst"] = first_runs
    if name in profile.burst_worker_only:
        add_gc_pauses(runs, windows)
        return result
    prompts = {n: render_burst(tokenizer, workload, n, n) for n in sizes}
    prompts[0] = render_burst(tokenizer, workload, 0, first)  # the warm-up burst's
    texts = {n: burst_texts(tokenizer, workload, TEXT_SEED + n, n) for n in sizes} if raw_text_bursts() else None
    config = EngineConfig(model=str(model), **settings)
    raw = asyncio.run(_raw_side(config, tokenizer, prompts, sizes, profile, name, out, texts))
    runs["raw"] = raw.pop("runs")
    if texts is not None:
        runs["raw_text"] = raw.pop("runs_text", {})
    windows["raw"] = raw.pop("windows")
    add_gc_pauses(runs, windows)
    first_runs["raw"] = raw.pop("first")
    result.update(raw)
    for side in ("raw", "raw_text"):
        if side in runs:
            result[f"worker_over_{side}"] = {
                count: round(runs["worker"][count]["tok_per_s"] / runs[side][count]["tok_per_s"], 3)
                for count in sizes
                if runs[side].get(count, {}).get("tok_per_s") and runs["worker"].get(count, {}).get("tok_per_s")
            }
    return result


async def _raw_side(
    config: Any,
    tokenizer: Any,
    prompts: dict[int, list[list[int]]],
    sizes: list[int],
    profile: Profile,
    name: str,
    out: Path,
    texts: dict[int, list[str]] | None = None,
) -> dict[str, Any]:
    """The same bursts on an AsyncLLM of the same engine arguments, in one event loop (the
    engine's output handler lives on the loop of its first request); then, with ``texts``
    (raw_text_bursts), each size again given text, as ``runs_text``."""
    from .harness import profile_process
    from .inprocess import InProcess

    engine = InProcess(config, tokenizer)
    scheduler = engine.llm.vllm_config.scheduler_config
    result: dict[str, Any] = {
        "raw_engine_start_s": engine.start_s,
        "raw_limits": [int(scheduler.max_num_seqs), int(scheduler.max_num_batched_tokens)],
        "runs": {},
        "windows": {},
    }
    final = raw_output_kinds()[0] == "final"
    try:
        outcomes, wall = await raw_burst(engine.llm, prompts[0], profile.burst_max_tokens, final=final)  # warm-up
        result["first"] = burst_summary(outcomes, wall)
        for count in sizes:
            # BENCH_PYSPY: this process (raw AsyncLLM's event loop) during the profiled burst.
            profiler = (
                profile_process(os.getpid(), out / f"pyspy-burst-{name}-raw-{count}.txt")
                if count == profiled_size(sizes)
                else None
            )
            started = time.time()
            load = cpu_snapshot()
            outcomes, wall = await raw_burst(engine.llm, prompts[count], profile.burst_max_tokens, final=final)
            load = cpu_usage(load)
            result["windows"][count] = (started, time.time())
            if profiler is not None:
                await asyncio.to_thread(profiler.wait, 120)
            result["runs"][count] = {
                **burst_summary(outcomes, wall),
                "outcomes": [dataclasses.astuple(o) for o in outcomes],
                **({"cpu": load} if load else {}),
            }
            print(f"burst {name} raw {count}: {_line(result['runs'][count])}", flush=True)
        for count, burst in sorted((texts or {}).items()):
            load = cpu_snapshot()
            outcomes, wall = await raw_burst(engine.llm, burst, profile.burst_max_tokens, final=final)
            load = cpu_usage(load)
            result.setdefault("runs_text", {})[count] = {
                **burst_summary(outcomes, wall),
                "outcomes": [dataclasses.astuple(o) for o in outcomes],
                **({"cpu": load} if load else {}),
            }
            print(f"burst {name} raw_text {count}: {_line(result['runs_text'][count])}", flush=True)
    finally:
        engine.shutdown()
    return result


def cpu_snapshot() -> Any:
    """With BENCH_CPU: the counters of this process and every one under it (the worker, its
    frontend and engine core, the broker; raw's engine core), before a burst (bench/cpuload.py)."""
    from . import cpuload

    return cpuload.snapshot([os.getpid()]) if cpuload.enabled() else None


def cpu_usage(before: Any) -> dict[str, Any] | None:
    """The burst's share of each process's CPU since cpu_snapshot (None without BENCH_CPU)."""
    from . import cpuload

    return cpuload.usage(before, cpuload.snapshot([os.getpid()])) if before is not None else None


def add_gc_pauses(runs: dict[str, Any], windows: dict[str, dict[int, tuple[float, float]]]) -> None:
    """With BENCH_GC: each burst's garbage collections on its side (bench/gcpause.py)."""
    from .gcpause import pauses, recording

    out = recording()
    if out is None:
        return
    for side, bursts in windows.items():
        for count, window in bursts.items():
            if count in runs[side]:
                runs[side][count]["gc"] = pauses(out, window, worker=side == "worker")


def profiled_size(sizes: list[int]) -> int:
    """The burst that BENCH_PYSPY profiles, on both sides: BENCH_PYSPY_SESSIONS, or the largest."""
    return int(os.environ.get("BENCH_PYSPY_SESSIONS") or max(sizes, default=0))


RAW_SIDES = {"delta": "raw", "final": "raw_final"}  # how raw AsyncLLM reads: its side's name


def raw_output_kinds() -> tuple[str, ...]:
    """How raw AsyncLLM reads its outputs (BENCH_RAW_OUTPUT, a comma-separated list): ``delta``,
    every step's tokens as they come (the default: a client that streams; every run before the
    worker read non-streamed replies at their end only was measured so), ``final``, the end
    only (vLLM's FINAL_ONLY: how `vllm serve` reads a completion that is not streamed, and
    the worker a reply that is not streamed). burst_alt runs a raw side for each; the burst
    phases read as the first says."""
    kinds = tuple(k.strip() for k in (os.environ.get("BENCH_RAW_OUTPUT") or "delta").split(",") if k.strip())
    if not kinds or any(kind not in RAW_SIDES for kind in kinds) or len(set(kinds)) < len(kinds):
        raise SystemExit(f"BENCH_RAW_OUTPUT: delta, final or both (delta,final), not {kinds!r}")
    return kinds


async def raw_burst(
    llm: Any, prompts: list[list[int]] | list[str], max_tokens: int, *, final: bool = False
) -> tuple[list[Outcome], float]:
    """Every prompt at once into an AsyncLLM (ignore_eos: exactly max_tokens each); when each
    reached the engine (its add_request returned), its first token and its end. ``final``:
    read at the end only (raw_output_kinds), the first token's time then vLLM's own (its
    request stats: arrival and first-token latency, wall-clock). A prompt is token ids, or
    text that vLLM tokenizes in ``add_request`` (its prompt tokens then as vLLM counted them)."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    from worker.engine.vllm import engine_times, first_token_time

    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.7,
        top_p=0.95,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY if final else RequestOutputKind.DELTA,
    )
    admitted: dict[str, float] = {}
    original = getattr(llm, "add_request", None)
    started = time.monotonic()
    if original is not None:

        async def add_request(request_id: str, *args: Any, **kwargs: Any) -> Any:
            queue = await original(request_id, *args, **kwargs)
            admitted[request_id] = time.monotonic() - started
            return queue

        llm.add_request = add_request

    async def one(prompt: list[int] | str) -> Outcome:
        request_id = uuid.uuid4().hex
        first: float | None = None
        tokens = 0
        prompt_tokens = None if isinstance(prompt, str) else len(prompt)
        inside = None
        given = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}
        async for output in llm.generate(given, params, request_id):
            if not prompt_tokens:  # a text prompt: as vLLM tokenized it (on its first output)
                prompt_tokens = len(output.prompt_token_ids or ())
            piece = output.outputs[0]
            if first is None and piece.token_ids:
                at = first_token_time(output) if final else None  # read at the end: vLLM's time
                first = (at or time.monotonic()) - started
            tokens += len(piece.token_ids)
            if output.finished:
                inside = engine_times(output)
        end = time.monotonic() - started
        return Outcome(
            first,
            end,
            tokens,
            prompt_tokens or 0,
            admitted.get(request_id),
            engine_queue_s=inside.queue_s if inside is not None else None,
            prefill_s=inside.prefill_s if inside is not None else None,
        )

    try:
        outcomes = await asyncio.gather(*(one(prompt) for prompt in prompts))
    finally:
        if original is not None:
            del llm.add_request
    return list(outcomes), time.monotonic() - started


def _line(run: dict[str, Any]) -> str:
    keys = ("tok_per_s", "ttft_p50_ms", "ttft_p95_ms", "admission_s", "completion_tokens", "wall_s")
    extra = {k: run[k] for k in ("streamed", "ttft_end_p50_ms", "max_running", "max_waiting", "gc") if k in run}
    return ", ".join(f"{k}={run.get(k)}" for k in keys) + (f", {extra}" if extra else "")


SIDE_LABELS = {"worker": "worker", "raw": "raw", "raw_text": "raw, text"}  # the report's rows of a size


def burst_markdown(results: dict[str, dict[str, Any]]) -> str:
    """One table: each limits setting, N and side."""
    lines = [
        "# Bursts of one-turn sessions: the worker over MQTT against raw AsyncLLM",
        "",
        "| limits | sessions | side | tok/s | TTFT p50 | TTFT p95 | latency p95 | admission | vLLM running / waiting "
        "| worker / raw tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, result in results.items():
        for count in sorted({int(c) for side in result["runs"].values() for c in side}):
            for side, label in SIDE_LABELS.items():
                bursts = result["runs"].get(side, {})
                run = bursts.get(str(count)) or bursts.get(count)
                if not run:
                    continue
                queue = f"{run.get('max_running')} / {run.get('max_waiting')}" if side == "worker" else ""
                # The worker's row: against raw given token ids; raw's given text: the worker against it.
                ratio = result.get({"worker": "worker_over_raw", "raw_text": "worker_over_raw_text"}.get(side, ""), {})
                ratio_cell = ratio.get(str(count), ratio.get(count, ""))
                lines.append(
                    f"| {name} | {count} | {label} | {run['tok_per_s']:,.0f} | {run['ttft_p50_ms']} ms | "
                    f"{run['ttft_p95_ms']} ms | {run['latency_p95_ms']} ms | {run['admission_s']} s | {queue} | "
                    f"{ratio_cell} |"
                )
    lines.append("")
    if any("raw_text" in result["runs"] for result in results.values()):
        lines.append(
            "- `raw, text` (BENCH_RAW_TEXT): raw AsyncLLM given each prompt as the chat template's text, which vLLM "
            "tokenizes in add_request, instead of token ids encoded before the burst (other messages of the same "
            "sizes); its last column: the worker's tok/s over its."
        )
    sampled = [
        f"  - {name}, {count} sessions: {run['streamed']} streamed; the others' TTFT from the reply at its end: "
        f"p50 {run['ttft_end_p50_ms']} ms, p95 {run['ttft_end_p95_ms']} ms"
        for name, result in results.items()
        for count, run in result["runs"]["worker"].items()
        if isinstance(run, dict) and run.get("streamed")
    ]
    if sampled:
        lines += [
            "- The worker's TTFT above is measured on its streamed sessions (BENCH_STREAM_EVERY): the first "
            "delta's arrival at the client.",
            *sampled,
        ]
    inside = [
        f"  - {name}, {count} sessions, {side}: queue p50 {run['engine_queue_p50_ms']} ms, "
        f"p95 {run['engine_queue_p95_ms']} ms; prefill p50 {run.get('prefill_p50_ms')} ms, "
        f"p95 {run.get('prefill_p95_ms')} ms"
        for name, result in results.items()
        for side, bursts in result["runs"].items()
        for count, run in bursts.items()
        if isinstance(run, dict) and run.get("engine_queue_p50_ms") is not None
    ]
    if inside:
        lines += ["- Inside vLLM (its request stats: queued to first scheduled, then to the first token):", *inside]
    from .cpuload import words as cpu_words

    for key, cell, title in (
        ("gc", gc_cell, "Garbage collections during each burst (BENCH_GC; generation: count, total, longest)"),
        ("cpu", cpu_words, "CPU during each burst (BENCH_CPU; per process: cores busy, involuntary context switches)"),
    ):
        per_burst = [
            f"  - {name}, {count} sessions, {side}: " + cell(run[key])
            for name, result in results.items()
            for side, bursts in result["runs"].items()
            for count, run in bursts.items()
            if isinstance(run, dict) and key in run
        ]
        if per_burst:
            lines += [f"- {title}:", *per_burst]
    for name, result in results.items():
        skipped = result.get("sessions_skipped_kv_cache_too_small")
        lines += [
            f"- `{name}`: {result.get('limits_log')}; KV cache {result.get('kv_cache_tokens')} tokens"
            + (f"; not run (the KV cache does not hold them): {skipped}" if skipped else ""),
            f"  - Engine: {result.get('engine_log')}",
        ]
        for side, first in (result.get("first_burst") or {}).items():
            later = result["runs"][side].get(str(first["sessions"])) or result["runs"][side].get(first["sessions"])
            if later and later.get("tok_per_s") and first.get("tok_per_s"):
                lines.append(
                    f"  - {side}: the first burst after the start ({first['sessions']} sessions) "
                    f"{first['tok_per_s']:,.0f} tok/s, TTFT p50 {first['ttft_p50_ms']} ms: "
                    f"{first['tok_per_s'] / later['tok_per_s']:.2f}x the later one's tok/s"
                )
    return "\n".join(lines) + "\n"


def gc_cell(pauses: dict[str, list[float]]) -> str:
    if not pauses:
        return "none"
    return "; ".join(
        f"gen {g}: {int(n)}, {total:,.0f} ms, {longest:,.0f} ms" for g, (n, total, longest) in sorted(pauses.items())
    )


def plot_bursts(results: dict[str, dict[str, Any]], path: Path) -> None:
    """tok/s and TTFT p50 against sessions, worker and raw, each limits setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, result in results.items():
        for side, style in (("worker", "-o"), ("raw", "--s"), ("raw_text", ":^")):
            runs = result["runs"].get(side, {})
            counts = sorted(int(c) for c in runs)
            if not counts:
                continue
            rows = [runs.get(str(c)) or runs.get(c) for c in counts]
            label = f"{SIDE_LABELS[side]}, {name} limits"
            left.plot(counts, [r["tok_per_s"] for r in rows], style, label=label)
            right.plot(counts, [r["ttft_p50_ms"] for r in rows], style, label=label)
    left.set(xlabel="sessions at once", ylabel="generated tokens/s", title="throughput", xscale="log")
    right.set(
        xlabel="sessions at once", ylabel="TTFT p50 (ms)", title="time to first token", yscale="log", xscale="log"
    )
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_burst_report(out: Path, names: list[str]) -> None:
    results = {
        n: json.loads((out / f"burst_{n}.json").read_text()) for n in names if (out / f"burst_{n}.json").exists()
    }
    if not results:
        return
    (out / "burst.md").write_text(burst_markdown(results))
    plot_bursts(results, out / "burst.png")
