"""The host tier's default size (worker/engine/kvtier.py): the sizing rule and the readers of
/proc/meminfo and the memory cgroup, on sample files."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.engine.kvtier import (
    GIB,
    HostMemory,
    explicit_size_warning,
    kv_bytes_per_token,
    parse_meminfo,
    pinned_gib,
    read_cgroup_memory,
    read_host_memory,
    size_host_tier,
)


def host(available_gib: float, total_gib: float = 125.0, **cgroup: float) -> HostMemory:
    limit, room = cgroup.get("limit"), cgroup.get("room")
    return HostMemory(
        total=int(total_gib * GIB),
        available=int(available_gib * GIB),
        cgroup_limit=None if limit is None else int(limit * GIB),
        cgroup_room=None if room is None else int(room * GIB),
    )


def test_qwq_32b_geometry_takes_256_kib_per_token() -> None:
    assert kv_bytes_per_token(64, 8, 128, 2) == 256 * 1024
    assert kv_bytes_per_token(64, 8, 128, 1) == 128 * 1024  # FP8 KV halves it
    # The 64 GiB default holds 262,144 such tokens: the issue-25 workload's 164k-195k distinct ones.
    assert 64 * GIB // kv_bytes_per_token(64, 8, 128, 2) == 262_144


def test_the_h100_host_gets_64_gib() -> None:
    """125 GiB host, ~120 GiB available at start, one GPU: reserve max(16, 24) = 24 GiB,
    budget 96 GiB, the largest power of two in it 64 GiB (>= 40 GiB, which kept 92% reuse)."""
    chosen = size_host_tier(host(120), gpus=1)
    assert chosen.gib == 64 and not chosen.short
    assert "MemAvailable 120.0 GiB" in chosen.reason and "reserve of 24.0 GiB" in chosen.reason
    assert "leaves 96.0 GiB" in chosen.reason
    # The reserve is at least 16 GiB, else a fifth of what is available.
    assert "reserve of 16.0 GiB" in size_host_tier(host(60), gpus=1).reason
    # Even a busier start of that host keeps the 64 GiB: 100 - 20 = 80.
    assert size_host_tier(host(100), gpus=1).gib == 64


@pytest.mark.parametrize(
    ("available", "gpus", "tp", "expected"),
    [
        (120, 1, 1, 64),  # capped: pinning costs start time
        (2000, 1, 1, 64),
        (60, 1, 1, 32),  # 60 - 16 = 44: 32
        (40, 1, 1, 16),  # 40 - 16 = 24: 16
        (18, 1, 1, 2),  # 18 - 16 = 2
        (17.5, 1, 1, 1),  # 1.5: 1
        (1000, 8, 1, 64),  # (1000 - 200) / 8 = 100 per GPU: 64
        (500, 8, 1, 32),  # (500 - 100) / 8 = 50: 32
        (500, 8, 4, 64),  # a tensor-parallel group of 4 gets four GPUs' share: 200: 64
        (120, 2, 1, 32),  # two workers on the H100-sized host: 48 each: 32
    ],
)
def test_the_tier_is_the_largest_power_of_two_in_the_budget(
    available: float, gpus: int, tp: int, expected: float
) -> None:
    assert size_host_tier(host(available), gpus=gpus, tensor_parallel_size=tp).gib == expected


def test_whole_gib_when_the_allocation_is_not_rounded() -> None:
    assert size_host_tier(host(60), gpus=1, power_of_two=False).gib == 44
    assert size_host_tier(host(120), gpus=1, power_of_two=False).gib == 64


def test_short_memory_is_said_and_too_little_turns_the_tier_off() -> None:
    small = size_host_tier(host(40), gpus=1)
    assert small.short and "memory short" in small.reason
    off = size_host_tier(host(16.5), gpus=1)
    assert off.gib == 0 and off.short and "too little memory" in off.reason
    assert size_host_tier(host(0), gpus=1).gib == 0  # nothing available: off, never negative


def test_a_cgroup_limit_below_memavailable_sets_the_budget() -> None:
    # The host has 120 GiB available, the worker's cgroup only 48 GiB of room under 64 GiB.
    chosen = size_host_tier(host(120, limit=64, room=48), gpus=1)
    assert chosen.gib == 32  # 48 - 16
    assert "cgroup limit 64.0 GiB leaves 48.0 GiB" in chosen.reason and chosen.short
    # A cgroup with more room than the host has: the host's MemAvailable counts.
    assert size_host_tier(host(40, limit=200, room=190), gpus=1).gib == 16
    # A cgroup already at its limit: off.
    assert size_host_tier(host(120, limit=64, room=0), gpus=1).gib == 0


def test_the_pinned_size_and_the_warning_for_a_size_set_by_hand() -> None:
    assert pinned_gib(40) == 64 and pinned_gib(31) == 32 and pinned_gib(64) == 64 and pinned_gib(0.5) == 0.5
    assert pinned_gib(40, power_of_two=False) == 40
    assert explicit_size_warning(40, host(120), gpus=1) is None  # pins 64 of 104
    warning = explicit_size_warning(70, host(120), gpus=1)  # pins 128
    assert warning is not None and "pins 128 GiB" in warning and "104.0 GiB" in warning
    assert explicit_size_warning(20, host(120, limit=40, room=30), gpus=1) is not None  # 32 > 30 - 16


# -- readers ------------------------------------------------------------------------------------

MEMINFO = """MemTotal:       131072000 kB
MemFree:        10000000 kB
MemAvailable:   125829120 kB
Buffers:          123456 kB
Cached:          4000000 kB
HugePages_Total:       0
Hugepagesize:       2048 kB
"""


def test_meminfo_is_read_in_bytes() -> None:
    values = parse_meminfo(MEMINFO)
    assert values["MemAvailable"] == 125829120 * 1024 == 120 * GIB
    assert values["MemTotal"] == 131072000 * 1024
    assert values["HugePages_Total"] == 0  # no unit: a count, as it is


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_host_memory_without_a_cgroup_limit(tmp_path: Path) -> None:
    meminfo = write(tmp_path / "meminfo", MEMINFO)
    proc_cgroup = write(tmp_path / "cgroup", "0::/\n")
    root = tmp_path / "sys"
    write(root / "memory.max", "max\n")
    write(root / "memory.current", str(3 * GIB))
    memory = read_host_memory(meminfo, proc_cgroup, root)
    assert memory == HostMemory(total=131072000 * 1024, available=120 * GIB)
    assert size_host_tier(memory, gpus=1).gib == 64


def test_cgroup_v2_limit_and_room_count_the_file_cache_as_room(tmp_path: Path) -> None:
    proc_cgroup = write(tmp_path / "cgroup", "0::/system.slice/worker.service\n")
    root = tmp_path / "sys"
    leaf = root / "system.slice" / "worker.service"
    write(leaf / "memory.max", str(64 * GIB))
    write(leaf / "memory.current", str(20 * GIB))
    write(leaf / "memory.stat", f"anon {12 * GIB}\nfile {8 * GIB}\nactive_file {3 * GIB}\ninactive_file {5 * GIB}\n")
    write(root / "system.slice" / "memory.max", "max\n")
    limit, room = read_cgroup_memory(proc_cgroup, root)
    assert limit == 64 * GIB and room == 52 * GIB  # 64 - 20 + 8 of page cache

    # A parent's tighter limit wins.
    write(root / "system.slice" / "memory.max", str(40 * GIB))
    write(root / "system.slice" / "memory.current", str(30 * GIB))
    limit, room = read_cgroup_memory(proc_cgroup, root)
    assert limit == 40 * GIB and room == 10 * GIB

    memory = read_host_memory(write(tmp_path / "meminfo", MEMINFO), proc_cgroup, root)
    assert memory.cgroup_room == 10 * GIB
    assert size_host_tier(memory, gpus=1).gib == 0  # 10 GiB of room is less than the reserve


def test_cgroup_v2_inside_a_container_reads_the_mount_root(tmp_path: Path) -> None:
    # The path /proc/self/cgroup names does not exist in the container's view: its root is it.
    proc_cgroup = write(tmp_path / "cgroup", "0::/kubepods/pod1/abc\n")
    root = tmp_path / "sys"
    write(root / "memory.max", str(48 * GIB))
    write(root / "memory.current", str(2 * GIB))
    assert read_cgroup_memory(proc_cgroup, root) == (48 * GIB, 46 * GIB)


def test_cgroup_v1_limit_and_its_unlimited_value(tmp_path: Path) -> None:
    proc_cgroup = write(tmp_path / "cgroup", "12:pids:/\n4:memory:/docker/abc\n0::/\n")
    root = tmp_path / "sys"
    memory_dir = root / "memory"
    write(memory_dir / "memory.limit_in_bytes", "9223372036854771712\n")  # no limit
    write(memory_dir / "memory.usage_in_bytes", str(5 * GIB))
    assert read_cgroup_memory(proc_cgroup, root) == (None, None)
    write(memory_dir / "memory.limit_in_bytes", str(32 * GIB))
    write(memory_dir / "memory.stat", f"cache {GIB}\ntotal_active_file {GIB}\ntotal_inactive_file {GIB}\n")
    assert read_cgroup_memory(proc_cgroup, root) == (32 * GIB, 29 * GIB)  # 32 - 5 + 2


def test_no_cgroup_information_means_no_limit(tmp_path: Path) -> None:
    assert read_cgroup_memory(tmp_path / "missing", tmp_path) == (None, None)
    proc_cgroup = write(tmp_path / "cgroup", "0::/\n")
    assert read_cgroup_memory(proc_cgroup, tmp_path / "nothing-mounted") == (None, None)


def test_this_machine_reads_without_error() -> None:
    memory = read_host_memory()
    assert 0 < memory.available <= memory.total
    assert memory.cgroup_room is None or 0 <= memory.cgroup_room <= (memory.cgroup_limit or 0)


def test_the_tier_is_pinned_by_threads_unless_the_operator_chose() -> None:
    from worker.engine.kvtier import pinning_alloc_conf

    assert pinning_alloc_conf(None, 16) == "pinned_use_cuda_host_register:True,pinned_num_register_threads:16"
    assert pinning_alloc_conf("expandable_segments:True", 12) == (
        "expandable_segments:True,pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
    )
    assert pinning_alloc_conf(None, 128).endswith(":16") and pinning_alloc_conf("", 1).endswith(":1")
    assert pinning_alloc_conf("pinned_num_register_threads:4", 16) is None  # the operator's choice stands
