"""The engine interface: what the service needs from an inference engine, in its own types.

The vLLM adapter (engine/vllm.py) implements it; tests may implement it with a fake that
fails on demand. Nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..session import ToolSpec


def describe(exc: BaseException) -> str:
    """An exception and its causes, one line: vLLM's wrappers carry no message themselves."""
    parts: list[str] = []
    current: BaseException | None = exc
    while current is not None and len(parts) < 4:
        parts.append(f"{type(current).__name__}: {current}".rstrip(": "))
        current = current.__cause__ or current.__context__
    return " <- ".join(parts)


class EngineError(Exception):
    """The engine failed one request; others may still be served."""


class EngineDead(EngineError):
    """The engine can serve nothing more; the worker must stop (and be restarted)."""


class StructuredOutputRejected(EngineError):
    """The engine cannot enforce this request's structured output (a schema its grammar
    backend does not support or fails to compile); answered as invalid_schema."""


class ImagesRejected(EngineError):
    """The request's images cannot go with its prompt: the model takes no images, more images
    than the engine's limit per prompt, or a prompt whose image placeholders do not match its
    images one for one. Found before the engine sees the request (vLLM expands placeholders
    that are already expanded again, and takes more placeholders than images, silently);
    answered as invalid_request, the session unchanged. The message names the model."""


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
class EngineImage:
    """One image of a prompt, decoded (worker/vision/images.py, off the event loop).

    ``uuid``: its identifier for the engine, the content hash of its bytes as sent: the same
    image sent again on a later turn (every turn re-sends the kept history's images) gets the
    same one, so vLLM's prefix cache, which hashes it into the blocks the image covers, finds
    the earlier turn's blocks, and its processor cache skips the image's preprocessing."""

    pixels: Any  # a PIL.Image.Image in RGB, fully loaded (typed loosely: the port imports no PIL)
    uuid: str


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    # In prompt order: the ids carry one placeholder per image (VisionInfo.placeholder), as the
    # chat template renders an image part, not yet expanded to the image's tokens.
    images: tuple[EngineImage, ...] = ()
    # False: the caller reads only the end (a reply that is not streamed, with no thinking
    # budget to enforce as it goes): an engine may then give one update, at the end, with the
    # whole text and ids and the first token's time in ``first_token_at``; an abort still
    # ends it with what was generated. True: an update as tokens come.
    incremental: bool = True


@dataclass(frozen=True)
class EngineTimes:
    """Where a generation's first token waited inside the engine, by the engine's own clock
    (vLLM's request stats, one process's timestamps): ``queue_s`` in its scheduler's waiting
    queue (queued until first scheduled), ``prefill_s`` computing the prompt (first scheduled
    until the first token; a preemption in between counts in it)."""

    queue_s: float
    prefill_s: float


@dataclass(frozen=True)
class GenerationUpdate:
    """One step of a generation: the text produced since the previous update."""

    delta: str
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "cancelled" once finished
    token_ids: tuple[int, ...] = ()  # the ids generated since the previous update (() where unknown)
    # Of prompt_tokens, those the images stand for (each image's placeholder expanded to them).
    image_tokens: int = 0
    # When the first token came (time.monotonic()), where the engine knows it better than the
    # reader's clock: an update that is not the first token's own (a request's one update at
    # its end, GenerationRequest.incremental). None: when the reader got this update.
    first_token_at: float | None = None
    # On the final update, where the engine keeps request stats: its queue and prefill times.
    engine_times: EngineTimes | None = None


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
class VisionSettings:
    """How the engine takes images (the configuration's [vision] section; engine.extra's
    limit_mm_per_prompt, mm_processor_kwargs and mm_processor_cache_gb win over these)."""

    max_pixels: int = 1024 * 1024  # an image is scaled down to this many pixels (its tokens' bound)
    max_images_in_prompt: int = 8  # the engine's limit_mm_per_prompt
    processor_cache_gib: float | None = None  # the processor cache, per process; None: from host memory
    image_threads: int | None = None  # threads that process images; None: from the host's CPUs
    image_torch_threads: int | None = None  # torch threads per image; None: from the host's CPUs


@dataclass(frozen=True)
class VisionInfo:
    """What a vision model's prompts need: an image part renders as ``placeholder`` (Qwen2-VL
    and Qwen3-VL: <|vision_start|><|image_pad|><|vision_end|>), of which ``image_token_id`` is
    the token the engine expands to the image's tokens."""

    image_token_id: int
    placeholder: tuple[int, ...]
    max_images: int  # per prompt
    max_pixels: int | None  # None: the model processor's own bound


@dataclass(frozen=True)
class EngineInfo:
    name: str
    version: str
    model: str
    max_model_len: int
    block_size: int | None
    prefix_caching: bool
    kv_cache_tokens: int | None = None  # the GPU KV cache's size in tokens, where the engine says
    vision: VisionInfo | None = None  # None: the model takes no images
    # The most requests the engine takes at once: max_num_seqs, plus the requests fair
    # admission queues in it. None where the engine does not say.
    max_requests: int | None = None


@dataclass(frozen=True)
class ToolCallFormat:
    """How a model family writes one tool call: a forced call's reply is ``open``, then the
    call's JSON (``{"name": ..., <arguments_key>: {...}}``), then ``close``: the model's own
    format, so the stored history renders as the model was trained."""

    open: str  # "<tool_call>\n" (Hermes)
    close: str  # "\n</tool_call>" (Hermes)
    arguments_key: str  # "arguments" (Hermes), "parameters" (Llama 3 JSON)
    # Text that begins call markup: streamed deltas stop there (the calls come in the reply).
    markers: tuple[str, ...]
    # Markup that counts only at the very start of the answer (Llama 3's bare JSON object).
    leading_markers: tuple[str, ...] = ()


@dataclass(frozen=True)
class ParsedTools:
    """What a tool parser found in a reply's answer (after any think block)."""

    content: str  # the text before the calls
    calls: list[tuple[str, str]]  # (name, arguments as JSON text), as the model wrote them
    markup: bool  # the text has call markup (calls found or not)


class ToolParser(Protocol):
    """The model family's tool-call parser (vLLM's, wrapped in engine/vllm.py)."""

    name: str  # the parser's name in vLLM ("hermes", "llama3_json")
    format: ToolCallFormat | None  # None: this worker knows no forced-call format for it

    def parse(self, text: str, tools: Sequence[ToolSpec]) -> ParsedTools: ...


@dataclass(frozen=True)
class ToolSupport:
    """Whether the served model can call tools, and its parser (chosen at start from the
    model's chat template, or named by engine.tool_parser)."""

    parser: ToolParser | None = None
    unsupported: str | None = "tool calling is not set up for this worker"  # why not (None: it can)


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
