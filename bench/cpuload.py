"""The CPU each process of a burst used, and how often the kernel took the CPU away from it
(BENCH_CPU=1, the burst phases): the worker and every process under it (vLLM's frontend
process, the engine core), the broker, and the benchmark's own process with its children (raw
AsyncLLM's engine core).

Why: on an H200 host the worker's engine generated the same 320 replies up to 0.6 s slower
than raw AsyncLLM's with the same engine arguments (docs/performance.md, runs Y1 and Y2), and
the worker's side runs five busy processes where raw's runs two. An engine core that waits for a
CPU shows it in its involuntary context switches and in its CPU time against the burst's wall.

Per process, over one burst: CPU seconds (user and system, its threads together), that over
the wall (cores busy), involuntary and voluntary context switches, and the CPUs its threads
were last seen on at the burst's end.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import psutil


@dataclasses.dataclass(frozen=True)
class Sample:
    name: str
    cpu_s: float
    involuntary: int
    voluntary: int


def enabled() -> bool:
    return os.environ.get("BENCH_CPU", "") not in ("", "0")


def process_name(process: psutil.Process) -> str:
    """A process as a reader tells them apart: vLLM's processes by their title (EngineCore,
    EngineFrontend), the worker and the benchmark by their module, else the program's name."""
    try:
        cmdline = process.cmdline()
        name = process.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "?"
    title = " ".join(cmdline)
    for known in ("EngineCore", "EngineFrontend"):
        if known in title or known in name:
            return known
    if "-m" in cmdline and cmdline.index("-m") + 1 < len(cmdline):
        return cmdline[cmdline.index("-m") + 1]
    return name


def tree(pids: list[int]) -> list[psutil.Process]:
    """These processes and every one under them, once each."""
    found: dict[int, psutil.Process] = {}
    for pid in pids:
        try:
            root = psutil.Process(pid)
            for process in [root, *root.children(recursive=True)]:
                found.setdefault(process.pid, process)
        except psutil.NoSuchProcess:
            continue
    return list(found.values())


def snapshot(pids: list[int]) -> tuple[float, dict[int, Sample]]:
    """(when, each process's counters so far) for these processes and their descendants."""
    out: dict[int, Sample] = {}
    for process in tree(pids):
        try:
            with process.oneshot():
                times = process.cpu_times()
                switches = process.num_ctx_switches()
                out[process.pid] = Sample(
                    process_name(process),
                    times.user + times.system,
                    switches.involuntary,
                    switches.voluntary,
                )
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return time.monotonic(), out


def cpus_in_use(pid: int) -> list[int]:
    """The CPUs this process's threads last ran on (Linux /proc/PID/task/*/stat, field 39)."""
    seen: set[int] = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            seen.add(int(fields[36]))  # field 39 of stat, counted after "pid (comm)"
        except (OSError, IndexError, ValueError):
            continue
    return sorted(seen)


def usage(before: tuple[float, dict[int, Sample]], after: tuple[float, dict[int, Sample]]) -> dict[str, Any]:
    """Each process's share of one burst (between two snapshots), by name; a process that
    started during it counts from zero."""
    wall = max(after[0] - before[0], 1e-9)
    out: dict[str, Any] = {"wall_s": round(wall, 3), "processes": {}}
    for pid, end in sorted(after[1].items()):
        start = before[1].get(pid, Sample(end.name, 0.0, 0, 0))
        cpu = end.cpu_s - start.cpu_s
        out["processes"][f"{end.name} ({pid})"] = {
            "cpu_s": round(cpu, 3),
            "cores": round(cpu / wall, 2),
            "involuntary_switches": end.involuntary - start.involuntary,
            "voluntary_switches": end.voluntary - start.voluntary,
            "cpus": cpus_in_use(pid),
        }
    return out


def words(load: dict[str, Any]) -> str:
    """One burst's CPU in one line: each process's cores busy and involuntary switches."""
    return "; ".join(
        f"{name}: {p['cores']} cores, {p['involuntary_switches']} involuntary" for name, p in load["processes"].items()
    )
