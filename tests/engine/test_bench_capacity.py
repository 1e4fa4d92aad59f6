"""The benchmark's capacity phase (bench/capacity.py): its summary of returning turns, and the
phase end to end on the tiny model and the CPU engine with tiny numbers (no timing asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.capacity import returning_summary, sessions_held
from bench.common import Record
from devtools.mosquitto import mosquitto_binary


def record(session: int, turn: int, prompt: int, cached: int, completion: int = 10) -> Record:
    return Record(
        label="c",
        concurrency=2,
        session=session,
        turn=turn,
        client_ms=1000.0 + turn,
        client_ttft_ms=50.0 * (turn + 1),
        worker_ttft_ms=40.0,
        worker_total_ms=940.0,
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=completion,
    )


def test_sessions_held_counts_the_shared_system_prompt_once() -> None:
    assert sessions_held(8192, 1000, 800) == 8
    assert sessions_held(1000, 1000, 800) == 1  # never 0: one session always runs


def test_returning_turns_reuse_is_measured_against_the_previous_prompt_and_reply() -> None:
    records = [
        record(0, 0, prompt=1000, cached=0),
        record(0, 1, prompt=1200, cached=1010),  # all of turn 0's prompt and reply: 1.0
        record(1, 0, prompt=1000, cached=800),
        record(1, 1, prompt=1200, cached=505),  # half of it was evicted: 0.5
    ]
    summary = returning_summary(records, wall_s=2.0)
    assert summary["returning_turns"] == 2
    assert summary["prefix_reuse"] == 0.75
    assert summary["prompt_share_cached"] == round((1010 + 505) / 2400, 3)
    assert summary["recomputed_tokens_per_turn"] == (190 + 695) / 2
    assert summary["ttft_p50_ms"] == 100.0 and summary["latency_p95_ms"] == 1001.0
    assert summary["returning_tokens_per_s"] == 10.0  # the returning turns' 20 tokens over 2 s
    assert summary["decode_tok_per_s_p50"] == 10.0  # 9 tokens after the first in 0.9 s


def test_the_capacity_phase_runs_end_to_end_on_the_cpu(tiny_model: Path, tmp_path: Path) -> None:
    """The smoke profile: N capped at 3 sessions of 2 turns. The CPU backend has no host tier:
    the phase asks for one and the worker says it is off."""
    from bench.harness import main

    out = tmp_path / "capacity"
    phases = "capacity_offload,returning"
    args = ["--profile", "smoke", "--model", str(tiny_model), "--out", str(out), "--phases", phases]
    assert main([*args, "--mosquitto", mosquitto_binary()]) == 0
    result = json.loads((out / "capacity_offload.json").read_text())
    assert result["tier_log"] == "off (the CPU backend has none)"
    assert result["kv_cache_tokens"] > 0 and result["sessions_held"] >= 1
    assert len(result["bursts"]) == 3
    # Each burst sends new messages: it computes its messages, not only what an earlier burst left.
    assert all(b["prompt_tokens"] > b["cached_tokens"] for b in result["bursts"])
    assert set(result["runs"]) == {"1x", "3x"}
    for run in result["runs"].values():
        assert run["sessions"] == 3 and run["returning_turns"] == 3
        assert 0 < run["prefix_reuse"] <= 1 and run["ttft_p50_ms"] is not None
        tokens = run["engine_prompt_tokens"]
        assert tokens["host_hit"] == 0 and tokens["gpu_hit"] > 0 and tokens["computed"] > 0
    assert result["decode_batch1_tok_per_s"] is not None
    assert set(result["jit_compilations"]) == {"before_online", "after_online", "kernels_after_online"}
    report = (out / "capacity.md").read_text()
    assert "| 3x | 3 |" in report
    # Every session returns at once: all-resident first (what the cache holds, at most 4), then 4.
    returning = json.loads((out / "returning.json").read_text())
    assert returning["offload_gib"] == 0 and returning["resident_sessions"] == 4
    for label, run in returning["runs"].items():
        assert run["sessions"] == 4 and run["returning_turns"] == 4, label
        assert 0 < run["prefix_reuse"] <= 1 and run["round2_prompt_tokens"] > 0
        assert run["engine_prompt_tokens"]["gpu_hit"] > 0
    assert 0 < returning["share_of_resident"] <= 1.5
    assert "## returning" in report and "| all | 4 |" in report
