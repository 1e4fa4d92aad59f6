"""Engine limits and the parallelism plan as functions of the hardware and the model
(worker/engine/limits.py), on made-up GPUs; the "Engine:" start line from a fake resolved
vLLM configuration (worker/engine/vllm.py engine_words)."""

from __future__ import annotations

import enum
from types import SimpleNamespace
from typing import Any

import pytest

from worker.engine.limits import (
    GIB,
    Gpu,
    ModelSize,
    choose_limits,
    estimated_kv_tokens,
    limits_words,
    model_size_from_config,
    parallelism_plan,
    pending_limit_short,
    serve_row,
    visible_devices,
)

H100 = Gpu("NVIDIA H100 80GB HBM3", int(79.6 * GIB))
H200 = Gpu("NVIDIA H200", int(139.8 * GIB))
B200 = Gpu("NVIDIA B200", int(178 * GIB))
A100 = Gpu("NVIDIA A100-SXM4-80GB", int(79.3 * GIB))
L40S = Gpu("NVIDIA L40S", int(44.5 * GIB))


def geometry(hidden: int, layers: int, heads: int, kv: int, inter: int, vocab: int, tied: bool) -> dict[str, Any]:
    return {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "intermediate_size": inter,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "torch_dtype": "bfloat16",
    }


def size(config: dict[str, Any], **kw: Any) -> ModelSize:
    model = model_size_from_config(config, **kw)
    assert model is not None
    return model


TWO_B = size(geometry(2048, 28, 16, 8, 6144, 151936, True))  # the 2B geometry
HALF_B = size(geometry(896, 24, 14, 2, 4864, 151936, True))  # Qwen2.5-0.5B
QWQ_32B = size(geometry(5120, 64, 40, 8, 27648, 152064, False))
SESSION = 2256  # max_history_tokens 2000 + max_tokens 256


def test_model_sizes_from_the_geometry() -> None:
    # 1.72 B parameters in bf16; 2 x 28 layers x 8 KV heads x 128 x 2 bytes per token.
    assert TWO_B.kv_bytes_per_token == 114_688
    assert 3.1 * GIB < TWO_B.weight_bytes < 3.3 * GIB
    assert QWQ_32B.kv_bytes_per_token == 256 * 1024
    assert 60 * GIB < QWQ_32B.weight_bytes < 62 * GIB  # 32.76 B parameters
    fp8 = size(geometry(5120, 64, 40, 8, 27648, 152064, False), quantization="fp8", kv_cache_dtype="fp8")
    assert fp8.weight_bytes == QWQ_32B.weight_bytes // 2 and fp8.kv_bytes_per_token == 128 * 1024
    # Experts or a config without sizes: unknown, not guessed.
    assert model_size_from_config({**geometry(2048, 28, 16, 8, 6144, 151936, True), "num_experts": 64}) is None
    assert model_size_from_config({"model_type": "x"}) is None
    # A multimodal model's text part.
    assert model_size_from_config({"text_config": geometry(2048, 28, 16, 8, 6144, 151936, True)}) == TWO_B


@pytest.mark.parametrize(
    ("gpu", "row"),
    [(H100, (1024, 8192)), (H200, (1024, 8192)), (B200, (1024, 16384)), (A100, (256, 2048)), (L40S, (256, 2048))],
)
def test_vllm_serves_row_per_gpu(gpu: Gpu, row: tuple[int, int]) -> None:
    assert serve_row(gpu)[:2] == row


def test_a_2b_model_on_an_h100_gets_vllm_serves_1024_and_8192() -> None:
    """~600k tokens of KV cache hold ~270 full sessions: no more than vllm serve's row."""
    chosen = choose_limits(H100, TWO_B, session_tokens=SESSION)
    assert (chosen.max_num_seqs.value, chosen.max_num_batched_tokens.value) == (1024, 8192)
    assert chosen.max_num_seqs.source == chosen.max_num_batched_tokens.source == "hardware"
    assert chosen.kv_tokens_estimate is not None and 550_000 < chosen.kv_tokens_estimate < 650_000
    words = limits_words(chosen)
    assert "max_num_seqs 1024 (hardware: vllm serve's for NVIDIA H100 80GB HBM3, 80 GiB" in words
    assert "max_num_batched_tokens 8192 (hardware" in words
    assert chosen.engine_arguments() == {"max_num_seqs": 1024, "max_num_batched_tokens": 8192}


def test_more_sequences_where_the_kv_cache_holds_more_sessions() -> None:
    """A 0.5B on an H100: ~5.8M tokens hold ~2,600 full sessions: 2048 seqs (a power of two),
    the token budget stays the row's."""
    chosen = choose_limits(H100, HALF_B, session_tokens=SESSION)
    assert chosen.max_num_seqs.value == 2048 and chosen.max_num_seqs.source == "model"
    assert "sessions of 2256 tokens" in chosen.max_num_seqs.reason
    assert chosen.max_num_batched_tokens.value == 8192
    # Shorter sessions: more of them fit, capped at 4x the row (4096).
    assert choose_limits(H100, HALF_B, session_tokens=500).max_num_seqs.value == 4096
    # On an A100 the row is 256: at most 1024, and max_num_batched_tokens at least that.
    a100 = choose_limits(A100, HALF_B, session_tokens=SESSION)
    assert a100.max_num_seqs.value == 1024
    assert a100.max_num_batched_tokens.value == 2048
    big = choose_limits(A100, HALF_B, session_tokens=100)
    assert big.max_num_seqs.value == 1024 and big.max_num_batched_tokens.value == 2048


def test_never_below_vllm_serve_and_a_set_kv_cache_size_counts() -> None:
    # QwQ-32B on one H100: little KV cache, still the row (vllm serve's own choice there).
    chosen = choose_limits(H100, QWQ_32B, session_tokens=SESSION)
    assert chosen.max_num_seqs.value == 1024
    # A 0.5B with a 2 GiB KV cache set (engine.extra kv_cache_memory_bytes): 175k tokens, no raise.
    small = choose_limits(H100, HALF_B, session_tokens=SESSION, kv_cache_memory_bytes=2 * GIB)
    assert small.max_num_seqs.value == 1024 and small.kv_tokens_estimate == 2 * GIB // HALF_B.kv_bytes_per_token
    # A lower gpu_memory_utilization leaves less KV cache.
    assert estimated_kv_tokens(H100, HALF_B, gpu_memory_utilization=0.3) < estimated_kv_tokens(H100, HALF_B)
    # Unknown model size (a hub id): the row.
    assert choose_limits(H100, None, session_tokens=SESSION).max_num_seqs.value == 1024


def test_tensor_parallel_counts_every_gpu_of_the_group() -> None:
    one = estimated_kv_tokens(H100, QWQ_32B)
    two = estimated_kv_tokens(H100, QWQ_32B, tensor_parallel_size=2)
    assert two > 2 * one  # the weights are paid once over both


def test_configured_values_win() -> None:
    chosen = choose_limits(H100, HALF_B, session_tokens=SESSION, configured_seqs=128, configured_tokens=2048)
    assert (chosen.max_num_seqs.value, chosen.max_num_batched_tokens.value) == (128, 2048)
    assert chosen.max_num_seqs.source == chosen.max_num_batched_tokens.source == "configuration"
    # Only the seqs set: the token budget at least as many.
    seqs_only = choose_limits(H100, TWO_B, session_tokens=SESSION, configured_seqs=16384)
    assert seqs_only.max_num_batched_tokens.value == 16384
    # Only the tokens set, below the chosen seqs: vLLM refuses fewer tokens than seqs.
    tokens_only = choose_limits(H100, TWO_B, session_tokens=SESSION, configured_tokens=512)
    assert (tokens_only.max_num_seqs.value, tokens_only.max_num_batched_tokens.value) == (512, 512)
    assert tokens_only.max_num_seqs.source == "configuration"


def test_the_cpu_backend_keeps_vllms_defaults() -> None:
    chosen = choose_limits(None, TWO_B, session_tokens=SESSION)
    assert chosen.engine_arguments() == {}
    assert "max_num_seqs vLLM's default (vLLM: CPU backend)" in limits_words(chosen)
    assert choose_limits(None, None, session_tokens=SESSION, configured_seqs=8).engine_arguments() == {
        "max_num_seqs": 8
    }


# -- the parallelism plan ---------------------------------------------------------------------


def test_several_gpus_and_a_model_that_fits_one_is_refused_with_the_commands() -> None:
    plan = parallelism_plan(devices=["0", "1", "2", "3"], tensor_parallel_size=1, gpu=H100, model=TWO_B)
    assert plan.refuse is not None and plan.warning is None
    assert "4 GPUs visible (0,1,2,3)" in plan.refuse and "leave 3 idle" in plan.refuse
    for device in "0123":
        assert f"--visible-devices {device} --share-group gpus --store redis" in plan.refuse
    assert "--allow-idle-gpus" in plan.refuse
    # The configured share group is the one the commands name.
    named = parallelism_plan(devices=["0", "1"], tensor_parallel_size=1, gpu=H100, model=TWO_B, share_group="chat")
    assert named.refuse is not None and "--share-group chat" in named.refuse


def test_one_gpu_asked_for_starts_with_a_warning() -> None:
    plan = parallelism_plan(
        devices=["0", "1", "2", "3"], tensor_parallel_size=1, gpu=H100, model=TWO_B, allow_idle_gpus=True
    )
    assert plan.refuse is None and plan.warning is not None and "3 of the 4 visible GPUs" in plan.warning


def test_tensor_parallel_for_a_model_that_fits_one_gpu_warns_of_its_cost() -> None:
    plan = parallelism_plan(devices=["0", "1", "2", "3"], tensor_parallel_size=4, gpu=H100, model=TWO_B)
    assert plan.refuse is None and plan.warning is not None
    assert "tensor parallel 4" in plan.warning and "1.4-2.3x" in plan.warning


def test_what_needs_several_gpus_or_cannot_be_judged_starts() -> None:
    # QwQ-32B in bf16 (61 GiB) does not fit half an H100: tensor parallel is right, no word.
    assert parallelism_plan(devices=["0", "1"], tensor_parallel_size=2, gpu=H100, model=QWQ_32B).warning is None
    # On four, with TP 2: two idle GPUs are said.
    two_idle = parallelism_plan(devices=["0", "1", "2", "3"], tensor_parallel_size=2, gpu=H100, model=QWQ_32B)
    assert two_idle.refuse is None and two_idle.warning is not None and "2 of the 4" in two_idle.warning
    # One GPU, the CPU backend: nothing to plan.
    assert parallelism_plan(devices=["0"], tensor_parallel_size=1, gpu=H100, model=TWO_B).refuse is None
    assert parallelism_plan(devices=["0", "1"], tensor_parallel_size=1, gpu=None, model=TWO_B).refuse is None
    # A model of unknown size: not refused, its idle GPUs said.
    unknown = parallelism_plan(devices=["0", "1"], tensor_parallel_size=1, gpu=H100, model=None)
    assert unknown.refuse is None and unknown.warning is not None and "model size unknown" in unknown.warning
    # The 32B on an H200 fits (61 of 126 GiB at util 0.9 is under half): refused on two.
    assert parallelism_plan(devices=["0", "1"], tensor_parallel_size=1, gpu=H200, model=QWQ_32B).refuse is not None


def test_visible_devices() -> None:
    assert visible_devices("0,2", 8) == ["0", "2"]
    assert visible_devices(None, 4) == ["0", "1", "2", "3"]
    assert visible_devices("", 4) == []
    assert visible_devices("GPU-abc, GPU-def", 8) == ["GPU-abc", "GPU-def"]


# -- the "Engine:" start line -----------------------------------------------------------------


class Mode(enum.Enum):
    NONE = 0
    FULL_AND_PIECEWISE = 1


def resolved(**over: Any) -> Any:
    """A stand-in for vLLM's resolved VllmConfig, as the engine ends up running it."""
    parts: dict[str, Any] = {
        "model": {"max_model_len": 16384, "enforce_eager": False, "dtype": "torch.bfloat16", "quantization": None},
        "cache": {"block_size": 16, "enable_prefix_caching": True, "cache_dtype": "auto"},
        "scheduler": {"max_num_seqs": 1024, "max_num_batched_tokens": 8192, "async_scheduling": False},
        "parallel": {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1},
        "compilation": {"cudagraph_mode": Mode.FULL_AND_PIECEWISE, "max_cudagraph_capture_size": 512},
    }
    for key, value in over.items():
        section, _, name = key.partition("__")
        parts[section][name] = value
    return SimpleNamespace(**{f"{name}_config": SimpleNamespace(**values) for name, values in parts.items()})


def words(config: Any, *, cpu: bool = False) -> str:
    from worker.engine.vllm import engine_words

    return engine_words(config, kv_tokens=600_000, capacity="65.6 GiB", cpu_backend=cpu, kv_offload_gib=64.0)


def test_the_engine_line_says_what_runs() -> None:
    line = words(resolved())
    assert line.startswith("max_model_len=16384, max_num_seqs=1024, max_num_batched_tokens=8192, block_size=16, ")
    assert "CUDA graphs on (FULL_AND_PIECEWISE, batches up to 512)" in line
    assert "dtype bfloat16" in line and "KV cache 600000 tokens (65.6 GiB)" in line
    assert "KV dtype auto, quantization none, tensor parallel 1, host-memory KV tier 64 GiB" in line
    assert "data parallel" not in line and "async scheduling" not in line


def test_enforce_eager_from_anywhere_shows_graphs_off() -> None:
    """enforce_eager through engine.extra reaches vLLM's model config like the flag does; vLLM
    then sets cudagraph_mode NONE: the line reads both back."""
    assert "CUDA graphs off (enforce_eager)" in words(resolved(model__enforce_eager=True))
    assert "CUDA graphs off (cudagraph_mode NONE)" in words(resolved(compilation__cudagraph_mode=Mode.NONE))


def test_the_engine_line_reads_limits_dtypes_and_parallelism_back() -> None:
    line = words(
        resolved(
            scheduler__max_num_seqs=128,
            scheduler__max_num_batched_tokens=2048,
            scheduler__async_scheduling=True,
            model__dtype="torch.float16",
            model__quantization="fp8",
            cache__cache_dtype="fp8_e4m3",
            parallel__tensor_parallel_size=4,
            parallel__data_parallel_size=2,
        )
    )
    assert "max_num_seqs=128, max_num_batched_tokens=2048" in line and "async scheduling on" in line
    assert "dtype float16" in line and "KV dtype fp8_e4m3, quantization fp8" in line
    assert "tensor parallel 4, data parallel 2" in line


def test_the_engine_line_says_the_tiers_blocks_as_vllm_runs_them() -> None:
    """The connector's block_size where set (the worker's default sets 256); vLLM's own unit,
    one GPU block (the line's block_size), goes unsaid."""
    config = resolved()
    config.kv_transfer_config = SimpleNamespace(kv_connector_extra_config={"block_size": 256, "cpu_bytes_to_use": 1})
    assert "host-memory KV tier 64 GiB in blocks of 256 tokens" in words(config)
    assert words(resolved()).endswith("host-memory KV tier 64 GiB")
    config.kv_transfer_config = SimpleNamespace(kv_connector_extra_config={"blocks_per_chunk": 8})
    assert "host-memory KV tier 64 GiB in blocks of 128 tokens" in words(config)
    from worker.engine.vllm import engine_words

    off = engine_words(config, kv_tokens=1, capacity="x", cpu_backend=False, kv_offload_gib=0.0)
    assert off.endswith("host-memory KV tier off")


def test_the_cpu_line_has_no_graphs_or_tier() -> None:
    line = words(resolved(), cpu=True)
    assert "CUDA graphs" not in line and "host-memory" not in line and "max_num_seqs=1024" in line


# -- the engine arguments of a worker on a made-up host ----------------------------------------


def test_engine_arguments_on_a_gpu_host(tmp_path: Any) -> None:
    """What the adapter gives vLLM: the chosen limits, with the start line saying where each
    came from; a value the configuration sets (its field or engine.extra) wins."""
    import json

    from loguru import logger

    from worker.config.models import EngineConfig
    from worker.engine.vllm import Host, engine_arguments

    (tmp_path / "config.json").write_text(json.dumps(geometry(2048, 28, 16, 8, 6144, 151936, True)))
    host = Host(cpu_backend=False, memory_gib=125.0, gpus=1, gpu=H100, devices=("0",))
    lines: list[str] = []
    sink = logger.add(lines.append, format="{message}", level="INFO")
    try:
        kwargs = engine_arguments(EngineConfig(model=str(tmp_path), kv_offload_gib=0), host=host)
        set_extra = engine_arguments(
            EngineConfig(model=str(tmp_path), kv_offload_gib=0, extra={"max_num_seqs": 64}), host=host
        )
        set_field = engine_arguments(
            EngineConfig(model=str(tmp_path), kv_offload_gib=0, max_num_batched_tokens=4096), host=host
        )
        cpu = engine_arguments(EngineConfig(model=str(tmp_path)), host=Host(cpu_backend=True, memory_gib=8.0, gpus=1))
    finally:
        logger.remove(sink)
    assert (kwargs["max_num_seqs"], kwargs["max_num_batched_tokens"]) == (1024, 8192)
    assert (set_extra["max_num_seqs"], set_extra["max_num_batched_tokens"]) == (64, 8192)
    assert (set_field["max_num_seqs"], set_field["max_num_batched_tokens"]) == (1024, 4096)
    assert "max_num_seqs" not in cpu and "max_num_batched_tokens" not in cpu
    limit_lines = [line for line in lines if line.startswith("Engine limits: ")]
    assert len(limit_lines) == 4
    assert "max_num_seqs 1024 (hardware: vllm serve's for NVIDIA H100" in limit_lines[0]
    assert "max_num_seqs 64 (configuration: set)" in limit_lines[1]
    assert "max_num_batched_tokens 4096 (configuration: set)" in limit_lines[2]
    assert "max_num_seqs vLLM's default (vLLM: CPU backend)" in limit_lines[3]


def test_the_start_refuses_idle_gpus_before_the_model_load(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's check (after vLLM's import, before the model load): refused with the
    commands, exit code 2 by CannotStart; --allow-idle-gpus starts with a warning."""
    import json

    from loguru import logger

    import worker.engine.vllm as adapter
    from worker.config.models import EngineConfig, WorkerConfig
    from worker.server import CannotStart, Server

    (tmp_path / "config.json").write_text(json.dumps(geometry(2048, 28, 16, 8, 6144, 151936, True)))
    four = adapter.Host(cpu_backend=False, memory_gib=500.0, gpus=4, gpu=H100, devices=("0", "1", "2", "3"))
    monkeypatch.setattr(adapter, "host_facts", lambda: four)
    refused = Server(WorkerConfig(engine=EngineConfig(model=str(tmp_path))))
    with pytest.raises(CannotStart, match=r"Cannot start: 4 GPUs visible \(0,1,2,3\)") as caught:
        refused._check_parallelism()
    assert "--visible-devices 3 --share-group gpus" in str(caught.value)
    lines: list[str] = []
    sink = logger.add(lines.append, format="{level} {message}", level="WARNING")
    try:
        Server(WorkerConfig(engine=EngineConfig(model=str(tmp_path), allow_idle_gpus=True)))._check_parallelism()
        Server(WorkerConfig(engine=EngineConfig(model=str(tmp_path), tensor_parallel_size=4)))._check_parallelism()
    finally:
        logger.remove(sink)
    assert any(line.startswith("WARNING GPUs: 3 of the 4 visible GPUs") for line in lines)
    assert any("tensor parallel 4" in line and "1.4-2.3x" in line for line in lines)


def test_the_cpu_backend_runs_a_one_device_model_in_the_engine_core(tmp_path: Any) -> None:
    """On the CPU backend a one-device engine gets vLLM's in-process executor by its class
    name (vLLM would swap "uni" for its multiprocessing executor: a third process); a GPU,
    tensor parallel 2 and an executor engine.extra names are left as they are."""
    import json

    from worker.config.models import EngineConfig
    from worker.engine.vllm import IN_PROCESS_EXECUTOR, Host, engine_arguments

    (tmp_path / "config.json").write_text(json.dumps(geometry(2048, 28, 16, 8, 6144, 151936, True)))
    cpu = Host(cpu_backend=True, memory_gib=8.0, gpus=1)
    gpu = Host(cpu_backend=False, memory_gib=125.0, gpus=1, gpu=H100, devices=("0",))
    model = str(tmp_path)
    assert engine_arguments(EngineConfig(model=model), host=cpu)["distributed_executor_backend"] == IN_PROCESS_EXECUTOR
    assert "distributed_executor_backend" not in engine_arguments(EngineConfig(model=model, kv_offload_gib=0), host=gpu)
    assert "distributed_executor_backend" not in engine_arguments(
        EngineConfig(model=model, tensor_parallel_size=2), host=cpu
    )
    chosen = engine_arguments(EngineConfig(model=model, extra={"distributed_executor_backend": "mp"}), host=cpu)
    assert chosen["distributed_executor_backend"] == "mp"
    import importlib

    from vllm.v1.executor.abstract import Executor

    module, _, name = IN_PROCESS_EXECUTOR.rpartition(".")
    assert issubclass(getattr(importlib.import_module(module), name), Executor)


def test_the_default_pending_limit_holds_what_vllm_serves_h100_row_runs_and_a_lower_one_is_named() -> None:
    """The worker takes at least what the engine runs at once on an H100 or H200 (vllm serve's
    1024 sequences and fair admission's 128 queued) before it answers busy; a configured limit
    below what the engine takes gets a start warning naming the value to raise it to."""
    from worker.config.models import LimitsConfig
    from worker.engine.admission import admission_limits

    chosen = choose_limits(H200, TWO_B, session_tokens=SESSION)
    assert chosen.max_num_seqs.value is not None
    queued = admission_limits(chosen.max_num_seqs.value)
    engine_requests = queued.max_num_seqs + queued.waiting_requests
    assert engine_requests == 1024 + 128
    assert pending_limit_short(LimitsConfig().max_pending_requests, engine_requests) is None
    assert pending_limit_short(engine_requests, engine_requests) is None
    assert pending_limit_short(1, None) is None  # the engine did not say
    words = pending_limit_short(1024, engine_requests)
    assert words is not None and "max_pending_requests 1024 is below the 1152 requests" in words
    assert "--max-pending-requests to at least 1152" in words


def test_models_with_recurrent_layers_are_told_from_attention_alone() -> None:
    """What keeps the host tier in vLLM's own unit (their cache blocks are sized to the
    recurrent state); a plain or multimodal attention model says nothing."""
    from worker.engine.limits import recurrent_layers

    plain = geometry(2048, 28, 16, 8, 6144, 151936, True)
    assert recurrent_layers({**plain, "model_type": "qwen3"}) is None
    assert recurrent_layers({"model_type": "qwen2_vl", "text_config": plain}) is None
    sliding = {**plain, "layer_types": ["sliding_attention", "full_attention"]}
    assert recurrent_layers(sliding) is None
    assert recurrent_layers({**plain, "mamba_d_state": 128}) == "config.json has mamba_d_state"
    assert recurrent_layers({**plain, "linear_key_head_dim": 128}) == "config.json has linear_key_head_dim"
    assert (
        recurrent_layers({**plain, "layer_types": ["conv", "full_attention"]}) == "config.json's layer_types has conv"
    )
    assert recurrent_layers({**plain, "model_type": "jamba"}) == "model_type jamba"
    assert recurrent_layers({"model_type": "x", "text_config": {**plain, "model_type": "qwen3_next"}}) == (
        "model_type qwen3_next"
    )
