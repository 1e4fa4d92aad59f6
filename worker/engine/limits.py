"""Engine limits and the parallelism plan from the hardware and the model: pure functions of
facts gathered at start (the GPU's name and memory, how many GPUs the worker sees, the model's
geometry), so that every rule here is unit-tested on made-up GPUs (tests/unit/test_limits.py).

**max_num_seqs and max_num_batched_tokens.** vLLM picks them by "usage context": ``vllm serve``
(the OpenAI server) and ``LLM(...)`` get a per-GPU table (``EngineArgs.get_batch_defaults``,
the same in vLLM 0.26 and 0.32/0.33)::

    GPU                                   vllm serve               LLM class
    >= 160 GiB (B200, B300; vLLM 0.28+)   1024 seqs, 16384 tokens  1024 seqs, 16384 tokens
    >= 70 GiB and not an A100 (H100,      1024 seqs, 8192 tokens   1024 seqs, 16384 tokens
      H200, MI300X)
    any other GPU (A100, L40S, A10, ...)  256 seqs, 2048 tokens    256 seqs, 8192 tokens
    the CPU backend (0.32)                128 seqs x TP, 2048 x TP 256 seqs x TP, 4096 x TP

but an ``AsyncLLM`` built from engine arguments, as the worker builds it, is in no such context
and gets the scheduler's fallbacks, 128 seqs and 2048 tokens (vLLM 0.26-0.33: before 0.28 the
table had no 160 GiB row, B200s took the 70 GiB one). Measured through the worker on
one H100 (vLLM 0.26, a 2B geometry, one-turn sessions of 300 prompt and 128 reply tokens, all
at once; issue 31): 128/2048 gave 11,000 tok/s at 320 sessions with TTFT p50 1,647 ms; 1024/8192
gave 19,700 tok/s, TTFT p50 377 ms; 512/16384 18,400 tok/s (no better at 320, and at 1,000 its
TTFT p95 was 5.0 s against 2.7 s). So the worker takes ``vllm serve``'s row for its GPU, and:

* ``max_num_seqs``: more than that row where the KV cache holds more sessions at once: a
  sequence that is running needs its KV blocks, so seqs beyond what the cache holds only
  wait inside vLLM or are preempted (recomputed), while seqs the cache does hold are what
  let 1,000 sessions run at once instead of queueing (at 1,000 sessions 512 seqs left ~400
  waiting and doubled TTFT p95 against 1024). The session counted is a full one: the history
  cap plus a reply (``session_tokens``, history.max_history_tokens + generation.max_tokens,
  2,256 tokens by default), so the raise never makes full sessions preempt each other. The
  estimate of the KV cache is the GPU's memory at gpu_memory_utilization less the weights
  and an activation reserve; the largest power of two of sessions in it, at most
  ``MAX_SEQS_FACTOR`` times the row (decode steps and the sampler grow with the batch).
* ``max_num_batched_tokens``: the row's (16384 was not better, above), and at least
  max_num_seqs (vLLM refuses fewer).

On the CPU backend the worker sets neither: vLLM's CPU defaults run CI today.

**The parallelism plan.** A worker that sees several GPUs, runs no tensor parallel and serves a
model that fits one GPU would use one GPU and leave the rest idle: measured on four H100s
(issue 31), one worker per GPU in one share group gave 1.6x (80 sessions) to 3.4x (320) of one
worker and 1.4-2.3x of one worker with tensor parallel 4. So the worker refuses to start with
the commands that would use them all, unless told to use one (engine.allow_idle_gpus). Tensor
parallel for a model that fits one GPU starts with a warning naming that cost.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

GIB = 2**30

# vLLM's usage-context table (EngineArgs.get_batch_defaults, vLLM 0.26-0.33): the row of
# `vllm serve` (UsageContext.OPENAI_API_SERVER).
HUGE_GPU_MEMORY = 160 * GIB
SERVE_HUGE_GPU = (1024, 16384)  # >= 160 GiB (vLLM 0.28+): B200, B300
LARGE_GPU_MEMORY = 70 * GIB
SERVE_LARGE_GPU = (1024, 8192)  # >= 70 GiB and not an A100: H100, H200, MI300X
SERVE_OTHER_GPU = (256, 2048)  # A100 (large batches measured slower there, vLLM PR 17885), L40S, ...
LIBRARY_DEFAULTS = (128, 2048)  # SchedulerConfig's fallbacks: what AsyncLLM gets outside a usage context
MAX_SEQS_FACTOR = 4  # max_num_seqs at most this times the row's, whatever the KV cache holds
# Memory a GPU keeps beside the weights and the KV cache at gpu_memory_utilization: activations
# of a prefill chunk, CUDA graphs, the sampler. vLLM measures it at start (its memory profile);
# here an estimate, on the safe side: it only decides whether max_num_seqs goes above the row.
ACTIVATION_RESERVE = 4 * GIB
# A model "fits one GPU" when its weights take at most this share of the GPU memory vLLM may
# use: the rest is KV cache for a useful number of sessions.
FITS_SHARE = 0.5


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One GPU as vLLM's platform reports it."""

    name: str
    memory_bytes: int


@dataclasses.dataclass(frozen=True)
class ModelSize:
    """What the limits depend on of the model: its weights and KV cache per token, whole
    (all layers and KV heads; tensor parallel splits both)."""

    weight_bytes: int
    kv_bytes_per_token: int


@dataclasses.dataclass(frozen=True)
class Limit:
    value: int | None  # None: left to vLLM (the CPU backend)
    source: str  # "configuration", "hardware", "model" or "vLLM" (left to it)
    reason: str


@dataclasses.dataclass(frozen=True)
class EngineLimits:
    max_num_seqs: Limit
    max_num_batched_tokens: Limit
    kv_tokens_estimate: int | None = None

    def engine_arguments(self) -> dict[str, int]:
        return {
            name: limit.value
            for name, limit in (
                ("max_num_seqs", self.max_num_seqs),
                ("max_num_batched_tokens", self.max_num_batched_tokens),
            )
            if limit.value is not None
        }


def _gib(value: float) -> str:
    return f"{value / GIB:.0f} GiB"


def serve_row(gpu: Gpu) -> tuple[int, int, str]:
    """(max_num_seqs, max_num_batched_tokens, why) of ``vllm serve`` on this GPU."""
    if gpu.memory_bytes >= HUGE_GPU_MEMORY:
        return (*SERVE_HUGE_GPU, f"{gpu.name}, {_gib(gpu.memory_bytes)}: a GPU of >= 160 GiB")
    if gpu.memory_bytes >= LARGE_GPU_MEMORY and "a100" not in gpu.name.lower():
        return (*SERVE_LARGE_GPU, f"{gpu.name}, {_gib(gpu.memory_bytes)}: a GPU of >= 70 GiB other than an A100")
    why = "an A100" if "a100" in gpu.name.lower() else "a GPU of < 70 GiB"
    return (*SERVE_OTHER_GPU, f"{gpu.name}, {_gib(gpu.memory_bytes)}: {why}")


def estimated_kv_tokens(
    gpu: Gpu, model: ModelSize, *, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.9
) -> int:
    """Tokens the KV cache of one engine will hold, estimated before the engine starts:
    the memory of its GPUs at gpu_memory_utilization less the weights and an activation reserve
    per GPU, over the KV bytes of a token. vLLM's own figure (its memory profile) comes later."""
    usable = gpu.memory_bytes * gpu_memory_utilization * tensor_parallel_size
    free = usable - model.weight_bytes - ACTIVATION_RESERVE * tensor_parallel_size
    return max(0, int(free // max(model.kv_bytes_per_token, 1)))


def choose_limits(
    gpu: Gpu | None,
    model: ModelSize | None,
    *,
    session_tokens: int,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float = 0.9,
    kv_cache_memory_bytes: int | None = None,
    configured_seqs: int | None = None,
    configured_tokens: int | None = None,
) -> EngineLimits:
    """max_num_seqs and max_num_batched_tokens for one engine (the module's docstring says
    why). ``gpu`` None: the CPU backend, where vLLM's defaults stay. ``configured_*``: set by
    the operator (flag, variable, TOML or engine.extra): they win. ``kv_cache_memory_bytes``:
    the KV cache's size where it is set (engine.extra), instead of the estimate."""
    if gpu is None:
        seqs = Limit(configured_seqs, "configuration", "set") if configured_seqs else Limit(None, "vLLM", "CPU backend")
        tokens = (
            Limit(configured_tokens, "configuration", "set")
            if configured_tokens
            else Limit(None, "vLLM", "CPU backend")
        )
        return EngineLimits(seqs, tokens)
    row_seqs, row_tokens, why = serve_row(gpu)
    kv_tokens: int | None = None
    if model is not None:
        if kv_cache_memory_bytes:
            kv_tokens = int(kv_cache_memory_bytes // max(model.kv_bytes_per_token, 1))
        else:
            kv_tokens = estimated_kv_tokens(
                gpu, model, tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization
            )
    if configured_seqs:
        seqs = Limit(configured_seqs, "configuration", "set")
    else:
        seqs = Limit(row_seqs, "hardware", f"vllm serve's for {why}")
        held = kv_tokens // max(session_tokens, 1) if kv_tokens is not None else 0
        if held >= 2 * row_seqs:
            raised = min(1 << (held.bit_length() - 1), MAX_SEQS_FACTOR * row_seqs)
            seqs = Limit(
                raised,
                "model",
                f"the KV cache holds ~{held} sessions of {session_tokens} tokens (~{kv_tokens} tokens estimated); "
                f"vllm serve's {row_seqs} for {why}",
            )
    if configured_tokens and not configured_seqs and seqs.value and seqs.value > configured_tokens:
        seqs = Limit(configured_tokens, "configuration", f"max_num_batched_tokens {configured_tokens} set: no more")
    if configured_tokens:
        tokens = Limit(configured_tokens, "configuration", "set")
    else:
        value = max(row_tokens, seqs.value or 0)
        reason = f"vllm serve's for {why}"
        if value > row_tokens:
            reason = f"max_num_seqs {value}: vLLM needs at least as many; vllm serve's {row_tokens} for {why}"
        tokens = Limit(value, "hardware", reason)
    return EngineLimits(seqs, tokens, kv_tokens)


def limits_words(limits: EngineLimits) -> str:
    """The start line's words: each value and where it came from."""
    parts = []
    for name, limit in (
        ("max_num_seqs", limits.max_num_seqs),
        ("max_num_batched_tokens", limits.max_num_batched_tokens),
    ):
        value = "vLLM's default" if limit.value is None else str(limit.value)
        parts.append(f"{name} {value} ({limit.source}: {limit.reason})")
    return ", ".join(parts)


# -- the model's size from its config.json ----------------------------------------------------

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "half": 2, "float": 4}


def model_size_from_config(
    config: dict[str, Any], *, dtype: str = "auto", quantization: str | None = None, kv_cache_dtype: str = "auto"
) -> ModelSize | None:
    """Weights and KV bytes per token of a dense decoder-only model from its config.json (the
    text part of a multimodal one); None where the geometry is not plain (experts, no sizes)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    assert isinstance(text, dict)
    try:
        hidden = int(text["hidden_size"])
        layers = int(text["num_hidden_layers"])
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or hidden // heads)
        intermediate = int(text["intermediate_size"])
        vocab = int(text["vocab_size"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    if any(key in text for key in ("num_experts", "num_local_experts", "n_routed_experts")):
        return None  # mixture of experts: its weights are not this formula
    tied = bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    attention = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    per_layer = attention + 3 * hidden * intermediate
    params = layers * per_layer + vocab * hidden * (1 if tied else 2)
    name = dtype if dtype != "auto" else str(text.get("torch_dtype") or config.get("torch_dtype") or "bfloat16")
    element = _DTYPE_BYTES.get(name.replace("torch.", ""), 2)
    weight_element = 1 if quantization and "fp8" in quantization.lower() else element
    kv_element = 1 if kv_cache_dtype.startswith("fp8") else element
    return ModelSize(
        weight_bytes=int(params * weight_element),
        kv_bytes_per_token=int(2 * layers * kv_heads * head_dim * kv_element),
    )


# What marks a model whose KV cache is not attention's alone (Mamba, linear attention, short
# convolutions): vLLM gives such a model cache blocks sized to its recurrent state (hundreds of
# tokens, not a power of two), which the host tier's own unit must divide.
_RECURRENT_KEY_PREFIXES = ("mamba", "ssm_", "linear_", "conv_l_cache", "attn_layer_", "hybrid_override_pattern")
_RECURRENT_MODEL_TYPES = (
    *("mamba", "jamba", "zamba", "bamba", "falcon_h1", "nemotron_h", "granitemoehybrid"),
    *("qwen3_next", "lfm2", "plamo2", "minimax_m1"),
)
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "attention", "chunked_attention"}


def recurrent_layers(config: dict[str, Any]) -> str | None:
    """What in a config.json (the text part of a multimodal one) says the model has layers
    other than attention: the key or model type, in words; None for attention alone."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    assert isinstance(text, dict)
    for key in text:
        if key.lower().startswith(_RECURRENT_KEY_PREFIXES):
            return f"config.json has {key}"
    kinds = text.get("layer_types")
    if isinstance(kinds, list) and (other := sorted({str(k) for k in kinds} - _ATTENTION_LAYER_TYPES)):
        return f"config.json's layer_types has {', '.join(other)}"
    model_type = str(text.get("model_type") or config.get("model_type") or "").lower()
    if any(word in model_type for word in _RECURRENT_MODEL_TYPES):
        return f"model_type {model_type}"
    return None


def read_model_json(model: str, name: str) -> dict[str, Any] | None:
    """The JSON object in the file ``name`` of a local model directory; None for a hub id, a
    missing file, or one that cannot be read or holds no object."""
    try:
        data = json.loads((Path(model) / name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_model_size(
    model: str, *, dtype: str = "auto", quantization: str | None = None, kv_cache_dtype: str = "auto"
) -> ModelSize | None:
    """model_size_from_config of a local model directory; None for a hub id or a config that
    cannot be read (the limits then stay at the GPU's row)."""
    config = read_model_json(model, "config.json")
    if config is None:
        return None
    return model_size_from_config(config, dtype=dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype)


# -- the parallelism plan ---------------------------------------------------------------------

# Measured on four H100s (vLLM 0.26, a 2B geometry, issue 31): one worker per GPU in one share
# group against one worker with tensor parallel 4.
TP_COST = "one worker per GPU in one share group served 1.4-2.3x the tokens/s of one worker with tensor parallel 4"


@dataclasses.dataclass(frozen=True)
class ParallelismPlan:
    refuse: str | None  # the start ends with this (and the commands that would use every GPU)
    warning: str | None  # the start goes on with this WARNING


def one_worker_per_gpu_commands(devices: list[str], share_group: str | None) -> list[str]:
    """One worker command per device, all in one share group on the Redis store."""
    group = share_group or "gpus"
    return [
        f"python -m worker --visible-devices {device} --share-group {group} --store redis "
        f"--redis-url redis://127.0.0.1:6379/0 [your other flags]"
        for device in devices
    ]


def parallelism_plan(
    *,
    devices: list[str],
    tensor_parallel_size: int,
    gpu: Gpu | None,
    model: ModelSize | None,
    gpu_memory_utilization: float = 0.9,
    allow_idle_gpus: bool = False,
    share_group: str | None = None,
) -> ParallelismPlan:
    """What the worker does with the GPUs it sees (``devices``: their ids, CUDA_VISIBLE_DEVICES
    or every GPU of the host). ``gpu`` None: the CPU backend, no plan. A model whose size is
    unknown (a hub id, experts) is not refused: its idle GPUs are said in a warning."""
    if gpu is None or (len(devices) <= 1 and tensor_parallel_size <= 1):
        return ParallelismPlan(None, None)
    fits = model is not None and model.weight_bytes <= FITS_SHARE * gpu.memory_bytes * gpu_memory_utilization
    size = f"{model.weight_bytes / GIB:.1f} GiB of weights" if model is not None else ""
    idle = len(devices) - tensor_parallel_size
    if fits and tensor_parallel_size == 1 and idle > 0 and not allow_idle_gpus:
        commands = "\n  ".join(one_worker_per_gpu_commands(devices, share_group))
        return ParallelismPlan(
            f"{len(devices)} GPUs visible ({','.join(devices)}), no tensor parallel, and the model ({size}) fits one "
            f"{gpu.name}: this worker would use one GPU and leave {idle} idle. One worker per GPU in one share "
            f"group uses them all (measured on four H100s: 1.6-3.4x the tokens/s of one worker):\n  {commands}\n"
            "(the Redis store keeps each session's history for whichever worker gets its next turn: "
            'docs/operations.md, "Several GPUs on one host"). To use one GPU: --visible-devices 0, '
            "or --allow-idle-gpus.",
            None,
        )
    warnings = []
    if fits and tensor_parallel_size > 1:
        warnings.append(
            f"tensor parallel {tensor_parallel_size} for a model ({size}) that fits one {gpu.name}: {TP_COST}; "
            f'see docs/operations.md, "Several GPUs on one host"'
        )
    if idle > 0 and (allow_idle_gpus or not fits):
        warnings.append(
            f"{idle} of the {len(devices)} visible GPUs ({','.join(devices)}) stay idle: this worker uses "
            f"{tensor_parallel_size} ({'allow_idle_gpus set' if allow_idle_gpus else 'model size unknown'})"
        )
    return ParallelismPlan(None, "; ".join(warnings) or None)


def visible_devices(cuda_visible_devices: str | None, host_gpus: int) -> list[str]:
    """The GPU ids this process sees: CUDA_VISIBLE_DEVICES where set, else every GPU of the host."""
    if cuda_visible_devices is not None:
        return [d.strip() for d in cuda_visible_devices.split(",") if d.strip() and d.strip() != "-1"]
    return [str(i) for i in range(host_gpus)]


# -- the worker's pending requests against the engine's ---------------------------------------


def pending_limit_short(max_pending_requests: int, engine_requests: int | None) -> str | None:
    """The start warning where limits.max_pending_requests is below what the engine takes at
    once (max_num_seqs and what admission queues in it): the worker would answer busy, and the
    broker hold requests back, while the engine had room. None where it is not below."""
    if engine_requests is None or max_pending_requests >= engine_requests:
        return None
    return (
        f"limits.max_pending_requests {max_pending_requests} is below the {engine_requests} requests the engine "
        f"takes at once (max_num_seqs and the requests admission queues in it): beyond {max_pending_requests} "
        f"requests are answered busy or held back by the broker while the engine has room; "
        f"raise --max-pending-requests to at least {engine_requests}"
    )
