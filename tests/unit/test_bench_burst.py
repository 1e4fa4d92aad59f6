"""The burst phases' arithmetic (bench/burst.py): tokens/s, TTFT, admission from the worker's
reply latencies, which burst sizes the KV cache holds, and the report; no engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.burst import (
    TEXT_SEED,
    Outcome,
    burst_markdown,
    burst_settings,
    burst_summary,
    fitting_sessions,
    raw_burst,
    raw_text_bursts,
    stream_every,
    worker_outcome,
)
from bench.common import Record, make_workload
from bench.mqtt_driver import MqttDriver
from bench.profiles import PROFILES


def test_a_burst_summary() -> None:
    outcomes = [Outcome(0.1 * (i + 1), 1.0 + i, 128, 300, admitted_s=0.01 * i) for i in range(10)]
    summary = burst_summary(outcomes, wall_s=10.0)
    assert summary["sessions"] == 10 and summary["completion_tokens"] == 1280
    assert summary["tok_per_s"] == 128.0
    assert summary["admission_s"] == 0.09  # the last request to reach the engine
    assert summary["ttft_p50_ms"] is not None and summary["ttft_p50_ms"] <= summary["ttft_p95_ms"]
    assert summary["prompt_tokens_mean"] == 300.0
    assert burst_summary([Outcome(None, 1.0, 5, 10)], wall_s=1.0)["admission_s"] is None


def test_a_worker_reply_reached_the_engine_after_its_queue() -> None:
    """The client's time to the reply less what the worker spent after handing it to the engine."""
    record = Record("b", 2, 0, 0, client_ms=2000.0, client_ttft_ms=600.0, worker_queue_ms=450.0, worker_total_ms=1950.0)
    outcome = worker_outcome(record)
    assert outcome.admitted_s == 0.5 and outcome.ttft_s == 0.6 and outcome.total_s == 2.0


def test_bursts_the_kv_cache_does_not_hold_are_not_run() -> None:
    assert fitting_sessions((320, 1000, 2000), 600_000, 428) == ([320, 1000], [2000])
    assert fitting_sessions((320, 1000, 2000), None, 428) == ([320, 1000, 2000], [])


REPORT_RUN = {"tok_per_s": 1000.0, "ttft_p50_ms": 1.0, "ttft_p95_ms": 2.0, "latency_p95_ms": 3.0, "admission_s": 0.1}


def test_the_report_puts_worker_and_raw_side_by_side(tmp_path: Path) -> None:
    run = dict(REPORT_RUN)
    results = {
        "new": {
            "runs": {"worker": {"320": {**run, "max_running": 320, "max_waiting": 0}}, "raw": {"320": run}},
            "worker_over_raw": {"320": 1.0},
            "limits_log": "max_num_seqs 1024 (hardware: ...)",
            "kv_cache_tokens": 600000,
            "sessions_skipped_kv_cache_too_small": [2000],
            "engine_log": "max_model_len=16384, ...",
        }
    }
    text = burst_markdown(results)
    assert "| new | 320 | worker | 1,000 | 1.0 ms | 2.0 ms | 3.0 ms | 0.1 s | 320 / 0 | 1.0 |" in text
    assert "| new | 320 | raw | 1,000 |" in text
    assert "not run (the KV cache does not hold them): [2000]" in text
    assert "streamed" not in text
    worker = results["new"]["runs"]["worker"]["320"]
    worker.update(streamed=80, ttft_end_p50_ms=500.0, ttft_end_p95_ms=700.0)
    text = burst_markdown(results)
    assert "  - new, 320 sessions: 80 streamed; the others' TTFT from the reply at its end: p50 500.0 ms" in text


def test_the_goal_without_the_host_tier_differs_from_the_goal_by_the_tier_alone() -> None:
    """Both sides of every burst get the settings: the worker as flags, raw AsyncLLM as
    EngineConfig fields; the sizes are the goal's."""
    goal, notier = PROFILES["gpu-goal"], PROFILES["gpu-goal-notier"]
    assert notier.burst_sessions_by_limits == goal.burst_sessions_by_limits == {"new": (320, 1000, 2000)}
    for name in goal.burst_limits:
        with_tier, without = (
            burst_settings(goal, goal.burst_limits[name]),
            burst_settings(notier, notier.burst_limits[name]),
        )
        assert "kv_offload_gib" not in with_tier  # the worker's default: sized from the host
        assert without == {**with_tier, "kv_offload_gib": 0}


def test_the_ttft_of_a_burst_with_streamed_sessions_is_theirs() -> None:
    """Streamed replies' TTFT is measured (the first delta); the others' is derived from the
    reply at its end, reported apart, and not mixed into the percentiles."""
    streamed = [Outcome(0.3, 2.0, 128, 300, streamed=True) for _ in range(4)]
    at_end = [Outcome(0.9, 2.0, 128, 300) for _ in range(12)]
    summary = burst_summary(streamed + at_end, wall_s=2.0)
    assert summary["ttft_p50_ms"] == summary["ttft_p95_ms"] == 300.0
    assert summary["streamed"] == 4
    assert summary["ttft_end_p50_ms"] == summary["ttft_end_p95_ms"] == 900.0
    plain = burst_summary(at_end, wall_s=2.0)
    assert plain["ttft_p50_ms"] == 900.0 and "streamed" not in plain and "ttft_end_p50_ms" not in plain
    record = Record("b", 2, 0, 0, client_ms=2000.0, client_ttft_ms=None, worker_ttft_ms=400.0, worker_total_ms=1900.0)
    assert not worker_outcome(record).streamed  # read at its end: 2,000 - (1,900 - 400) ms
    assert worker_outcome(record).ttft_s == 0.5


def test_every_nth_session_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    driver = MqttDriver.__new__(MqttDriver)  # no broker: only the payloads are built
    workload = make_workload(lambda text: len(text.split()), system_tokens=20, user_tokens=(5, 10))
    payloads = driver._payloads(workload, 8, 2, lambda text: len(text.split()), 16, False, None, stream_every=4)
    assert [payloads[(i, 0)]["stream"] for i in range(8)] == [True, False, False, False] * 2
    assert payloads[(4, 1)]["stream"] and not payloads[(5, 1)]["stream"]  # a session streams every turn
    assert not any(
        p["stream"] for p in driver._payloads(workload, 8, 1, lambda text: len(text.split()), 16, False, None).values()
    )
    assert all(
        p["stream"]
        for p in driver._payloads(
            workload, 8, 1, lambda text: len(text.split()), 16, True, None, stream_every=4
        ).values()
    )
    monkeypatch.setenv("BENCH_STREAM_EVERY", "4")
    assert stream_every() == 4
    monkeypatch.delenv("BENCH_STREAM_EVERY")
    assert stream_every() == 0
    monkeypatch.setenv("BENCH_STREAM_EVERY", "a quarter")
    with pytest.raises(SystemExit, match="BENCH_STREAM_EVERY"):
        stream_every()


def test_the_cpu_of_a_burst_is_each_processs_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """BENCH_CPU: a busy child shows about one core and this process's tree is found; without
    it nothing is taken. Real processes (a child that spins for the window)."""
    import subprocess
    import sys
    import time

    from bench.burst import cpu_snapshot, cpu_usage

    assert cpu_snapshot() is None and cpu_usage(None) is None
    monkeypatch.setenv("BENCH_CPU", "1")
    spin = "import time\nend = time.monotonic() + 1.5\nwhile time.monotonic() < end: pass\n"
    child = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.2)  # started, spinning
        before = cpu_snapshot()
        time.sleep(0.8)
        load = cpu_usage(before)
    finally:
        child.wait(30)
    assert load is not None
    mine = [p for name, p in load["processes"].items() if name.endswith(f"({child.pid})")]
    assert len(mine) == 1 and mine[0]["cores"] > 0.5, load
    assert mine[0]["cpus"]  # the CPU its thread last ran on
    text = burst_markdown(
        {
            "new": {
                "runs": {"worker": {"320": {**REPORT_RUN, "cpu": load}}, "raw": {}},
                "limits_log": "",
                "engine_log": "",
            }
        }
    )
    assert "- CPU during each burst (BENCH_CPU" in text and f"({child.pid}): " in text


def test_vllms_queue_and_prefill_are_legs_of_both_sides() -> None:
    """The reply's engineQueueMs and prefillMs (the worker's side) and vLLM's request stats
    (raw's) become the same legs, reported for each side where they exist."""
    record = Record(
        "b", 2, 0, 0, client_ms=2000.0, client_ttft_ms=None, worker_queue_ms=150.0, worker_ttft_ms=600.0,
        worker_total_ms=1950.0, engine_queue_ms=40.0, prefill_ms=300.0,
    )  # fmt: skip
    outcome = worker_outcome(record)
    assert outcome.engine_queue_s == 0.04 and outcome.prefill_s == 0.3
    assert worker_outcome(Record("b", 2, 0, 0, client_ms=10.0, client_ttft_ms=None)).engine_queue_s is None
    raw = [Outcome(0.2, 1.0, 8, 30, engine_queue_s=0.01 * i, prefill_s=0.1) for i in range(1, 11)]
    summary = burst_summary(raw, wall_s=1.0)
    assert summary["engine_queue_p50_ms"] == pytest.approx(55.0, abs=5.5) and summary["prefill_p95_ms"] == 100.0
    assert "engine_queue_p50_ms" not in burst_summary([Outcome(0.2, 1.0, 8, 30)], wall_s=1.0)
    run = {**REPORT_RUN, "engine_queue_p50_ms": 40.0, "engine_queue_p95_ms": 90.0, "prefill_p50_ms": 300.0}
    text = burst_markdown({"new": {"runs": {"worker": {"320": run}, "raw": {"320": dict(REPORT_RUN)}}}})
    assert "- Inside vLLM" in text
    assert "  - new, 320 sessions, worker: queue p50 40.0 ms, p95 90.0 ms; prefill p50 300.0 ms" in text
    assert "320 sessions, raw: queue" not in text  # raw's burst said nothing here


def test_raw_given_text_is_a_side_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """BENCH_RAW_TEXT: raw AsyncLLM's bursts again with text prompts, reported as a row of their
    own with the worker's tok/s over theirs, beside raw's given token ids."""
    monkeypatch.delenv("BENCH_RAW_TEXT", raising=False)
    assert not raw_text_bursts()
    monkeypatch.setenv("BENCH_RAW_TEXT", "1")
    assert raw_text_bursts()
    monkeypatch.setenv("BENCH_RAW_TEXT", "yes")
    with pytest.raises(SystemExit, match="BENCH_RAW_TEXT"):
        raw_text_bursts()
    assert TEXT_SEED > 2000  # its seeds (plus a size) are none of the sizes' or the warm-up's
    runs = {"worker": {"320": {**REPORT_RUN, "max_running": 320, "max_waiting": 0}}, "raw": {"320": dict(REPORT_RUN)}}
    runs["raw_text"] = {"320": {**REPORT_RUN, "tok_per_s": 800.0}}
    ratios = {"worker_over_raw": {"320": 1.0}, "worker_over_raw_text": {"320": 1.25}}
    text = burst_markdown({"new": {"runs": runs, **ratios}})
    assert "| new | 320 | raw | 1,000 | 1.0 ms | 2.0 ms | 3.0 ms | 0.1 s |  |  |" in text
    assert "| new | 320 | raw, text | 800 | 1.0 ms | 2.0 ms | 3.0 ms | 0.1 s |  | 1.25 |" in text
    assert "- `raw, text` (BENCH_RAW_TEXT)" in text
    assert "raw, text" not in burst_markdown({"new": {"runs": {k: runs[k] for k in ("worker", "raw")}}})


class _Piece:
    def __init__(self, ids: list[int]) -> None:
        self.token_ids = ids


class _Output:
    def __init__(self, prompt_ids: list[int], ids: list[int], finished: bool) -> None:
        self.prompt_token_ids, self.outputs, self.finished, self.metrics = prompt_ids, [_Piece(ids)], finished, None


class _TextLLM:
    """Stands in for AsyncLLM: what each request was given, and a prompt of one token per word."""

    def __init__(self) -> None:
        self.given: list[dict[str, object]] = []

    async def generate(self, prompt: dict[str, object], params: object, request_id: str):  # type: ignore[no-untyped-def]
        self.given.append(prompt)
        ids = prompt.get("prompt_token_ids") or [7] * len(str(prompt["prompt"]).split())
        yield _Output(list(ids), [1, 2], False)  # type: ignore[call-overload]
        yield _Output(list(ids), [3], True)  # type: ignore[call-overload]


def test_raw_takes_text_and_counts_the_prompt_as_vllm_tokenized_it() -> None:
    pytest.importorskip("vllm")
    import asyncio

    llm = _TextLLM()
    outcomes, _ = asyncio.run(raw_burst(llm, ["a b c", "d e"], 3))
    assert llm.given == [{"prompt": "a b c"}, {"prompt": "d e"}]
    assert [(o.prompt_tokens, o.completion_tokens) for o in outcomes] == [(3, 3), (2, 3)]
    outcomes, _ = asyncio.run(raw_burst(llm, [[5, 6, 7, 8]], 3))
    assert llm.given[-1] == {"prompt_token_ids": [5, 6, 7, 8]} and outcomes[0].prompt_tokens == 4
