"""The default size of the host-memory KV tier (engine.kv_offload_gib unset), from the memory
actually available when the worker starts.

The sizing (``size_host_tier``) is pure; ``read_host_memory`` reads what it needs from
/proc/meminfo and the worker's memory cgroup (v2 or v1).

The rule, per worker (one worker per GPU, or per tensor-parallel group)::

    available = min(MemAvailable, room left under the cgroup's memory limit)
    reserve   = max(16 GiB, 20% of available)
    budget    = (available - reserve) * tensor_parallel_size / GPUs on the host
    tier      = the largest power of two GiB <= budget, at most 64 GiB; off below 1 GiB

Why the reserve. The size is taken before the engine starts, so what the engine needs later
still counts as available: its own process (torch and the CUDA runtime, 3-6 GiB), torch.compile's
compile workers on a cold cache (a few hundred MiB each, one per core: up to ~8 GiB on 16 cores),
the worker's own growth (sessions, histories), other processes (broker, Redis) and some page
cache, so that a restart still finds part of the model's files in memory. 16 GiB covers these on
a one-GPU host; 20% of what is available keeps the same margin on larger hosts, whose page cache
and other processes grow with them. The tier is pinned: it can neither be swapped nor reclaimed,
so what it takes is gone for everything else until the worker stops.

Why a power of two. vLLM's native tier (CPUOffloadingSpec, vLLM 0.26 and 0.32) allocates its host
memory with ``torch.zeros(..., pin_memory=True)``, and torch's pinned-memory allocator rounds
every allocation up to the next power of two (torch 2.11: always; later releases only below
``pinned_max_round_threshold_mb``). A 40 GiB tier pins 64 GiB, of which 24 GiB hold nothing; a
tier between two powers of two wastes what it does not use and costs the start time (pinning)
of the larger one. See docs/benchmarks/kv-tier-start.md.

The arithmetic for 100 returning sessions (QwQ-32B geometry: 64 layers, 8 KV heads, head_dim 128,
bf16: 2 * 64 * 8 * 128 * 2 bytes = 256 KiB per token, 4 MiB per 16-token block) on the H100
host (125 GiB, MemAvailable ~120 GiB at start, one GPU, no cgroup limit)::

    reserve = max(16, 0.2 * 120) = 24 GiB;  budget = 120 - 24 = 96 GiB;  tier = 64 GiB
    64 GiB / 256 KiB = 262,144 tokens in the tier

The workload (100 sessions, one shared 1.5k-token system prompt, round-2 prompts about 7x the GPU
KV cache of 44,576-49,008 tokens: 312k-343k prompt tokens) holds 164k-195k distinct tokens
(312k-343k less 99 repeats of the shared 1.5k), 40-48 GiB: all of it fits in 64 GiB. The measured
points: 31 GiB (127k tokens) kept 79% of all-resident reuse, 40 GiB (164k tokens) 92%. And the
40 GiB tier of that run already pinned 64 GiB (the power of two above), so 64 GiB costs no more
host memory and no more pinning time than the run that reached 92%. Measured since with 64 GiB
(bench ``returning`` phase, docs/benchmarks/capacity-fullscale.md): 100% of all-resident reuse.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

GIB = 2**30
RESERVE_MIN_GIB = 16.0  # the engine process, compile workers, the worker, other processes
RESERVE_SHARE = 0.2  # of what is available: the same margin on larger hosts
AUTO_MAX_GIB = 64  # pinning costs start time (docs/benchmarks/kv-tier-start.md)
AUTO_MIN_GIB = 1  # below this the tier is off
# cgroup v1 writes "no limit" as a number near 2**63 (rounded down to the page size).
_CGROUP_V1_UNLIMITED = 2**60


@dataclasses.dataclass(frozen=True)
class HostMemory:
    """What the host and the worker's memory cgroup say, in bytes."""

    total: int  # MemTotal
    available: int  # MemAvailable: free memory plus what the kernel can reclaim without swapping
    cgroup_limit: int | None = None  # the tightest memory limit of the worker's cgroup and its parents
    cgroup_room: int | None = None  # that limit less the cgroup's usage (its file cache counted as room)


@dataclasses.dataclass(frozen=True)
class TierSize:
    """The chosen size and, in words, the numbers it came from."""

    gib: float
    reason: str
    short: bool  # less than the default on an ordinary host (memory short): said as a WARNING


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: float) -> int:
    """KV-cache bytes one token takes (keys and values of every layer): QwQ-32B in bf16 is
    2 * 64 * 8 * 128 * 2 = 262,144 (256 KiB); FP8 KV halves it."""
    return int(2 * layers * kv_heads * head_dim * dtype_bytes)


def _gib(value: float) -> str:
    return f"{value / GIB:.1f} GiB"


def size_host_tier(
    memory: HostMemory,
    *,
    gpus: int,
    tensor_parallel_size: int = 1,
    power_of_two: bool = True,
) -> TierSize:
    """The default host tier for one worker (see the module's docstring for the rule and its
    arithmetic). ``power_of_two``: the pinned allocation is rounded up to one (vLLM's native
    tier through torch's pinned allocator), so the tier is chosen as one. Whole GiB otherwise."""
    available = memory.available
    source = f"MemAvailable {_gib(memory.available)}"
    if memory.cgroup_room is not None and memory.cgroup_room < available:
        available = max(memory.cgroup_room, 0)
        assert memory.cgroup_limit is not None
        source = f"cgroup limit {_gib(memory.cgroup_limit)} leaves {_gib(available)}"
    reserve = max(RESERVE_MIN_GIB * GIB, RESERVE_SHARE * available)
    share = max(available - reserve, 0) * tensor_parallel_size / max(gpus, 1)
    per_gpu = f" shared by {gpus} GPUs" if gpus > tensor_parallel_size else ""
    budget = share / GIB
    if budget < AUTO_MIN_GIB:
        reason = (
            f"auto: {source}, less a reserve of {_gib(reserve)}{per_gpu}, leaves {budget:.1f} GiB: "
            f"below {AUTO_MIN_GIB} GiB, too little memory for the tier"
        )
        return TierSize(0.0, reason, short=True)
    if power_of_two:
        size = float(min(2 ** math.floor(math.log2(budget)), AUTO_MAX_GIB))
        rounding = "the largest power of two in it (torch pins powers of two)"
    else:
        size = float(min(math.floor(budget), AUTO_MAX_GIB))
        rounding = "in whole GiB"
    short = size < AUTO_MAX_GIB
    reason = (
        f"auto: {source}, less a reserve of {_gib(reserve)}{per_gpu}, leaves {budget:.1f} GiB; "
        f"{rounding}, at most {AUTO_MAX_GIB} GiB"
    )
    if short:
        reason += "; memory short: less than the default on a host with room"
    return TierSize(size, reason, short)


def pinned_gib(size_gib: float, *, power_of_two: bool = True) -> float:
    """Host memory a tier of ``size_gib`` pins: the power of two at or above it where the
    allocator rounds (torch's pinned allocator), the size itself otherwise."""
    if size_gib <= 0 or not power_of_two:
        return max(size_gib, 0.0)
    return float(2 ** math.ceil(math.log2(size_gib)))


def explicit_size_warning(
    size_gib: float, memory: HostMemory, *, gpus: int, tensor_parallel_size: int = 1
) -> str | None:
    """Words for a WARNING when a size set by hand pins more than this worker's share of the
    memory available less the smallest reserve (the set size still wins); None when it fits."""
    available = memory.available
    if memory.cgroup_room is not None:
        available = min(available, memory.cgroup_room)
    share = max(available - RESERVE_MIN_GIB * GIB, 0) * tensor_parallel_size / max(gpus, 1)
    pinned = pinned_gib(size_gib)
    if pinned * GIB <= share:
        return None
    return (
        f"kv_offload_gib={size_gib:g} pins {pinned:g} GiB of host memory (torch rounds pinned memory up to a "
        f"power of two), more than the {share / GIB:.1f} GiB this worker has after a {RESERVE_MIN_GIB:g} GiB "
        "reserve: the start may fail or the host swap; leave kv_offload_gib unset to size it from the memory"
    )


# -- readers --------------------------------------------------------------------------------


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo as bytes by key ("MemAvailable: 123 kB" -> 125952)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if not parts or not parts[0].isdigit():
            continue
        value = int(parts[0])
        if len(parts) > 1 and parts[1].lower() == "kb":
            value *= 1024
        out[key.strip()] = value
    return out


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _reclaimable_file_cache(stat: Path, keys: tuple[str, ...]) -> int:
    """The page cache charged to a cgroup (memory.stat), which the kernel reclaims before it
    fails an allocation: counted as room, as MemAvailable counts it on the host."""
    try:
        text = stat.read_text()
    except OSError:
        return 0
    values = dict(line.split(maxsplit=1) for line in text.splitlines() if " " in line)
    return sum(int(values[k]) for k in keys if k in values and values[k].strip().isdigit())


def _cgroup_levels(mount: Path, path: str) -> list[Path]:
    """The cgroup's directory and its parents up to the mount, as seen from here. In a
    container the path /proc/self/cgroup names is often not under the mount (the container's
    cgroup is the mount's root): then only the root."""
    leaf = mount / path.lstrip("/")
    if not path.strip("/") or not leaf.is_dir():
        return [mount]
    levels = [leaf]
    while levels[-1] != mount and mount in levels[-1].parents:
        levels.append(levels[-1].parent)
    return levels


def read_cgroup_memory(
    proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")
) -> tuple[int | None, int | None]:
    """(the tightest memory limit, the room under it) of the worker's memory cgroup and its
    parents, in bytes; (None, None) without a limit. cgroup v2 (memory.max, memory.current) or
    v1 (memory.limit_in_bytes, memory.usage_in_bytes)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None, None
    v2_path = v1_path = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2_path = parts[2]
        elif "memory" in parts[1].split(","):
            v1_path = parts[2]
    limit: int | None = None
    room: int | None = None
    if v1_path is not None and (root / "memory").is_dir():
        candidates = [
            (
                d / "memory.limit_in_bytes",
                d / "memory.usage_in_bytes",
                d / "memory.stat",
                ("total_inactive_file", "total_active_file"),
            )
            for d in _cgroup_levels(root / "memory", v1_path)
        ]
    elif v2_path is not None:
        candidates = [
            (d / "memory.max", d / "memory.current", d / "memory.stat", ("inactive_file", "active_file"))
            for d in _cgroup_levels(root, v2_path)
        ]
    else:
        return None, None
    for limit_file, usage_file, stat_file, cache_keys in candidates:
        level_limit = _read_int(limit_file)
        if level_limit is None or level_limit >= _CGROUP_V1_UNLIMITED:
            continue
        usage = _read_int(usage_file) or 0
        level_room = level_limit - usage + _reclaimable_file_cache(stat_file, cache_keys)
        level_room = min(max(level_room, 0), level_limit)
        if room is None or level_room < room:
            limit, room = level_limit, level_room
    return limit, room


def read_host_memory(
    meminfo: Path = Path("/proc/meminfo"),
    proc_cgroup: Path = Path("/proc/self/cgroup"),
    cgroup_root: Path = Path("/sys/fs/cgroup"),
) -> HostMemory:
    """MemTotal and MemAvailable, and the memory cgroup's limit and room (read_cgroup_memory).
    A kernel without MemAvailable (before 3.14): MemFree + Cached, as it estimated."""
    values = parse_meminfo(meminfo.read_text())
    total = values.get("MemTotal", 0)
    available = values.get("MemAvailable")
    if available is None:
        available = values.get("MemFree", 0) + values.get("Cached", 0)
    limit, room = read_cgroup_memory(proc_cgroup, cgroup_root)
    return HostMemory(total=total, available=available, cgroup_limit=limit, cgroup_room=room)


# How torch pins the host tier when the worker starts the engine (PYTORCH_CUDA_ALLOC_CONF):
# malloc, the pages faulted in by several threads, then one cudaHostRegister, instead of one
# cudaHostAlloc that faults in and pins every page from one thread. Measured on the H100 host
# (bench/pinprobe.py, torch 2.11, a 40 GiB tensor, which torch rounds up to 64 GiB either way):
# 46.5 s as vLLM 0.26 allocates it (torch.zeros, pin_memory=True), 7.3 s this way with 16
# threads (docs/benchmarks/kv-tier-start.md).
PINNING_KEYS = ("pinned_use_cuda_host_register", "pinned_num_register_threads")
MAX_PINNING_THREADS = 16


def pinning_alloc_conf(current: str | None, cpus: int) -> str | None:
    """PYTORCH_CUDA_ALLOC_CONF with threaded pinning added, or None to leave it as it is (the
    operator set one of its keys already)."""
    entries = [e for e in (current or "").split(",") if e.strip()]
    if any(e.split(":", 1)[0].strip() in PINNING_KEYS for e in entries):
        return None
    threads = max(1, min(MAX_PINNING_THREADS, cpus))
    # torch 2.11 takes a power of two of at most 128 threads.
    threads = 1 << (threads.bit_length() - 1)
    return ",".join([*entries, "pinned_use_cuda_host_register:True", f"pinned_num_register_threads:{threads}"])
