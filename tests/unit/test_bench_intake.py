"""bench/intake.py's timeline and what-if settings, and the returning profile with an H100's KV
cache (bench/profiles.py): what the runs of docs/performance.md (Z2, Z3) stand on."""

from __future__ import annotations

import asyncio
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from bench import intake
from bench.profiles import PROFILES
from devtools.tinymodel import GEOMETRIES
from worker.core import service
from worker.engine import tokenizer
from worker.engine.limits import model_size_from_config


class _Service:
    def __init__(self) -> None:
        self.dispatched: list[Any] = []

    async def dispatch(self, message: Any) -> None:
        self.dispatched.append(message)


class _Renderer:
    """The parts of ChatTokenizer the timeline wraps: prepare, and its encoding batches."""

    def __init__(self) -> None:
        self._queued: list[str] = []
        self.started: list[list[str]] = []

    async def prepare(self, messages: Any, tools: Any = None) -> None:
        await asyncio.sleep(0)

    def _start_batch(self) -> None:
        self.started.append(self._queued)
        self._queued = []

    def _batch_done(self, parts: list[str], encoding: Any) -> None:
        pass


def test_the_timeline_records_every_stage_of_each_request() -> None:
    timeline, svc, renderer = intake.Timeline(), _Service(), _Renderer()
    timeline.attach(svc, renderer)
    started = intake.time.time()
    received = intake.time.monotonic()

    async def one(n: int) -> None:
        await svc.dispatch(SimpleNamespace(received_at=received, n=n))
        renderer._queued = [f"segment {n}", "x"]
        renderer._start_batch()
        await renderer.prepare([])
        renderer._batch_done(["a", "b"], None)

    async def run() -> None:
        await asyncio.gather(*(one(n) for n in range(5)))

    asyncio.run(run())
    assert [m.n for m in svc.dispatched] == list(range(5))  # the wrapped methods still run
    assert len(renderer.started) == 5
    summary = timeline.summary(started)
    marks_before = {stage: [*times] for stage, times in timeline.marks.items()}
    assert set(summary["stages_s"]) == {"received", "dispatched", "preparing", "prepared"}
    stages = summary["stages_s"]
    # received is paho's hand-over (the message's own time), before its dispatch began
    assert stages["received"]["q100"] <= stages["dispatched"]["q0"] + 0.001
    assert stages["preparing"]["q100"] <= stages["prepared"]["q100"]
    assert summary["encoding_batches"] == 5
    assert summary["batch_segments"]["q50"] == 2
    assert summary["batch_encode_ms"]["q0"] >= 0
    timeline.detach()  # the renderer outlives a round: its own methods again, no wrapper left
    assert not {"prepare", "_start_batch", "_batch_done"} & set(vars(renderer))
    assert "dispatch" not in vars(svc)
    asyncio.run(renderer.prepare([]))
    assert timeline.marks == marks_before  # nothing recorded after it


def test_a_start_that_queues_nothing_is_no_batch() -> None:
    timeline, renderer = intake.Timeline(), _Renderer()
    timeline.attach(_Service(), renderer)
    renderer._start_batch()  # nothing queued
    assert timeline.batches == []
    assert timeline.summary(0.0)["encoding_batches"] == 0


def test_quantiles_take_the_value_at_each_share() -> None:
    values = [float(v) for v in range(100, 0, -1)]
    q = intake._quantiles(values)
    assert q["q0"] == 1 and q["q50"] == 51 and q["q100"] == 100


def test_the_what_if_options_set_the_intakes_constants(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenizer, "ENCODE_BATCHES_IN_FLIGHT", tokenizer.ENCODE_BATCHES_IN_FLIGHT)
    monkeypatch.setattr(tokenizer, "ENCODE_BATCH_CHARS", tokenizer.ENCODE_BATCH_CHARS)
    monkeypatch.setattr(service, "DISPATCH_SLICE", service.DISPATCH_SLICE)
    switch = sys.getswitchinterval()
    try:
        args = SimpleNamespace(encode_in_flight=8, encode_batch_chars=4096, dispatch_slice=4, switch_ms=1.0)
        intake._what_if(args)  # type: ignore[arg-type]
        assert tokenizer.ENCODE_BATCHES_IN_FLIGHT == 8
        assert tokenizer.ENCODE_BATCH_CHARS == 4096
        assert service.DISPATCH_SLICE == 4
        assert sys.getswitchinterval() == pytest.approx(0.001)
    finally:
        sys.setswitchinterval(switch)


@pytest.mark.parametrize(
    "argv, problem",
    [
        (["--timeline"], "--timeline is recorded with --over-mqtt"),
        (["--to-engine", "m", "--over-mqtt", "--store", "both"], "one store"),
    ],
)
def test_options_that_measure_nothing_are_refused(
    argv: list[str], problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        intake.main(argv)
    assert exited.value.code == 2
    assert problem in capsys.readouterr().err


def test_the_returning_profile_holds_an_h100s_kv_cache() -> None:
    hidden, layers, heads, kv_heads, intermediate, vocab, tied = GEOMETRIES["qwq-32b"]
    config = {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": intermediate,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "torch_dtype": "bfloat16",
    }
    size = model_size_from_config(config)
    assert size is not None
    profile = PROFILES["gpu-returning-h100kv"]
    kv_bytes = profile.capacity_engine["extra"]["kv_cache_memory_bytes"]
    assert kv_bytes // size.kv_bytes_per_token == 44_576  # what the H100 runs' KV cache held
    # otherwise the returning runs' settings: the worker's default tier, the full-scale engine
    assert profile.capacity_offload_gib is None
    base = PROFILES["gpu-returning"].capacity_engine
    assert {k: v for k, v in profile.capacity_engine.items() if k != "extra"} == base
