"""The vLLM adapter's structured-output mapping, with a stand-in for vLLM's AsyncLLM (the real
engine is exercised end to end in test_e2e.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams, StructuredOutputsParams

from worker.config.models import EngineConfig
from worker.engine.kvtier import GIB, HostMemory
from worker.engine.port import (
    EngineError,
    EngineInfo,
    EngineStats,
    EngineTimes,
    GenerationRequest,
    SamplingOptions,
    StructuredOutput,
    StructuredOutputRejected,
    WarmupPlan,
)
from worker.engine.vllm import (
    Host,
    VllmEngine,
    _SchedulerStatsRecorder,
    auto_kv_offload,
    engine_arguments,
    engine_times,
    kv_capacity_words,
    make_engine_args,
    precision_and_offload_args,
    structured_outputs_args,
    warmup_steps,
)

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}}


class StandInLLM:
    """Raises ``error`` from generate, or ends the request with ``finish_reason``."""

    def __init__(self, error: Exception | None = None, finish_reason: str = "stop") -> None:
        self.error = error
        self.finish_reason = finish_reason
        self.params: list[SamplingParams] = []

    async def generate(self, prompt: Any, params: SamplingParams, request_id: str) -> AsyncIterator[Any]:
        self.params.append(params)
        if self.error is not None:
            raise self.error
        completion = SimpleNamespace(token_ids=[], text="", finish_reason=self.finish_reason)
        yield SimpleNamespace(outputs=[completion], num_cached_tokens=0, finished=True)


def generate(llm: StandInLLM, structured: StructuredOutput | None) -> list[Any]:
    engine = VllmEngine(llm, EngineInfo("vllm", "x", "m", 128, 16, True), [7], EngineStats())
    request = GenerationRequest("r1", [1, 2, 3], SamplingOptions(8, 0.7, 0.95, (), structured))

    async def collect() -> list[Any]:
        return [update async for update in engine.generate(request)]

    return asyncio.run(collect())


def test_structured_output_becomes_structured_outputs_params() -> None:
    llm = StandInLLM()
    generate(llm, StructuredOutput(json_schema=SCHEMA))
    generate(llm, StructuredOutput())
    generate(llm, None)
    with_schema, json_object, free = (p.structured_outputs for p in llm.params)
    assert isinstance(with_schema, StructuredOutputsParams) and with_schema.json == SCHEMA
    assert isinstance(json_object, StructuredOutputsParams) and json_object.json_object is True
    assert free is None


def test_engine_refusals_of_a_schema_are_structured_output_rejected() -> None:
    refusal = VLLMValidationError("The provided JSON schema contains features not supported by xgrammar.")
    with pytest.raises(StructuredOutputRejected, match="xgrammar"):
        generate(StandInLLM(error=refusal), StructuredOutput(json_schema=SCHEMA))
    # The same kind of refusal of a free-text request is an ordinary engine error.
    with pytest.raises(EngineError) as err:
        generate(StandInLLM(error=VLLMValidationError("prompt is too long")), None)
    assert not isinstance(err.value, StructuredOutputRejected)
    # A grammar that fails to compile in the engine core ends the request with "error".
    with pytest.raises(StructuredOutputRejected, match="compile"):
        generate(StandInLLM(finish_reason="error"), StructuredOutput())


def test_a_request_read_only_at_its_end_asks_vllm_for_its_final_output_only() -> None:
    """FINAL_ONLY where the caller reads only the end, the admission needs no first tokens and
    vLLM keeps the request's times (the first token's time comes from them, on this
    process's monotonic clock); DELTA otherwise."""
    import time

    from vllm.sampling_params import RequestOutputKind

    from worker.engine.admission import Admission, admission_limits

    class TimedLLM(StandInLLM):
        log_stats = True

        async def generate(self, prompt: Any, params: SamplingParams, request_id: str) -> AsyncIterator[Any]:
            self.params.append(params)
            text = "a b c" if params.detokenize else ""  # vLLM writes no text without its detokenizer
            completion = SimpleNamespace(token_ids=[5, 6, 7], text=text, finish_reason="length")
            # vLLM's request stats: wall-clock arrival, and the first token 0.25 s after it.
            metrics = SimpleNamespace(arrival_time=time.time() - 1.0, first_token_latency=0.25)
            yield SimpleNamespace(outputs=[completion], num_cached_tokens=0, finished=True, metrics=metrics)

    class DecodingLLM(TimedLLM):
        """With vLLM's tokenizer: the worker decodes a reply read at its end itself."""

        tokenizer = SimpleNamespace(
            backend_tokenizer=SimpleNamespace(decode=lambda ids, skip_special_tokens: "|".join(map(str, ids)))
        )

    def run(
        llm: StandInLLM, incremental: bool, admission: Admission | None = None, stop: tuple[str, ...] = ()
    ) -> tuple[Any, Any]:
        engine = VllmEngine(llm, EngineInfo("vllm", "x", "m", 128, 16, True), [7], EngineStats(), admission=admission)
        request = GenerationRequest("u/s/1", [1, 2], SamplingOptions(8, 0.7, 0.95, stop), incremental=incremental)

        async def collect() -> list[Any]:
            return [update async for update in engine.generate(request)]

        before = time.monotonic()
        updates = asyncio.run(collect())
        return llm.params[-1].output_kind, (updates[-1], before)

    kind, (update, before) = run(TimedLLM(), incremental=False)
    assert kind == RequestOutputKind.FINAL_ONLY
    assert update.delta == "a b c" and update.token_ids == (5, 6, 7) and update.completion_tokens == 3
    assert update.first_token_at is not None and abs(update.first_token_at - (before - 0.75)) < 0.2
    assert run(TimedLLM(), incremental=True)[0] == RequestOutputKind.DELTA
    assert run(TimedLLM(), incremental=True)[1][0].first_token_at is None
    # The admission's prompt-token bound lets the next request in at a request's first token.
    waiting = Admission(admission_limits(8, waiting_tokens=100))
    assert run(TimedLLM(), incremental=False, admission=waiting)[0] == RequestOutputKind.DELTA
    assert run(TimedLLM(), incremental=False, admission=Admission(admission_limits(8)))[0] == (
        RequestOutputKind.FINAL_ONLY
    )
    # Without vLLM's request stats the first token's time would be the end's.
    assert run(StandInLLM(), incremental=False)[0] == RequestOutputKind.DELTA
    # With vLLM's tokenizer, a reply read at its end is decoded once from its ids, not by
    # vLLM's detokenizer token by token; stop strings need vLLM's, as does every output read.
    llm = DecodingLLM()
    assert run(llm, incremental=False)[1][0].delta == "5|6|7" and llm.params[-1].detokenize is False
    assert run(llm, incremental=False, stop=("END",))[1][0].delta == "a b c" and llm.params[-1].detokenize
    assert run(llm, incremental=True)[1][0].delta == "a b c" and llm.params[-1].detokenize
    assert run(TimedLLM(), incremental=False)[1][0].delta == "a b c"


def test_the_final_update_says_where_the_first_token_waited_in_the_engine() -> None:
    """vLLM's request stats (the engine core's monotonic timestamps): the queue is queued to
    first scheduled, the prefill first scheduled to first token; on the final update only, and
    nothing where the stats are missing or make no sense."""
    stats = SimpleNamespace(queued_ts=100.0, scheduled_ts=100.25, first_token_ts=100.75)
    assert engine_times(SimpleNamespace(metrics=stats)) == EngineTimes(queue_s=0.25, prefill_s=0.5)
    assert engine_times(SimpleNamespace(metrics=None)) is None  # log_stats off
    assert engine_times(SimpleNamespace()) is None  # a release without metrics
    not_scheduled = SimpleNamespace(queued_ts=100.0, scheduled_ts=0.0, first_token_ts=0.0)
    assert engine_times(SimpleNamespace(metrics=not_scheduled)) is None  # aborted while waiting
    backwards = SimpleNamespace(queued_ts=100.0, scheduled_ts=100.5, first_token_ts=100.2)
    assert engine_times(SimpleNamespace(metrics=backwards)) is None

    class StatsLLM(StandInLLM):
        async def generate(self, prompt: Any, params: SamplingParams, request_id: str) -> AsyncIterator[Any]:
            for finished in (False, True):
                completion = SimpleNamespace(token_ids=[5], text="a", finish_reason="length" if finished else None)
                yield SimpleNamespace(outputs=[completion], num_cached_tokens=0, finished=finished, metrics=stats)

    first, last = generate(StatsLLM(), None)
    assert first.engine_times is None and last.engine_times == EngineTimes(queue_s=0.25, prefill_s=0.5)


def test_weight_loading_bars_follow_vllm_level() -> None:
    """vLLM draws progress bars on stderr while it loads the weights: not when its log is quiet
    ([logging] vllm_level above INFO); engine.extra still decides when it names the key."""
    config = EngineConfig(model="m")
    assert "use_tqdm_on_load" not in engine_arguments(config)
    assert engine_arguments(config, progress_bars=False)["use_tqdm_on_load"] is False
    explicit = EngineConfig(model="m", extra={"use_tqdm_on_load": True})
    assert engine_arguments(explicit, progress_bars=False)["use_tqdm_on_load"] is True


def test_structured_outputs_engine_arguments(tiny_model: Path) -> None:
    default = structured_outputs_args({}, True)
    assert default == {"structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}}
    assert structured_outputs_args({}, False)["structured_outputs_config"]["disable_any_whitespace"] is False
    # engine.extra's keys win; whitespace control only where the backend supports it.
    user = {"structured_outputs_config": {"disable_any_whitespace": False, "enable_in_reasoning": True}}
    assert structured_outputs_args(user, True)["structured_outputs_config"] == {
        "backend": "xgrammar",
        "disable_any_whitespace": False,
        "enable_in_reasoning": True,
    }
    auto = structured_outputs_args({"structured_outputs_config": {"backend": "auto"}}, True)
    assert auto == {"structured_outputs_config": {"backend": "auto"}}
    args = make_engine_args({"model": str(tiny_model), **default})
    assert args.structured_outputs_config.backend == "xgrammar"
    assert args.structured_outputs_config.disable_any_whitespace is True


def test_is_alive_follows_vllms_engine_dead_flag() -> None:
    # AsyncLLM.errored turns true when vLLM's monitor sees the engine core process exit.
    llm = StandInLLM()
    llm.errored = False  # type: ignore[attr-defined]
    engine = VllmEngine(llm, EngineInfo("vllm", "x", "m", 128, 16, True), [7], EngineStats())
    assert engine.is_alive()
    llm.errored = True  # type: ignore[attr-defined]
    assert not engine.is_alive()


# -- precision, the host-memory KV tier, the warm-up's plan, the prompt-token sources --------

GPU_HOST = Host(cpu_backend=False, memory_gib=128.0, gpus=1)
CPU_HOST = Host(cpu_backend=True, memory_gib=24.0, gpus=1)


def test_the_host_tier_defaults_to_the_available_memory_on_gpus_and_off_on_the_cpu() -> None:
    # Without a reading of MemAvailable, the host's physical memory counts as available.
    assert auto_kv_offload(GPU_HOST, 1).gib == 64  # 128 - 25.6 = 102.4: 64 (capped)
    assert auto_kv_offload(Host(False, 1024.0, 8), 1).gib == 64  # (1024 - 204.8) / 8 = 102.4
    assert auto_kv_offload(Host(False, 256.0, 8), 1).gib == 16  # (256 - 51.2) / 8 = 25.6
    assert auto_kv_offload(Host(False, 64.0, 1), 1).gib == 32  # 64 - 16 = 48
    assert auto_kv_offload(Host(False, 16.0, 1), 1).gib == 0  # nothing left after the reserve
    # MemAvailable, read at start, is what counts: a busy 128 GiB host with 40 GiB available.
    busy = Host(False, 128.0, 1, memory=HostMemory(total=128 * GIB, available=40 * GIB))
    assert auto_kv_offload(busy, 1).gib == 16
    assert auto_kv_offload(CPU_HOST, 1).gib == 0


def test_the_start_says_in_one_line_why_the_tier_is_small_or_off() -> None:
    from loguru import logger

    lines: list[str] = []
    sink = logger.add(lines.append, format="{level} {message}")
    try:
        busy = Host(False, 128.0, 1, memory=HostMemory(total=128 * GIB, available=40 * GIB))
        assert precision_and_offload_args(EngineConfig(model="m"), busy)["kv_offloading_size"] == 16
        full = Host(False, 128.0, 1, memory=HostMemory(total=128 * GIB, available=10 * GIB))
        assert precision_and_offload_args(EngineConfig(model="m"), full) == {}
        roomy = Host(False, 128.0, 1, memory=HostMemory(total=128 * GIB, available=120 * GIB))
        assert precision_and_offload_args(EngineConfig(model="m"), roomy)["kv_offloading_size"] == 64
        assert precision_and_offload_args(EngineConfig(model="m", kv_offload_gib=70), roomy)["kv_offloading_size"] == 70
    finally:
        logger.remove(sink)
    small, off, normal, pins, explicit = lines
    assert small.startswith("WARNING KV offloading to host memory: 16 GiB, native backend (auto: MemAvailable 40.0 GiB")
    assert "memory short" in small
    assert off.startswith("WARNING KV offloading to host memory: off (auto: MemAvailable 10.0 GiB")
    assert "too little memory" in off
    assert normal.startswith("INFO KV offloading to host memory: 64 GiB, native backend (auto: MemAvailable 120.0 GiB")
    assert "reserve of 24.0 GiB" in normal and "leaves 96.0 GiB" in normal
    # A size set by hand wins; the worker warns when it pins more than the memory has room for.
    assert pins.startswith("WARNING kv_offload_gib=70 pins 128 GiB")
    assert explicit == "INFO KV offloading to host memory: 70 GiB, native backend (set)\n"


def test_the_kv_capacity_line_says_where_the_size_came_from() -> None:
    words = kv_capacity_words(
        49_008, 256 * 1024, kv_cache_memory_bytes=None, gpu_memory_utilization=0.93, startup_plan=False
    )
    assert words.startswith("11.96 GiB, vLLM's memory profile at gpu_memory_utilization 0.93")
    assert "startup plan" not in words
    plan = kv_capacity_words(None, None, kv_cache_memory_bytes=None, gpu_memory_utilization=0.9, startup_plan=True)
    assert plan.startswith("vLLM's memory profile") and "VLLM_ENABLE_STARTUP_PLAN=1" in plan
    fixed = kv_capacity_words(
        8192, 256 * 1024, kv_cache_memory_bytes=2 * GIB, gpu_memory_utilization=0.9, startup_plan=True
    )
    assert fixed == "2.00 GiB, kv_cache_memory_bytes=2.00 GiB set: no memory profile"


def test_precision_and_tier_become_engine_arguments_on_gpus(caplog: pytest.LogCaptureFixture) -> None:
    from worker.config.models import EngineConfig

    config = EngineConfig(model="m", quantization="fp8", kv_cache_dtype="fp8", kv_offload_gib=12.5)
    args = precision_and_offload_args(config, GPU_HOST)
    assert args == {
        "quantization": "fp8",
        "kv_cache_dtype": "fp8",
        "kv_offloading_size": 12.5,
        "kv_offloading_backend": "native",
    }
    assert set(args) <= {f.name for f in dataclasses.fields(AsyncEngineArgs)}  # names this vLLM accepts
    assert precision_and_offload_args(EngineConfig(model="m"), GPU_HOST) == {
        "kv_offloading_size": 64.0,
        "kv_offloading_backend": "native",
    }
    assert precision_and_offload_args(EngineConfig(model="m", kv_offload_gib=0), GPU_HOST) == {}


def test_the_tier_moves_blocks_of_its_own_size_unless_told_otherwise(tmp_path: Path) -> None:
    """256 tokens a transfer by default; 0 leaves vLLM's (one GPU block); LMCache and a
    kv_transfer_config of engine.extra's are left alone (that one reaches vLLM whole)."""
    from vllm.config import KVTransferConfig

    from worker.config.models import EngineConfig
    from worker.engine.vllm import engine_arguments, offload_block_args

    assert offload_block_args(EngineConfig(model="m", kv_offload_block_tokens=512))[
        "kv_transfer_config"
    ].kv_connector_extra_config == {"block_size": 512}
    assert offload_block_args(EngineConfig(model="m", kv_offload_block_tokens=0)) == {}
    assert offload_block_args(EngineConfig(model="m", kv_offload_backend="lmcache")) == {}
    own = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"a": 1}}
    assert offload_block_args(EngineConfig(model="m", extra={"kv_transfer_config": own})) == {}
    # A model with recurrent layers keeps vLLM's unit (its blocks are sized to its state),
    # unless the operator set one.
    model = tmp_path / "hybrid"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen3_next", "hidden_size": 2048}')
    assert offload_block_args(EngineConfig(model=str(model))) == {}
    chosen = offload_block_args(EngineConfig(model=str(model), kv_offload_block_tokens=1024))
    assert chosen["kv_transfer_config"].kv_connector_extra_config == {"block_size": 1024}
    # A set block_size that the default does not divide: vLLM's unit, as before the option.
    assert offload_block_args(EngineConfig(model="m", block_size=48)) == {}
    assert offload_block_args(EngineConfig(model="m", block_size=32))["kv_transfer_config"]
    # Through the whole adapter on a GPU host: the tier's blocks reach vLLM as its own type.
    kwargs = engine_arguments(EngineConfig(model="m", max_num_seqs=64, max_num_batched_tokens=4096), host=GPU_HOST)
    assert isinstance(kwargs["kv_transfer_config"], KVTransferConfig)
    assert kwargs["kv_transfer_config"].kv_connector_extra_config == {"block_size": 256}
    assert pickle.loads(pickle.dumps(kwargs["kv_transfer_config"])) == kwargs["kv_transfer_config"]  # spawned children
    assert kwargs["kv_transfer_config"].kv_connector == "OffloadingConnector" and kwargs["kv_offloading_size"] == 64.0
    # The tier off, or engine.extra's own connector (which reaches vLLM whole): nothing of ours.
    off = engine_arguments(EngineConfig(model="m", max_num_seqs=64, kv_offload_gib=0), host=GPU_HOST)
    assert "kv_transfer_config" not in off
    own_kwargs = engine_arguments(
        EngineConfig(model="m", max_num_seqs=64, extra={"kv_transfer_config": own}), host=GPU_HOST
    )
    assert own_kwargs["kv_transfer_config"] == own


def test_the_cpu_backend_leaves_out_what_it_lacks_and_says_so() -> None:
    from loguru import logger

    from worker.config.models import EngineConfig

    lines: list[str] = []
    sink = logger.add(lines.append, format="{level} {message}")
    try:
        config = EngineConfig(model="m", quantization="fp8", kv_cache_dtype="fp8", kv_offload_gib=4)
        assert precision_and_offload_args(config, CPU_HOST) == {}
        assert precision_and_offload_args(EngineConfig(model="m"), CPU_HOST) == {}
    finally:
        logger.remove(sink)
    text = "".join(lines)
    assert "WARNING quantization=fp8 is not used on the CPU backend" in text
    assert "WARNING kv_cache_dtype=fp8 is not used on the CPU backend" in text
    assert "WARNING kv_offload_gib=4: the CPU backend has no host-memory KV tier; off" in text
    assert "INFO KV offloading to host memory: off (the CPU backend keeps its KV cache in host memory" in text


def test_the_warm_up_covers_every_sampling_variant_batch_size_and_a_chunked_prompt() -> None:
    plan = WarmupPlan(mode="on", temperature=0.7, top_p=0.95)
    steps = warmup_steps(plan, max_batch=12, chunk_tokens=512, max_model_len=4096)
    default = [s.batch for s in steps if s.label == "default"]
    assert default == [1, 2, 4, 8, 12]
    assert all(s.sampling == ({"temperature": 0.7, "top_p": 0.95},) for s in steps if s.label == "default")
    for variant in ("greedy", "no_top_p", "mixed", "json"):
        assert sorted(s.batch for s in steps if s.label == variant) == [1, 12], variant
    mixed = next(s for s in steps if s.label == "mixed").sampling
    assert {p["top_p"] < 1 for p in mixed} == {True, False}  # top-p and plain rows in one batch
    long = [s for s in steps if s.prompt_tokens > 512]
    assert [s.label for s in long] == ["long_prompt", "cached_prefix"] and long[0].prompt_tokens == 768
    # A context shorter than the chunk: the long prompt still fits it.
    short = warmup_steps(plan, max_batch=1, chunk_tokens=2048, max_model_len=256)
    assert max(s.prompt_tokens for s in short) == 256 - 4 - 1


def test_the_warm_up_is_off_when_set_or_auto_on_the_cpu_backend() -> None:
    llm = StandInLLM()
    engine = VllmEngine(llm, EngineInfo("vllm", "x", "m", 128, 16, True), [7], EngineStats(), cpu_backend=True)
    for mode in ("off", "auto"):
        assert asyncio.run(engine.warm_up(WarmupPlan(mode=mode, temperature=0.7, top_p=0.95))) is None
    assert llm.params == []


def test_the_recorder_counts_prompt_tokens_by_source() -> None:
    stats = EngineStats()
    recorder = _SchedulerStatsRecorder(stats)
    tokens = SimpleNamespace(computed=100, local_cache_hit=400, external_kv_transfer=250)
    step = SimpleNamespace(prompt_token_stats=tokens)
    recorder.record(None, step)
    recorder.record(None, step)
    assert (stats.prompt_tokens_computed, stats.prompt_tokens_gpu_hit, stats.prompt_tokens_host_hit) == (200, 800, 500)
    recorder.record(None, SimpleNamespace())  # a release without the breakdown: nothing counted, no error
    assert stats.prompt_tokens_computed == 200


class WarmupLLM(StandInLLM):
    """A stand-in with what the warm-up reads of the engine's configuration; requests whose
    SamplingParams match ``fails`` end with finish_reason "error", as vLLM ends a request it
    terminates (vLLM 0.26: "grammar rejected tokens ... Terminating request")."""

    def __init__(self, fails: Any = lambda params: False) -> None:
        super().__init__()
        self.fails = fails
        self.vllm_config = SimpleNamespace(
            scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=64),
            model_config=SimpleNamespace(get_vocab_size=lambda: 1000),
        )

    async def generate(self, prompt: Any, params: SamplingParams, request_id: str) -> AsyncIterator[Any]:
        self.params.append(params)
        reason = "error" if self.fails(params) else "stop"
        completion = SimpleNamespace(token_ids=[], text="", finish_reason=reason)
        yield SimpleNamespace(outputs=[completion], num_cached_tokens=0, finished=True)


def warm_up(llm: WarmupLLM, lines: list[str], sampling: dict[str, Any] | None = None) -> dict[str, Any]:
    from loguru import logger

    engine = VllmEngine(llm, EngineInfo("vllm", "x", "m", 128, 16, True), [7, 8], EngineStats(), sampling=sampling)
    sink = logger.add(lines.append, format="{level} {message}", level="INFO")
    try:
        report = asyncio.run(engine.warm_up(WarmupPlan(mode="on", temperature=0.2, top_p=0.9)))
    finally:
        logger.remove(sink)
    assert report is not None
    return report


def test_the_warm_ups_structured_requests_may_end_and_stop_as_real_requests_do() -> None:
    """A JSON request is free to end once its JSON is complete: with ignore_eos the grammar,
    which then accepts only the end, made vLLM 0.26 terminate it with an ERROR line. Every
    request stops at the tokenizer's stop tokens, as real requests do; free text still runs
    every decode step (ignore_eos)."""
    llm = WarmupLLM()
    report = warm_up(llm, [])
    assert report["steps"] == report["planned"]
    structured = [p for p in llm.params if p.structured_outputs is not None]
    free = [p for p in llm.params if p.structured_outputs is None]
    assert structured and free
    assert not any(p.ignore_eos for p in structured)
    assert all(p.ignore_eos for p in free)
    assert all(set(p.stop_token_ids or []) >= {7, 8} for p in llm.params)
    # The sampling the worker uses by default (the model's, resolved at start) is what it warms.
    assert any(p.temperature == 0.2 and p.top_p == 0.9 for p in free)


def test_a_warm_up_step_whose_requests_failed_is_not_counted_as_done() -> None:
    llm = WarmupLLM(fails=lambda params: params.structured_outputs is not None)
    lines: list[str] = []
    report = warm_up(llm, lines)
    json_steps = 2  # the JSON variant at batch 1 and at the limit
    assert report["steps"] == report["planned"] - json_steps
    failed = [line for line in lines if line.startswith("WARNING Warm-up: step json")]
    assert len(failed) == json_steps and "ended with error" in failed[0], lines
    assert any(f"{report['steps']} of {report['planned']} steps" in line for line in lines)


def test_the_engine_wide_sampling_defaults_reach_every_request_and_the_warm_up() -> None:
    """The model's top_k, min_p and repetition_penalty (generation.engine_sampling): requests
    have no field for them; the warm-up warms the sampler with them."""
    llm = WarmupLLM()
    warm_up(llm, [], sampling={"top_k": 20, "repetition_penalty": 1.05})
    assert all(p.repetition_penalty == 1.05 for p in llm.params)
    assert all(p.top_k == 20 for p in llm.params if p.temperature > 0)  # vLLM: greedy drops top-k
    engine = VllmEngine(llm, EngineInfo("vllm", "x", "m", 128, 16, True), [7], EngineStats(), sampling={"min_p": 0.1})
    request = GenerationRequest("r1", [1, 2, 3], SamplingOptions(8, 0.5, 1.0))

    async def collect() -> list[Any]:
        return [update async for update in engine.generate(request)]

    asyncio.run(collect())
    assert llm.params[-1].min_p == 0.1 and llm.params[-1].temperature == 0.5


def test_the_engine_argument_names_read_from_vllms_source_are_its_dataclass_fields() -> None:
    """--check-config reads them without importing vLLM (worker/engine/vllm_args.py): the same
    names as AsyncEngineArgs' fields, and the same version."""
    import vllm

    from worker.engine.vllm_args import engine_argument_names, field_names, vllm_version

    assert engine_argument_names() == {field.name for field in dataclasses.fields(AsyncEngineArgs)}
    assert vllm_version() == vllm.__version__
    source = (
        "from typing import ClassVar\nfrom dataclasses import InitVar\n"
        "class EngineArgs:\n    a: int = 1\n    b: ClassVar[int] = 2\n    c: InitVar[int] = 3\n    d = 4\n"
        "    def f(self) -> None:\n        self.e: int = 5\n"
        "class AsyncEngineArgs(EngineArgs):\n    g: bool = False\nclass Other:\n    h: int = 0\n"
    )
    assert field_names(source) == {"a", "g"}
    assert field_names("class Elsewhere:\n    a: int = 1\n") == set()


@pytest.mark.parametrize("model", ["tiny_model", "real_model"])
def test_a_reply_decoded_at_its_end_is_the_text_vllms_detokenizer_writes(
    model: str, request: pytest.FixtureRequest
) -> None:
    """A reply read at its end without vLLM's incremental detokenizer (no stop strings) is
    decoded from its ids at once: the same text as vLLM's detokenizer, token by token, for
    random ids (special and added tokens, pieces of characters), a stop token at the end, and
    a character cut off by the length limit (SmolLM2's tokenizer has tokens of a space and a
    character's first byte: vLLM writes neither)."""
    import random
    import time

    from vllm.sampling_params import RequestOutputKind
    from vllm.tokenizers import get_tokenizer
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    from worker.engine.vllm import decoded_text, text_decoder

    tokenizer = get_tokenizer(str(request.getfixturevalue(model)))
    decode = text_decoder(SimpleNamespace(tokenizer=tokenizer))
    assert decode is not None
    vocab = len(tokenizer)
    special = sorted(set(tokenizer.all_special_ids))
    rng = random.Random(31)

    def vllm_text(ids: list[int], reason: str) -> str:
        params = SamplingParams(max_tokens=64, skip_special_tokens=True, output_kind=RequestOutputKind.FINAL_ONLY)
        request = EngineCoreRequest(
            request_id="r",
            prompt_token_ids=[1, 2, 3],
            mm_features=None,
            sampling_params=params,
            pooling_params=None,
            arrival_time=time.time(),
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
        )
        detokenizer = IncrementalDetokenizer.from_new_request(tokenizer, request)
        for i, token in enumerate(ids):
            detokenizer.update([token], reason == "stop" and i == len(ids) - 1)
        return detokenizer.get_next_output_text(True, False)

    texts = ["Hello, world! Ünïcödé 数字 🙂 emoji\n\n  spaces", "def f(x):\n    return x**2  # 🙂🙂 数字"]
    checked = 0
    for _ in range(200):
        ids = [rng.randrange(vocab) if rng.random() > 0.1 else rng.choice(special) for _ in range(rng.randint(1, 40))]
        # Or a real text cut anywhere: often inside a character, after a space in its token.
        cut = tokenizer.encode(rng.choice(texts), add_special_tokens=False)
        for case in (ids, cut[: rng.randint(1, len(cut))]):
            for reason in ("length", "stop", "abort"):
                assert decoded_text(decode, case, reason) == vllm_text(case, reason), (case, reason)
                checked += 1
    assert checked == 1200
    assert text_decoder(SimpleNamespace()) is None  # no tokenizer: vLLM detokenizes
