"""Benchmark sizes and engine settings per machine."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from worker.config.models import EngineConfig, flag_for

# The limits of the burst phases: the worker's before issue 31 (vLLM's library defaults, which
# an AsyncLLM outside a usage context gets), and what it chooses now (nothing set).
BURST_LIMITS: dict[str, dict[str, Any]] = {
    "old": {"max_num_seqs": 128, "max_num_batched_tokens": 2048},
    "new": {},
    # The new limits with every request handed to the engine at once (the worker's intake before
    # its admission policy): the worker's side only, raw AsyncLLM is burst_new's.
    "off": {"admission": "off"},
}


@dataclass(frozen=True)
class Profile:
    engine_overrides: dict[str, Any]  # EngineConfig fields, the same for the worker and in-process
    concurrency: tuple[int, ...] = (1, 5, 10, 50, 100)
    one_at_a_time: tuple[int, ...] = (1, 5, 10)
    turns: int = 3
    multi_turns: int = 10
    structured_sessions: int = 16
    max_tokens: int = 128
    before_max_tokens: int = 512  # the "before" script's maxTokens
    decode_tokens: int = 512
    stream: bool = True  # the concurrency runs ask for stream deltas (the client's TTFT)
    ablation: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Several GPUs (bench/multigpu.py): the concurrency runs, the GPUs of the data-parallel
    # workers (one each) and the tensor-parallel size of the one worker spread over them.
    multi_concurrency: tuple[int, ...] = (1, 10, 50, 100, 200)
    gpus: tuple[str, ...] = ("0", "1")
    tensor_parallel_size: int = 2
    # The burst phases of bench/multigpu.py (burst_single, burst_dp): N sessions send a first
    # turn of burst_prompt_tokens at the same moment, then, once every reply is in, a second of
    # multi_burst_followup_tokens at the same moment; after a warm-up of multi_burst_warmup
    # sessions (two turns, not recorded).
    multi_burst_sessions: tuple[int, ...] = (320, 1000)
    multi_burst_warmup: int = 64
    multi_burst_followup_tokens: int = 32
    # The capacity phases (bench/capacity.py): engine settings (over engine_overrides), N at
    # these multiples of the sessions the KV cache holds (at most capacity_max_sessions), turns
    # per session, the arrival rate the think times are scaled to (turns/s), the workload, and
    # the host-memory tier of capacity_offload.
    capacity_engine: dict[str, Any] = field(default_factory=dict)
    capacity_multiples: tuple[int, ...] = (1, 3, 10)
    capacity_max_sessions: int = 1000
    capacity_turns: int = 3
    capacity_rate: float = 4.0
    capacity_system_tokens: int = 1000
    capacity_user_tokens: tuple[int, int] = (150, 250)
    capacity_max_tokens: int = 64
    capacity_offload_gib: float | None = 20.0  # None: the worker's default
    # 1x as this many sessions instead of what the start's KV cache holds: runs on different
    # starts (whose KV cache may differ) or with another KV dtype compare at the same N.
    capacity_sessions_1x: int | None = None
    capacity_bursts: bool = True  # the first bursts before the capacity runs
    capacity_kv_tokens_fallback: int = 8192  # when the engine's log does not say
    capacity_burst_pause_s: float = 5.0
    burst_system_tokens: int = 1500  # the bursts of first turns before the capacity runs
    # The returning phases (bench/capacity.py returning_phase): every session sends its first
    # turn at the same moment, then, once all are answered, its second at the same moment.
    returning_sessions: int = 100
    returning_system_tokens: int = 1500
    returning_user_tokens: tuple[int, int] = (750, 850)  # two turns stay under max_history_tokens
    returning_max_tokens: int = 128
    fp8_engine: dict[str, Any] = field(default_factory=lambda: {"quantization": "fp8", "kv_cache_dtype": "fp8"})
    # The burst phases (bench/burst.py): one-turn sessions all at once, through the worker and
    # through raw AsyncLLM, at each limits setting of burst_limits (engine settings over
    # engine_overrides and burst_engine), at each N of burst_sessions the KV cache holds.
    burst_sessions: tuple[int, ...] = (320, 1000, 2000)
    burst_prompt_tokens: int = 300
    burst_max_tokens: int = 128
    burst_limits: dict[str, dict[str, Any]] = field(default_factory=lambda: dict(BURST_LIMITS))
    burst_engine: dict[str, Any] = field(default_factory=dict)
    # Sizes for one limits setting instead of burst_sessions (the sweep for the plot).
    burst_sessions_by_limits: dict[str, tuple[int, ...]] = field(
        default_factory=lambda: {"new": (1, 10, 100, 320, 1000, 2000)}
    )
    burst_worker_only: tuple[str, ...] = ("off",)  # limits settings run through the worker alone
    burst_first: int = 320  # the first burst after the start (its tok/s against the later one's)
    # The burst_alt phase (bench/alternating.py): both sides up at once on one GPU, each burst
    # size on one side right after the other, alternating_repeats times; each engine's settings
    # over burst_new's (half of the GPU's memory each, no host tier).
    alternating_sessions: tuple[int, ...] = (320, 1000)
    alternating_repeats: int = 3
    alternating_engine: dict[str, Any] = field(
        default_factory=lambda: {"gpu_memory_utilization": 0.45, "kv_offload_gib": 0}
    )
    # The vision phase (bench/vision.py): sessions at once, each with one 1024x768 image, after a
    # warm-up of vision_warmup sessions; the replies' tokens (short: the image's prefill and
    # encoding are what is measured).
    vision_sessions: tuple[int, ...] = (1, 16, 64)
    vision_warmup: int = 4
    vision_max_tokens: int = 32

    def engine_config(self, model: Path, **overrides: Any) -> EngineConfig:
        settings = {**self.engine_overrides, **overrides}
        settings["extra"] = {**self.engine_overrides.get("extra", {}), **overrides.get("extra", {})}
        return EngineConfig(model=str(model), **settings)

    @property
    def worker_args(self) -> list[str]:
        """The same engine settings as worker flags."""
        return engine_flags(self.engine_overrides)

    def _over(self, overrides: dict[str, Any]) -> dict[str, Any]:
        extra = {**self.engine_overrides.get("extra", {}), **overrides.get("extra", {})}
        return {**self.engine_overrides, **overrides, "extra": extra}

    @property
    def capacity_worker_args(self) -> list[str]:
        return engine_flags(self._over(self.capacity_engine))

    @property
    def fp8_worker_args(self) -> list[str]:
        return engine_flags(self._over(self.fp8_engine))


def engine_flags(settings: dict[str, Any]) -> list[str]:
    """EngineConfig fields as worker flags."""
    args: list[str] = []
    fields = EngineConfig.model_fields
    for key, value in settings.items():
        if key == "extra" and not value:
            continue
        flag = flag_for("engine", key, fields[key])
        if isinstance(value, bool):
            args.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(value, dict):
            args += [flag, json.dumps(value)]
        else:
            args += [flag, str(value)]
    return args


_CPU_ENGINE = {"enforce_eager": True, "block_size": 32, "gpu_memory_utilization": 0.3, "max_model_len": 4096}

PROFILES: dict[str, Profile] = {
    # The tiny generated model on this machine's CPU: minutes, not hours.
    "cpu": Profile(
        _CPU_ENGINE,
        concurrency=(1, 4, 8, 16),
        one_at_a_time=(1, 4, 8),
        multi_turns=10,
        structured_sessions=4,
        max_tokens=32,
        before_max_tokens=128,  # 512 x 10 turns would not fit the tiny model's 4096 positions
        decode_tokens=128,
        multi_concurrency=(1, 4, 8),
        multi_burst_sessions=(8, 32),
        multi_burst_warmup=8,
        tensor_parallel_size=1,  # the CPU engine: --visible-devices is set, nothing is split
        vision_sessions=(1, 4),
        vision_warmup=1,
        vision_max_tokens=16,
    ),
    # CI: does every phase run end to end? No timing is asserted. A fixed 256 MiB KV cache (the
    # test workers' size) instead of 0.3 of host memory: 7 GiB each of a 24 GiB CI machine, and
    # the several-GPU smoke run starts two.
    "smoke": Profile(
        {**_CPU_ENGINE, "extra": {"kv_cache_memory_bytes": 256 * 2**20}},
        concurrency=(1, 4),
        one_at_a_time=(1, 2),
        turns=2,
        multi_turns=3,
        structured_sessions=2,
        max_tokens=16,
        before_max_tokens=64,
        decode_tokens=32,
        multi_concurrency=(1, 4),
        multi_burst_sessions=(8,),
        multi_burst_warmup=4,
        tensor_parallel_size=1,
        # The CPU engine's KV cache holds hundreds of tiny sessions: capped, the code path only.
        capacity_multiples=(1, 3),
        capacity_max_sessions=3,
        capacity_turns=2,
        capacity_rate=30.0,
        capacity_system_tokens=100,
        capacity_user_tokens=(10, 20),
        capacity_max_tokens=8,
        capacity_offload_gib=1.0,  # the CPU backend has no host tier: logged and off
        capacity_burst_pause_s=0.2,
        burst_system_tokens=100,
        returning_sessions=4,
        returning_system_tokens=100,
        returning_user_tokens=(10, 20),
        returning_max_tokens=8,
        burst_sessions=(2, 4),
        burst_sessions_by_limits={"new": (1, 2, 4)},
        burst_first=4,
        alternating_sessions=(2,),
        alternating_repeats=2,
        alternating_engine={"kv_offload_gib": 0},  # the fixed 256 MiB KV cache each
        burst_prompt_tokens=60,
        burst_max_tokens=8,
        vision_sessions=(1, 2),
        vision_warmup=1,
        vision_max_tokens=8,
    ),
    # One H100/H200 with vLLM 0.26: worker defaults (CUDA graphs, prefix caching) and a context
    # long enough for ten turns without trimming in the "before" pattern.
    "gpu": Profile(
        {"max_model_len": 16384, "extra": {"load_format": "dummy"}},  # real geometry, no weights
        # The capacity phases on a KV cache of 2 GiB (8,192 tokens of QwQ-32B in bf16: ~8
        # sessions), so 10x is 80 sessions and each phase fits a few minutes of device time; the
        # ratios, not the absolute count, are what carries over to the whole GPU's cache.
        capacity_engine={"max_model_len": 4096, "extra": {"kv_cache_memory_bytes": 2 * 2**30}},
        ablation={
            "default": {},
            "eager": {"enforce_eager": True},
            "max_num_seqs_64": {"max_num_seqs": 64},
            "batched_tokens_16k": {"extra": {"max_num_batched_tokens": 16384}},
            "async_scheduling": {"extra": {"async_scheduling": True}},
            "ngram_spec": {
                "extra": {
                    "speculative_config": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
                }
            },
        },
    ),
}
# The GPU profile with llguidance instead of xgrammar for structured output (its masks are
# computed lazily per token: compared where xgrammar's per-step work shows, the 0.5B).
PROFILES["gpu-guidance"] = Profile(
    {
        **PROFILES["gpu"].engine_overrides,
        "extra": {"load_format": "dummy", "structured_outputs_config": {"backend": "guidance"}},
    }
)
# The GPU profile with vLLM's async scheduling (CPU work of step n+1 overlaps the GPU's step n).
PROFILES["gpu-async"] = Profile(
    {**PROFILES["gpu"].engine_overrides, "extra": {"load_format": "dummy", "async_scheduling": True}}
)


# The several-GPU bursts at 1,000 sessions only (the goal's size: both phases fit one command of
# the GPU machine, where 320 and 1,000 take two).
PROFILES["gpu-1000"] = replace(PROFILES["gpu"], multi_burst_sessions=(1000,))
# One 320-session burst on each side with today's limits, for a profile of it (BENCH_PYSPY,
# BENCH_PYSPY_SESSIONS=320) in one call: `bash scripts/gpu_burst.sh burst_new qwen3-1.7b gpu-320`.
# (Its one run so far, with BENCH_PYSPY_GIL=1 and py-spy 0.4.3, profiled raw's side and left the
# worker's file empty; py-spy slowed raw's burst to half of what it runs unprofiled.)
PROFILES["gpu-320"] = replace(PROFILES["gpu"], burst_sessions=(320,), burst_sessions_by_limits={"new": (320,)})
# The three sizes of the one-GPU goal only (320, 1,000 and 2,000 sessions, the whole GPU's
# memory on each side in turn): `bash scripts/gpu_burst.sh burst_new qwen3-1.7b gpu-goal` fits
# one call of the GPU machine, where the full sweep (1 to 2,000) takes two.
PROFILES["gpu-goal"] = replace(
    PROFILES["gpu"], burst_sessions=(320, 1000, 2000), burst_sessions_by_limits={"new": (320, 1000, 2000)}
)
# The same sizes with the host-memory KV tier off on both sides (the worker's default sizes it
# from the host's memory, 64 GiB on the GPU hosts): what the tier costs a burst of new sessions,
# on one machine beside `gpu-goal` (`... burst_new qwen3-1.7b gpu-goal-notier`).
PROFILES["gpu-goal-notier"] = replace(PROFILES["gpu-goal"], burst_engine={"kv_offload_gib": 0})
# The largest size alone (a warm-up burst of it too): what the worker's settings do beyond
# max_num_seqs + admission_waiting_requests, where requests wait in the worker, in a third of
# `gpu-goal`'s time (`WORKER_ENGINE_ADMISSION_WAITING_REQUESTS=...` before it sets the knob).
PROFILES["gpu-goal-2000"] = replace(
    PROFILES["gpu-goal"], burst_sessions=(2000,), burst_sessions_by_limits={"new": (2000,)}, burst_first=2000
)


# Experiments on the 7B's C = 50/100 gap (minutes each, results under experiments/): the
# concurrency runs only, with vLLM's stream_interval (outputs every N tokens, the first and
# the last at once) and without stream deltas (what streaming costs the worker).
def _quick(extra: dict[str, Any], *, stream: bool = True) -> Profile:
    engine = {**PROFILES["gpu"].engine_overrides, "extra": {"load_format": "dummy", **extra}}
    return Profile(engine, concurrency=(50, 100), one_at_a_time=(), multi_turns=2, decode_tokens=64, stream=stream)


PROFILES["gpu-quick"] = _quick({})
PROFILES["gpu-quick-nostream"] = _quick({}, stream=False)
for _interval in (2, 4, 8):
    PROFILES[f"gpu-quick-si{_interval}"] = _quick({"stream_interval": _interval})
PROFILES["gpu-quick-low"] = Profile(
    PROFILES["gpu"].engine_overrides, concurrency=(1, 5, 10), one_at_a_time=(), multi_turns=2, decode_tokens=64
)
# The first bursts after a start only (the capacity phase without its capacity runs): with the
# warm-up (on a machine's empty compile caches), and without it (scripts/gpu_capacity.sh gives
# each profile an empty Triton cache of its own, so kernels compiled on first use compile again).
for _name, _warmup in (("gpu-firstburst", "on"), ("gpu-firstburst-nowarmup", "off")):
    PROFILES[_name] = Profile(
        PROFILES["gpu"].engine_overrides,
        capacity_engine={**PROFILES["gpu"].capacity_engine, "warmup": _warmup},
        capacity_multiples=(),
        decode_tokens=64,
    )
# Long histories (900-token messages under a 1,500-token system prompt, as chat sessions that
# paste documents): what a returning turn recomputes without the host tier is thousands of
# tokens. KV cache 4 GiB (16,384 tokens of QwQ-32B: 5 such sessions), the tier 40 GiB.
PROFILES["gpu-capacity-long"] = Profile(
    PROFILES["gpu"].engine_overrides,
    capacity_engine={"max_model_len": 8192, "extra": {"kv_cache_memory_bytes": 4 * 2**30}},
    capacity_system_tokens=1500,
    capacity_user_tokens=(800, 1000),
    capacity_rate=2.0,
    capacity_offload_gib=40.0,
    capacity_burst_pause_s=1.0,
    decode_tokens=64,
)

# The capacity phases at full scale: the whole GPU's KV cache (the worker's defaults,
# util 0.93), the host tier at the worker's default size (capacity_offload with
# capacity_offload_gib None) or off (capacity). 1x is 53 sessions (what the bf16 cache of
# 44,576 tokens held on the first such start) in every run, FP8 KV included, so that each
# multiple is the same N whatever the KV cache of the start. Each phase (a worker start) fits
# the device's 10 minutes a command: 1x and 10x in one, 3x and 7x in another (no bursts).
_FULLSCALE = {"max_model_len": 4096, "gpu_memory_utilization": 0.93}


def _fullscale(multiples: tuple[int, ...], engine: dict[str, Any] | None = None, *, bursts: bool) -> Profile:
    return Profile(
        PROFILES["gpu"].engine_overrides,
        capacity_engine={**_FULLSCALE, **(engine or {})},
        capacity_multiples=multiples,
        capacity_rate=16.0,
        capacity_offload_gib=None,
        capacity_sessions_1x=53,
        capacity_bursts=bursts,
    )


_FP8_KV = {"kv_cache_dtype": "fp8"}
PROFILES["gpu-fullscale"] = _fullscale((1, 10), bursts=True)
PROFILES["gpu-fullscale-mid"] = _fullscale((3, 7), bursts=False)
PROFILES["gpu-fullscale-fp8"] = _fullscale((1, 10), _FP8_KV, bursts=False)
PROFILES["gpu-fullscale-fp8-mid"] = _fullscale((3, 7), _FP8_KV, bursts=False)
# The returning phases on the whole GPU: 100 sessions sharing a 1,500-token system prompt, each
# returning once, every session at the same moment (round-2 prompts ~7x the GPU's KV cache);
# returning without the tier, returning_offload with it (the worker's default size, 40 GiB, or the
# default with FP8 KV).
for _name, _gib, _kv in (
    ("gpu-returning", None, {}),
    ("gpu-returning-40", 40.0, {}),
    ("gpu-returning-fp8", None, _FP8_KV),
):
    PROFILES[_name] = Profile(
        PROFILES["gpu"].engine_overrides, capacity_engine={**_FULLSCALE, **_kv}, capacity_offload_gib=_gib
    )
# The same on a GPU whose KV cache would hold every session (an H200's: 100 sessions' second
# prompts fit in it, so nothing leaves the GPU and the tier is not exercised): the KV cache held
# to what an H100 gives the QwQ-32B geometry at util 0.93 (44,576 tokens of 256 KiB: 64 layers,
# 8 KV heads of 128, bf16), so the round-2 prompts are ~7.5x of it on either GPU.
_H100_KV_BYTES = 44_576 * 64 * 8 * 128 * 2 * 2
PROFILES["gpu-returning-h100kv"] = Profile(
    PROFILES["gpu"].engine_overrides,
    capacity_engine={**_FULLSCALE, "extra": {"kv_cache_memory_bytes": _H100_KV_BYTES}},
    capacity_offload_gib=None,
)

# The burst phases on the QwQ-32B geometry (an H200: its KV cache holds 300 sessions of 428
# tokens beside 65 GB of weights, an H100's does not): 100 and 300 sessions, worker and raw.
PROFILES["gpu-burst-qwq"] = replace(
    PROFILES["gpu"], burst_sessions_by_limits={"new": (100, 300)}, burst_first=100, burst_sessions=(100, 300)
)
