"""The engine interface: what the service needs from an inference engine, in its own types.

The vLLM adapter (engine/vllm.py) implements it; tests may implement it with a fake that
fails on demand. Nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol


class EngineError(Exception):
    """The engine failed one request; others may still be served."""


class EngineDead(EngineError):
    """The engine can serve nothing more; the worker must stop (and be restarted)."""


class StructuredOutputRejected(EngineError):
    """The engine cannot enforce this request's structured output (a schema its grammar
    backend does not support or fails to compile); answered as invalid_schema."""


@dataclass(frozen=True)
class StructuredOutput:
    """Constrain the reply to JSON: valid for ``json_schema`` when given, else any JSON object.
    The schema has been checked (a valid JSON Schema of bounded size) before it gets here."""

    json_schema: dict[str, Any] | None = None


@dataclass(frozen=True)
class SamplingOptions:
    max_tokens: int
    temperature: float
    top_p: float
    stop: tuple[str, ...] = ()
    structured: StructuredOutput | None = None  # None: free text


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions


@dataclass(frozen=True)
class GenerationUpdate:
    """One step of a generation: the text produced since the previous update."""

    delta: str
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "cancelled" once finished


@dataclass
class EngineStats:
    """The scheduler's own numbers, as reported by the engine (not estimated).

    Counters are cumulative since start; the gauges are the latest values, and
    ``max_running`` is the most requests running at once since the last ``take``."""

    running: int = 0
    waiting: int = 0
    max_running: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found
    # Prompt tokens of scheduled prefills by where their KV came from (cumulative): computed,
    # found in the GPU's prefix cache, or loaded back from the host-memory tier (kv_offload_gib).
    prompt_tokens_computed: int = 0
    prompt_tokens_gpu_hit: int = 0
    prompt_tokens_host_hit: int = 0
    kv_offload_gib: float = 0.0  # size of the host-memory tier; 0: off
    extra: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class WarmupPlan:
    """What the warm-up before ``online`` covers (engine.warmup*): the sampling the worker
    uses by default, the other variants a request may ask for, at batch sizes up to
    ``max_batch`` (None: the engine's limit), within ``timeout_s``."""

    mode: str  # auto (on GPUs only), on, off
    temperature: float
    top_p: float
    max_batch: int | None = None
    timeout_s: float = 300.0


@dataclass(frozen=True)
class EngineInfo:
    name: str
    version: str
    model: str
    max_model_len: int
    block_size: int | None
    prefix_caching: bool
    kv_cache_tokens: int | None = None  # the GPU KV cache's size in tokens, where the engine says


class Engine(Protocol):
    info: EngineInfo

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationUpdate]:
        """Stream updates; the last has ``finished=True``. Raises EngineError."""
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a running generation; its stream then ends with finish_reason "cancelled"."""
        ...

    def take_stats(self) -> EngineStats:
        """The current statistics; resets the interval maximum."""
        ...

    def is_alive(self) -> bool:
        """Cheap (the systemd watchdog asks every few seconds): False once the engine can
        serve nothing more, e.g. its engine process died."""
        ...

    async def shutdown(self) -> None: ...


class ServedEngine(Engine, Protocol):
    """What the server needs of an engine beyond the port the service uses: the warm-up
    before ``online``, and the live counters for /metrics (vllm.VllmEngine)."""

    async def warm_up(self, plan: WarmupPlan) -> object: ...

    def peek_stats(self) -> EngineStats: ...
