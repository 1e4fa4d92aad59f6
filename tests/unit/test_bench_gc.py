"""bench/gcpause.py: the garbage collector's pauses per burst (BENCH_GC)."""

from __future__ import annotations

import gc
import json
from pathlib import Path

from bench import gcpause


def test_a_recorder_notes_each_collection_with_its_generation(tmp_path: Path) -> None:
    recorder = gcpause.Recorder(tmp_path / "gc-1.json")
    gc.callbacks.append(recorder.callback)
    try:
        gc.collect(0)
        gc.collect(2)
    finally:
        gc.callbacks.remove(recorder.callback)
    assert [generation for _, generation, _ in recorder.collections][-2:] == [0, 2]
    assert all(ms >= 0 for _, _, ms in recorder.collections)
    recorder.dump()
    assert json.loads((tmp_path / "gc-1.json").read_text())["collections"] == [list(c) for c in recorder.collections]


def test_pauses_sum_one_sides_collections_within_the_window(tmp_path: Path) -> None:
    worker = ["/usr/bin/python3", "-m", "worker", "--model"]
    engine = ["/usr/bin/python3", "-c", "from multiprocessing.spawn import spawn_main"]
    bench = ["/usr/bin/python3", "-m", "bench", "--profile"]
    files = {
        "gc-10.json": (worker, [[100.0, 0, 1.0], [101.0, 2, 300.0], [102.0, 2, 200.0], [200.0, 2, 900.0]]),
        "gc-11.json": (engine, [[101.0, 2, 5000.0]]),
        "gc-12.json": (bench, [[101.0, 1, 4.0], [101.5, 1, 6.0]]),
        "gc-13.json": (worker, [[150.0, 0, 2.0]]),  # a later worker of the run
    }
    for name, (argv, collections) in files.items():
        (tmp_path / name).write_text(json.dumps({"pid": 1, "argv": argv, "collections": collections}))
    (tmp_path / "gc-14.json").write_text("{cut off")  # a write in progress is skipped
    assert gcpause.pauses(tmp_path, (100.5, 102.0), worker=True) == {"2": [2, 500.0, 300.0]}
    assert gcpause.pauses(tmp_path, (99.0, 160.0), worker=True) == {"0": [2, 3.0, 2.0], "2": [2, 500.0, 300.0]}
    assert gcpause.pauses(tmp_path, (100.5, 102.0), worker=False) == {"1": [2, 10.0, 6.0]}
    assert gcpause.pauses(tmp_path, (300.0, 400.0), worker=True) == {}


def test_only_the_workers_own_process_counts_as_the_worker() -> None:
    assert gcpause.is_worker(["python", "-m", "worker", "--model", "m"])
    assert not gcpause.is_worker(["python", "-c", "from multiprocessing.spawn import spawn_main"])
    assert not gcpause.is_worker(["python", "-m", "bench", "worker"])
