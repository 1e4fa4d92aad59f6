"""The several-GPU benchmark's pieces that decide what it measures (bench/multigpu.py): which
workers each phase starts, how a turn served without its history is recognised, and the burst
phases' arithmetic and report. The concurrency phases run end to end in scripts/test.sh (two CPU
workers in one share group)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from bench.clients import ClientResult, client_cpu, merge, merged_walls, split_sessions
from bench.common import Record, save
from bench.multigpu import (
    DEFAULT_BLOCK_SIZE,
    _burst_line,
    block_size_of,
    burst_comparison,
    burst_markdown,
    burst_turns_summary,
    gpu_list,
    positive_int,
    processed_by_worker,
    second_turn_cache,
    summarise_burst,
    turns_without_history,
    with_gpus,
    worker_commands,
    write_report,
)
from bench.profiles import PROFILES
from worker.config.loader import load_config


def flags(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_data_parallel_starts_one_worker_per_gpu_in_one_share_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/cache")
    workers = worker_commands("dp", PROFILES["gpu"], ["--model", "m"], tmp_path)
    assert [w[0] for w in workers] == ["bench-gpu0", "bench-gpu1"]
    assert [flags(args, "--visible-devices") for _, args, _ in workers] == ["0", "1"]
    assert {flags(args, "--share-group") for _, args, _ in workers} == {"bench"}
    assert len({flags(args, "--state-dir") for _, args, _ in workers}) == 2  # each its own store
    assert [env["VLLM_CACHE_ROOT"] for _, _, env in workers] == ["/cache/dp-gpu0", "/cache/dp-gpu1"]


def test_tensor_parallel_is_one_worker_over_the_gpus(tmp_path: Path) -> None:
    [(_, args, _)] = worker_commands("tp", PROFILES["gpu"], ["--model", "m"], tmp_path)
    assert flags(args, "--visible-devices") == "0,1" and flags(args, "--tensor-parallel-size") == "2"
    [(_, single, _)] = worker_commands("single", PROFILES["gpu"], ["--model", "m"], tmp_path)
    assert flags(single, "--visible-devices") == "0" and "--tensor-parallel-size" not in single


@pytest.mark.parametrize("phase", ["single", "tp", "dp"])
def test_the_worker_accepts_each_phases_flags(phase: str, tmp_path: Path) -> None:
    """What the phases pass is valid worker configuration."""
    for _, args, _ in worker_commands(phase, PROFILES["gpu"], ["--model", "m", *PROFILES["gpu"].worker_args], tmp_path):
        config, _ = load_config(args, environ={})
        assert config.engine.visible_devices == flags(args, "--visible-devices")


def record(session: int, turn: int, prompt: int, completion: int) -> Record:
    return Record("x", 1, session, turn, 1.0, None, prompt_tokens=prompt, completion_tokens=completion)


def test_a_turn_without_the_previous_prompt_and_reply_lacks_its_history() -> None:
    whole = [record(0, 0, 600, 128), record(0, 1, 900, 128), record(0, 2, 1200, 128)]
    assert turns_without_history(whole) == 0
    # Turn 1 served by a worker that never saw turn 0: its prompt is only the new message.
    # Turn 2 by the first worker again, which has turn 0 but not turn 1: not recognised (its
    # prompt is longer than turn 1's prompt and reply), so the count is a lower bound.
    partial = [record(1, 2, 890, 128), record(1, 0, 600, 128), record(1, 1, 160, 128)]
    assert turns_without_history(partial) == 1
    stale = [record(2, 0, 600, 128), record(2, 1, 900, 128), record(2, 2, 1000, 128)]
    assert turns_without_history(stale) == 1  # 1000 < 900 + 128: turn 1's reply is missing


# The burst phases (burst_single, burst_dp): two-turn bursts, the second turn's prefix-cache hit.


def turn(session: int, number: int, prompt: int, cached: int = 0, completion: int = 128) -> Record:
    return Record(
        "b",
        4,
        session,
        number,
        client_ms=1000.0 * (number + 1),
        client_ttft_ms=None,
        worker_queue_ms=10.0,
        worker_ttft_ms=200.0,
        worker_total_ms=900.0,
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=completion,
    )


def test_the_burst_phases_start_the_workers_of_single_and_dp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/cache")
    profile = with_gpus(PROFILES["gpu"], ("0", "1", "2", "3"))
    workers = worker_commands("burst_dp", profile, ["--model", "m"], tmp_path)
    assert [flags(args, "--visible-devices") for _, args, _ in workers] == ["0", "1", "2", "3"]
    assert {flags(args, "--share-group") for _, args, _ in workers} == {"bench"}
    # Their own stores, not dp's: a burst phase after dp in the same OUT starts empty.
    assert {flags(args, "--state-dir") for _, args, _ in workers}.isdisjoint(
        flags(args, "--state-dir") for _, args, _ in worker_commands("dp", profile, ["--model", "m"], tmp_path)
    )
    [(_, single, _)] = worker_commands("burst_single", profile, ["--model", "m"], tmp_path)
    assert flags(single, "--visible-devices") == "0" and "--share-group" not in single


def test_gpus_override_the_profiles_and_tensor_parallel_spans_them() -> None:
    assert gpu_list("0, 1,2,3") == ("0", "1", "2", "3")
    for bad in ("", "0,0", ","):
        with pytest.raises(argparse.ArgumentTypeError):
            gpu_list(bad)
    four = with_gpus(PROFILES["gpu"], ("0", "1", "2", "3"))
    assert four.gpus == ("0", "1", "2", "3") and four.tensor_parallel_size == 4
    assert with_gpus(PROFILES["smoke"], ("0", "1", "2")).tensor_parallel_size == 1  # the CPU engine splits nothing
    assert with_gpus(PROFILES["gpu"], None) is PROFILES["gpu"]


def test_the_block_size_comes_from_the_engine_line() -> None:
    log = "INFO Engine: max_model_len=4096, max_num_seqs=256, block_size=32, prefix caching on\n"
    assert block_size_of("Starting\n" + log) == 32
    assert block_size_of("no engine line") == DEFAULT_BLOCK_SIZE == 16


def test_a_second_turn_found_its_first_turn_when_its_whole_blocks_are_cached() -> None:
    records = [
        turn(0, 0, 300),
        turn(0, 1, 470, cached=288),  # 300 // 16 * 16 = 288: every whole block of turn 1's prompt
        turn(1, 0, 300),
        turn(1, 1, 470, cached=272),  # one block short: recomputed in part
        turn(2, 0, 300),
        turn(2, 1, 470, cached=0),
    ]
    cache = second_turn_cache(records, 16)
    assert cache["sessions"] == 3 and cache["block_size"] == 16
    assert cache["first_turn_found"] == round(1 / 3, 3)
    assert cache["cached_over_prompt_mean"] == round((288 + 272) / 470 / 3, 3)
    # The same replies with 32-token blocks: 300 // 32 * 32 = 288 still, 272 still short.
    assert second_turn_cache(records, 32)["first_turn_found"] == round(1 / 3, 3)
    assert second_turn_cache([], 16)["first_turn_found"] is None


def test_a_two_turn_burst_summary_per_turn_and_for_both() -> None:
    records = [turn(s, t, 300 if t == 0 else 470, cached=288 * t) for s in range(4) for t in range(2)]
    summary = burst_turns_summary(records, [2.0, 0.5], 16)
    assert summary["turn1"]["tok_per_s"] == 4 * 128 / 2.0 and summary["turn2"]["tok_per_s"] == 4 * 128 / 0.5
    assert summary["both"] == {"tok_per_s": round(8 * 128 / 2.5, 1), "completion_tokens": 1024, "wall_s": 2.5}
    # Without stream deltas: the client's time to the reply less the worker's from its first token on.
    assert summary["turn1"]["ttft_p50_ms"] == 1000.0 - (900.0 - 200.0)
    assert summary["cache"]["first_turn_found"] == 1.0 and summary["turns_without_history"] == 0
    # A second turn that came without its history: its prompt is the new message alone.
    lost = burst_turns_summary([turn(0, 0, 300), turn(0, 1, 60)], [1.0, 1.0], 16)
    assert lost["turns_without_history"] == 1 and lost["cache"]["first_turn_found"] == 0.0


def test_each_workers_requests_from_its_latest_stats() -> None:
    stats = [
        {"workerId": "bench-gpu0", "processed": 4},
        {"workerId": "bench-gpu1", "processed": 3},
        {"workerId": "bench-gpu0", "processed": 9},
        {"workerId": "bench-gpu2"},
    ]
    assert processed_by_worker(stats) == {"bench-gpu0": 9, "bench-gpu1": 3}


def burst_result(phase: str, tok_per_s: float, workers: list[str]) -> dict[str, Any]:
    records = [turn(s, t, 300 if t == 0 else 470, cached=288 * t) for s in range(8) for t in range(2)]
    summary = burst_turns_summary(records, [8 * 128 / tok_per_s, 8 * 128 / (2 * tok_per_s)], 16)
    summary["processed"] = {w: 16 // len(workers) for w in workers}
    summary["records"] = [[1, 2, 3]]
    info = {w: {"args": ["--visible-devices", w[-1]], "start_to_ready_s": 50.0, "processed": 20} for w in workers}
    return {
        "phase": phase,
        "workers": info,
        "block_size": 16,
        "prompt_tokens": 300,
        "max_tokens": 128,
        "followup_tokens": 32,
        "engine_log": "block_size=16",
        "bursts": {"1000": summary},
    }


def test_the_report_puts_dp_beside_single_per_session_count() -> None:
    results = {
        "burst_single": burst_result("burst_single", 10_000.0, ["bench"]),
        "burst_dp": burst_result("burst_dp", 38_000.0, ["bench-gpu0", "bench-gpu1", "bench-gpu2", "bench-gpu3"]),
    }
    compared = burst_comparison(results)
    row = compared["sessions"]["1000"]
    assert row["dp_over_single"] == {"turn1": 3.8, "turn2": 3.8, "both": 3.8}
    assert "records" not in row["burst_dp"]  # multi.json keeps the summaries, the phase files the records
    text = "\n".join(burst_markdown(compared))
    assert "### 1000 sessions" in text
    assert "| tokens/s, turn 1 | 10,000 | 38,000 | 3.8x |" in text
    assert "| tokens/s, both turns | 13,333 | 50,667 | 3.8x |" in text  # 2 x 1024 tokens over 1.5 walls
    assert "| turn 2: sessions that found turn 1 in the prefix cache | 1.0 | 1.0 |  |" in text
    assert "| requests per worker | 16 | 4, 4, 4, 4 |  |" in text
    # One phase alone (dp not run yet): its column, no ratio.
    alone = burst_comparison({"burst_single": results["burst_single"]})
    assert "dp_over_single" not in alone["sessions"]["1000"]
    assert "| tokens/s, turn 1 | 10,000 |  |" in "\n".join(burst_markdown(alone))


def test_multi_md_has_the_burst_tables_beside_the_concurrency_runs(tmp_path: Path) -> None:
    save(tmp_path / "burst_single.json", burst_result("burst_single", 10_000.0, ["bench"]))
    save(tmp_path / "burst_dp.json", burst_result("burst_dp", 20_000.0, ["bench-gpu0", "bench-gpu1"]))
    result = write_report(tmp_path)
    assert result["bursts"]["sessions"]["1000"]["dp_over_single"]["both"] == 2.0
    text = (tmp_path / "multi.md").read_text()
    assert "## Bursts: one worker against one worker per GPU" in text and "| tokens/s, turn 2 |" in text
    assert "Concurrency runs" not in text  # no such phase ran


# Several benchmark clients (--clients K, bench/clients.py): each burst's sessions split over K
# processes, their replies and rounds merged into one burst.


def test_a_bursts_sessions_are_split_over_the_clients_in_consecutive_ranges() -> None:
    assert split_sessions(1000, 1) == [(0, 1000)]
    assert split_sessions(1000, 4) == [(0, 250), (250, 250), (500, 250), (750, 250)]
    assert split_sessions(10, 4) == [(0, 3), (3, 3), (6, 2), (8, 2)]
    # Every session once: the session numbers (the messages, the records) whatever K is.
    for sessions, clients in ((64, 3), (7, 7), (2, 4), (0, 2)):
        parts = split_sessions(sessions, clients)
        assert [i for first, count in parts for i in range(first, first + count)] == list(range(sessions))
    assert split_sessions(2, 4)[2:] == [(2, 0), (2, 0)]  # more clients than sessions: some get none
    with pytest.raises(ValueError, match="at least 1"):
        split_sessions(10, 0)


def client_result(first: int, count: int, spans: list[tuple[float, float]], cpu_s: float) -> ClientResult:
    sessions = range(first, first + count)
    records = [turn(s, t, 300 if t == 0 else 470, cached=288 * t) for t in range(2) for s in sessions]
    return ClientResult(records, spans, cpu_s)


def test_the_clients_rounds_merge_from_the_first_send_in_any_to_the_last_reply_in_any() -> None:
    a = client_result(0, 2, [(100.0, 102.0), (102.5, 103.0)], cpu_s=0.5)
    b = client_result(2, 2, [(100.1, 102.4), (102.6, 103.5)], cpu_s=1.0)
    idle = ClientResult([], [(90.0, 90.0), (200.0, 200.0)], cpu_s=0.01)  # no sessions: no part in the walls
    assert merged_walls([a, b, idle]) == pytest.approx([2.4, 1.0])
    records, walls, cores = merge([a, b, idle])
    assert sorted((r.session, r.turn) for r in records) == [(s, t) for s in range(4) for t in range(2)]
    assert walls == pytest.approx([2.4, 1.0])
    assert cores == [round(0.5 / 3.4, 2), round(1.0 / 3.4, 2), 0.0]  # CPU time over both merged walls
    # One client: its own walls, as the burst phases measured before there were several.
    assert merged_walls([a]) == pytest.approx([2.0, 0.5])


def test_the_merged_burst_is_summarised_as_one_with_every_clients_cpu() -> None:
    a = client_result(0, 4, [(0.0, 2.0), (2.0, 2.5)], cpu_s=1.25)
    b = client_result(4, 4, [(0.0, 1.5), (2.0, 2.4)], cpu_s=2.5)
    summary, records = summarise_burst([a, b], 16)
    assert len(records) == 16
    assert summary["turn1"]["tok_per_s"] == 8 * 128 / 2.0 and summary["turn2"]["tok_per_s"] == 8 * 128 / 0.5
    # Sessions keep their numbers across clients: each second turn is matched with its first.
    assert summary["cache"]["sessions"] == 8 and summary["cache"]["first_turn_found"] == 1.0
    assert summary["turns_without_history"] == 0
    assert summary["clients"] == 2 and summary["client_cpu_cores_per_client"] == [0.5, 1.0]
    assert summary["client_cpu_cores"] == 1.5 and summary["client_cpu_cores_max"] == 1.0


def test_the_report_gives_the_clients_and_their_cpu() -> None:
    single = burst_result("burst_single", 10_000.0, ["bench"])
    single["bursts"]["1000"].update(client_cpu([0.26]))
    dp = burst_result("burst_dp", 38_000.0, ["bench-gpu0", "bench-gpu1", "bench-gpu2", "bench-gpu3"])
    dp["bursts"]["1000"].update(client_cpu([0.4, 0.45, 0.38, 0.41]))
    text = "\n".join(burst_markdown(burst_comparison({"burst_single": single, "burst_dp": dp})))
    assert "| benchmark clients | 1 | 4 |  |" in text
    assert "| client CPU, all clients (cores) | 0.26 | 1.64 |  |" in text
    assert "| client CPU, busiest client (cores) | 0.26 | 0.45 |  |" in text
    assert "4 clients: CPU 1.64 cores, busiest client 0.45" in _burst_line(dp["bursts"]["1000"])
    # A result from before several clients: one client, the busiest is it.
    old = burst_result("burst_single", 10_000.0, ["bench"])
    old["bursts"]["1000"]["client_cpu_cores"] = 1.15
    text = "\n".join(burst_markdown(burst_comparison({"burst_single": old})))
    assert "| benchmark clients | 1 |  |" in text and "| client CPU, busiest client (cores) | 1.15 |  |" in text


def test_clients_is_a_whole_number_of_at_least_one() -> None:
    assert positive_int("4") == 4
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_int(bad)
