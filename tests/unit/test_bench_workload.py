"""The benchmark's think times, summaries and reply wait (no engine, no broker)."""

from __future__ import annotations

import json
import queue
import threading
import time
from pathlib import Path

import pytest

from bench.common import Record, summarize, think_time
from bench.mqtt_driver import MqttDriver


def test_no_think_time_means_no_pause() -> None:
    assert think_time(0.0, session=3, turn=1) == 0.0


def test_think_times_are_spread_and_the_same_for_every_driver() -> None:
    pauses = [think_time(1.0, session=s, turn=1) for s in range(100)]
    assert all(0.0 <= p <= 2.0 for p in pauses)
    # Spread over the range: sessions whose replies end together must not send together again.
    assert max(pauses) - min(pauses) > 1.5
    assert len(set(pauses)) == len(pauses)
    # The worker's driver and the in-process ceiling draw the same pause for a session's turn.
    assert pauses == [think_time(1.0, session=s, turn=1) for s in range(100)]
    assert think_time(1.0, session=0, turn=1) != think_time(1.0, session=0, turn=2)


def test_the_summary_separates_later_turns_time_to_first_token() -> None:
    records = [
        Record("worker", 2, session, turn, client_ms=100.0, client_ttft_ms=ttft, completion_tokens=10)
        for session, turn, ttft in ((0, 0, 50.0), (1, 0, 60.0), (0, 1, 500.0), (1, 1, 700.0))
    ]
    summary = summarize(records, wall_s=2.0)
    assert summary["p50_ttft_ms"] == 60.0
    assert summary["p50_ttft_later_turns_ms"] == 500.0
    assert summary["tokens_per_s"] == 20.0


def test_waiting_for_a_reply_gives_control_back_while_deltas_keep_arriving() -> None:
    # A session's next turn falls due while other sessions stream: the driver must return by
    # the due time to send it, not when the next whole reply happens to arrive.
    driver = MqttDriver.__new__(MqttDriver)  # no broker: only its inbox is used
    driver.events = queue.Queue()
    stop = threading.Event()

    def stream() -> None:
        # Then stops, so that a driver that misses its due time fails, not hangs.
        ends = time.perf_counter() + 30.0
        while not stop.is_set() and time.perf_counter() < ends:
            delta = json.dumps({"requestId": "other-t0", "delta": "x"}).encode()
            driver.events.put((time.perf_counter(), "chat/u/other/stream", delta))
            time.sleep(0.005)

    feeder = threading.Thread(target=stream)
    feeder.start()
    try:
        first_delta: dict[str, float] = {}
        started = time.perf_counter()
        with pytest.raises(queue.Empty):
            driver._wait_reply(first_delta, timeout=0.2)
        # Back after its 0.2 s, not when the stream stops (30 s): the bound leaves a loaded
        # machine 50 times the timeout.
        assert time.perf_counter() - started < 10.0
        assert "other-t0" in first_delta
    finally:
        stop.set()
        feeder.join()


def test_the_code_digest_names_the_code_not_the_checkout(tmp_path: Path) -> None:
    """A run's meta names its code by content (the GPU machine's tree may carry an old .git):
    the same files give the same digest wherever they lie; a changed line, a renamed file or a
    new module changes it; compiled files and other folders do not."""
    from bench.common import code_digest

    def tree(root: Path) -> Path:
        for name, text in {"worker/a.py": "x = 1\n", "bench/b.py": "y = 2\n", "devtools/c.py": ""}.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(text)
        return root

    first, second = tree(tmp_path / "one"), tree(tmp_path / "two")
    digest = code_digest(first)
    assert digest == code_digest(second)
    (second / "worker" / "__pycache__").mkdir()
    (second / "worker" / "__pycache__" / "a.py").write_text("cached")
    (second / "docs").mkdir()
    (second / "docs" / "d.py").write_text("z = 3\n")
    assert code_digest(second) == digest
    (second / "worker" / "a.py").write_text("x = 2\n")
    assert code_digest(second) != digest
    (second / "worker" / "a.py").write_text("x = 1\n")
    (second / "worker" / "a.py").rename(second / "worker" / "e.py")
    assert code_digest(second) != digest
    (second / "worker" / "e.py").rename(second / "worker" / "a.py")
    (second / "bench" / "f.py").write_text("")
    assert code_digest(second) != digest
