"""bench/alternating.py: the worker and raw AsyncLLM taking turns burst by burst."""

from __future__ import annotations

from typing import Any

from bench.alternating import alternating_markdown, burst_seed, summarize_pairs, turns_order


def test_every_size_runs_on_both_sides_each_repeat_and_the_first_side_alternates() -> None:
    order = turns_order([320, 1000], 3)
    assert [(repeat, count) for repeat, count, _ in order] == [(r, n) for r in range(3) for n in (320, 1000)]
    assert [sides[0] for _, _, sides in order] == ["worker", "raw"] * 3
    assert all(sorted(sides) == ["raw", "worker"] for _, _, sides in order)
    # One size: the first side still alternates from repeat to repeat.
    assert [sides[0] for _, _, sides in turns_order([320], 4)] == ["worker", "raw", "worker", "raw"]
    # Three sides (raw read two ways): each goes first, second and last once in three groups.
    three = [sides for _, _, sides in turns_order([320], 3, ("worker", "raw", "raw_final"))]
    assert all(sorted(sides) == ["raw", "raw_final", "worker"] for sides in three)
    assert all(sorted(group[i] for group in three) == ["raw", "raw_final", "worker"] for i in range(3))


def test_no_two_bursts_share_their_messages() -> None:
    seeds = [burst_seed(count, repeat) for repeat in range(5) for count in (2, 320, 1000, 2000)]
    assert len(set(seeds)) == len(seeds) and 0 not in seeds  # 0: the warm-up's


def run(tok_per_s: float, p50: float, p95: float) -> dict[str, Any]:
    return {"tok_per_s": tok_per_s, "ttft_p50_ms": p50, "ttft_p95_ms": p95}


def test_each_repeat_gives_a_ratio_and_the_medians_summarize_them() -> None:
    runs = {
        "worker": {320: [run(900, 500, 700), run(1200, 400, 600), run(1000, 450, 650)]},
        "raw": {320: [run(1000, 420, 800), run(1000, 410, 790), run(1000, 400, 780)]},
    }
    summary = summarize_pairs(runs)[320]
    assert summary["worker_over_raw"] == [0.9, 1.2, 1.0] and summary["median_worker_over_raw"] == 1.0
    assert summary["worker_tok_per_s_median"] == 1000 and summary["raw_ttft_p50_ms_median"] == 410
    assert summary["worker_ttft_p95_ms_median"] == 650
    text = alternating_markdown(
        {"repeats": 3, "summary": {"320": summary}, "sessions_skipped_kv_cache_too_small": [2000]}
    )
    assert "| 320 | 0.9, 1.2, 1.0 | 1.0 | 1000 / 1000 | 450 / 410 ms | 650 / 790 ms |" in text
    assert "[2000]" in text


def test_a_raw_side_read_at_the_end_is_summarized_and_reported_beside_the_other() -> None:
    runs = {
        "worker": {320: [run(900, 500, 700), run(1100, 400, 600)]},
        "raw": {320: [run(1000, 420, 800), run(1000, 410, 790)]},
        "raw_final": {320: [run(1200, 400, 700), run(1100, 380, 690)]},
    }
    summary = summarize_pairs(runs)[320]
    assert summary["worker_over_raw"] == [0.9, 1.1] and summary["worker_over_raw_final"] == [0.75, 1.0]
    assert summary["raw_final_tok_per_s_median"] == 1150
    text = alternating_markdown({"repeats": 2, "summary": {"320": summary}})
    assert "every token as it comes" in text and "at its end" in text
    assert "| 320 | 0.75, 1.0 | 0.875 | 1000.0 / 1150.0 | 450.0 / 390.0 ms | 650.0 / 695.0 ms |" in text


def test_how_raw_reads_its_outputs_is_chosen_by_bench_raw_output(monkeypatch: Any) -> None:
    import pytest

    from bench.burst import raw_output_kinds

    monkeypatch.delenv("BENCH_RAW_OUTPUT", raising=False)
    assert raw_output_kinds() == ("delta",)  # every output, as every run before
    monkeypatch.setenv("BENCH_RAW_OUTPUT", "delta, final")
    assert raw_output_kinds() == ("delta", "final")
    monkeypatch.setenv("BENCH_RAW_OUTPUT", "")  # set empty: the default
    assert raw_output_kinds() == ("delta",)
    for bad in (",", "stream", "final,final"):
        monkeypatch.setenv("BENCH_RAW_OUTPUT", bad)
        with pytest.raises(SystemExit, match="BENCH_RAW_OUTPUT"):
            raw_output_kinds()
