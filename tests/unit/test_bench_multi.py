"""The several-GPU benchmark's pieces that decide what it measures (bench/multigpu.py): which
workers each phase starts, and how a turn served without its history is recognised. The phases
themselves run end to end in scripts/test.sh (two CPU workers in one share group)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.common import Record
from bench.multigpu import turns_without_history, worker_commands
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
