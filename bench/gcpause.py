"""BENCH_GC=1: the garbage collector's pauses in every Python process of a benchmark run.

Each process (the worker's, the engine's, this one: raw AsyncLLM's) records its collections
(gc.callbacks: when, which generation, how long) and writes them to ``gc-<pid>.json`` in the
run's folder every 2 s: the worker ends without its interpreter's teardown, so nothing would
be written at its exit. The worker's processes load the recorder through
``bench/gcprobe/sitecustomize.py``, which ``enable`` puts on PYTHONPATH for every process
started after it. ``pauses`` sums a process's collections within a time window (a burst).

BENCH_GC_NOFREEZE=1 also makes ``gc.freeze`` do nothing in the worker's own process, for the
run against which the worker's freeze after its start is measured.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

OUT_ENV = "BENCH_GC_OUT"
PROBE_DIR = Path(__file__).resolve().parent / "gcprobe"
REPO = PROBE_DIR.parent.parent
DUMP_INTERVAL_S = 2.0
_local: Recorder | None = None  # this process's, once enable() was called


class Recorder:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.collections: list[tuple[float, int, float]] = []  # (time.time(), generation, ms)
        self._started = 0.0

    def callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            ms = (time.perf_counter() - self._started) * 1000
            self.collections.append((round(time.time(), 3), int(info["generation"]), round(ms, 3)))

    def dump(self) -> None:
        record = {"pid": os.getpid(), "argv": list(sys.orig_argv[:4]), "collections": self.collections}
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(record))
        temporary.replace(self.path)

    def dump_forever(self) -> None:
        while True:
            time.sleep(DUMP_INTERVAL_S)
            self.dump()


def install(out: Path) -> Recorder:
    recorder = Recorder(out / f"gc-{os.getpid()}.json")
    gc.callbacks.append(recorder.callback)
    threading.Thread(target=recorder.dump_forever, name="gc-recorder", daemon=True).start()
    return recorder


def install_from_env() -> None:
    """For sitecustomize: record where BENCH_GC_OUT is set; in the worker's own process, with
    BENCH_GC_NOFREEZE, leave its heap unfrozen."""
    out = os.environ.get(OUT_ENV)
    if not out:
        return
    install(Path(out))
    if os.environ.get("BENCH_GC_NOFREEZE") and is_worker(sys.orig_argv):
        gc.freeze = lambda: None


def is_worker(argv: list[str]) -> bool:
    """``python -m worker ...``: the worker's own process, not one it spawned."""
    return any(a == "-m" and b == "worker" for a, b in itertools.pairwise(argv))


def enable(out: Path) -> Recorder:
    """Record in this process and in every Python process started from now on."""
    global _local
    os.environ[OUT_ENV] = str(out)
    paths = [str(PROBE_DIR), str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    _local = install(out)
    return _local


def pauses(out: Path, window: tuple[float, float], worker: bool) -> dict[str, list[float]]:
    """Collections within ``window`` (time.time()) of the worker's own processes (``worker``)
    or of the benchmark's (raw AsyncLLM's): per generation, [count, total ms, longest ms]. A
    worker's last 2 s before its stop may be missing (its last write)."""
    if _local is not None:
        _local.dump()
    start, end = window
    result: dict[str, list[float]] = {}
    for path in sorted(out.glob("gc-*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        argv = record["argv"]
        if worker != is_worker(argv) or (not worker and "bench" not in argv):
            continue
        for when, generation, ms in record["collections"]:
            if start <= when <= end:
                count, total, longest = result.get(str(generation), [0, 0.0, 0.0])
                result[str(generation)] = [count + 1, round(total + ms, 1), round(max(longest, ms), 1)]
    return result


def recording() -> Path | None:
    """The run's folder where BENCH_GC recording is on (``enable`` was called), else None."""
    out = os.environ.get(OUT_ENV)
    return Path(out) if out and _local is not None else None
