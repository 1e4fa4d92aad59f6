"""The benchmark's think times and summaries (no engine, no broker)."""

from __future__ import annotations

from bench.common import Record, summarize, think_time


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
