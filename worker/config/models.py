"""Configuration: pydantic models, one per TOML section.

Every key has exactly one command-line flag and one environment variable. The flag is
declared next to the field (``flag=``) so that the CLI, the environment, the example
config and the docs are all generated from this one place and cannot drift.
Precedence: CLI > environment (``WORKER_`` + flag in upper snake case) > TOML > defaults.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeGuard

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ..schemacheck import SchemaUnusable, check_parameters, is_valid_text

# One topic level a worker or user names: the user namespace, the session, the worker id.
# Patterns are checked with fullmatch, never as "^...$" with match: "$" also matches before a
# final newline, which would let "alice\n" through (into topics and log lines).
TOPIC_PART = re.compile(r"[A-Za-z0-9._:-]{1,128}")
ENV_PREFIX = "WORKER_"


def opt(
    default: Any, help: str, *, flag: str | None = None, secret: bool = False, model_default: bool = False, **kw: Any
) -> Any:
    """A config field with its help text and, where the generic ``--section-key`` would be
    wrong, its flag name. ``model_default``: a sampling default that, left unset, comes from
    the model's generation_config.json (``default`` only where the model has none)."""
    extra: dict[str, Any] = {}
    if flag:
        extra["flag"] = flag
    if secret:
        extra["secret"] = True
    if model_default:
        extra["model_default"] = True
    return Field(default, description=help, json_schema_extra=extra or None, **kw)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class MqttConfig(Section):
    host: str = opt("127.0.0.1", "Broker host name or address.")
    port: int = opt(1883, "Broker TCP port.", ge=1, le=65535)
    username: str | None = opt(None, "MQTT username of the worker (not a chat user's).")
    password: SecretStr | None = opt(
        None,
        "MQTT password. Prefer password_file or the WORKER_MQTT_PASSWORD environment variable: "
        "a password on the command line is visible in ps.",
        secret=True,
    )
    password_file: Path | None = opt(None, "File whose first line is the MQTT password.")
    tls_ca_file: Path | None = opt(
        None,
        "CA certificate(s) (PEM) that the broker's certificate must chain to. When set, the "
        "connection uses TLS and the broker's name is checked against its certificate.",
    )
    tls_cert_file: Path | None = opt(
        None, "Client certificate (PEM) for brokers that authenticate by certificate; needs tls_key_file."
    )
    tls_key_file: Path | None = opt(None, "Private key (PEM) of tls_cert_file.")
    tls_insecure_skip_hostname_check: bool = opt(
        False,
        "For tests only: accept a broker certificate that chains to tls_ca_file but names "
        "another host. Logs a warning when on.",
    )
    topic_prefix: str = opt("chat", "First topic level(s) of every topic.", flag="--topic-prefix")
    worker_id: str | None = opt(
        None,
        "MQTT client id and name in the _worker topics. Default: derived from the host name "
        "and the visible devices, so two workers on one host never share a client id.",
        flag="--worker-id",
    )
    share_group: str | None = opt(
        None,
        "MQTT shared-subscription group: workers with the same group share the request and "
        "control topics ($share/<group>/...), each request going to one of them. Default: none, "
        "this worker receives every request.",
        flag="--share-group",
    )
    keepalive: int = opt(
        30,
        "Keepalive interval in seconds; the broker publishes the Will after 1.5 times this without "
        "traffic (mosquitto 2.0.11: up to 6 s later).",
        ge=5,
        le=3600,
    )
    session_expiry: int = opt(
        3600,
        "Seconds the broker keeps the worker's session (subscriptions and unacknowledged "
        "requests) while it is disconnected, so requests sent during a restart are not lost.",
        ge=0,
    )
    wait_for_broker: bool = opt(
        False,
        "At start, wait for a broker that is down or unreachable (retrying with the reconnect "
        "delays) instead of exiting with code 2. On by itself under systemd (NOTIFY_SOCKET set). "
        "A refused login or a TLS error ends the start either way.",
        flag="--wait-for-broker",
    )
    reconnect_min_delay: int = opt(1, "First delay in whole seconds before reconnecting (doubles each try).", ge=1)
    reconnect_max_delay: int = opt(30, "Largest delay in whole seconds between reconnects.", ge=1)
    allowed_response_topics: list[str] = opt(
        [],
        "MQTT topic filters (+ and # allowed) that a request's MQTT 5 ResponseTopic may name. "
        "The session's own reply topic is always allowed; anything else goes to it instead.",
    )

    @field_validator("topic_prefix")
    @classmethod
    def _check_prefix(cls, value: str) -> str:
        parts = value.split("/")
        if not all(TOPIC_PART.fullmatch(p) for p in parts):
            raise ValueError(f"each level must match {TOPIC_PART.pattern}, got {value!r}")
        return value

    @field_validator("worker_id", "share_group")
    @classmethod
    def _check_topic_level(cls, value: str | None) -> str | None:
        if value is not None and not TOPIC_PART.fullmatch(value):
            raise ValueError(f"must match {TOPIC_PART.pattern}, got {value!r}")
        return value

    @model_validator(mode="after")
    def _check_tls(self) -> MqttConfig:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together: set both or neither")
        if self.tls_ca_file is None and (self.tls_cert_file is not None or self.tls_insecure_skip_hostname_check):
            raise ValueError("tls_cert_file, tls_key_file and tls_insecure_skip_hostname_check need tls_ca_file")
        return self

    @model_validator(mode="after")
    def _check_reconnect_delays(self) -> MqttConfig:
        if self.reconnect_min_delay > self.reconnect_max_delay:
            raise ValueError(
                f"reconnect_min_delay ({self.reconnect_min_delay}) exceeds reconnect_max_delay "
                f"({self.reconnect_max_delay})"
            )
        return self

    def password_value(self) -> str | None:
        """The password from the file (its first line), else the value given directly; OSError
        when the file cannot be read, UnicodeDecodeError when it is not UTF-8."""
        if self.password_file is not None:
            lines = self.password_file.read_text(encoding="utf-8").splitlines()
            return lines[0] if lines else ""
        return self.password.get_secret_value() if self.password else None


# How deep engine.extra may nest. vLLM's engine arguments nest a few levels (hf_overrides,
# kv_transfer_config's kv_connector_extra_config); past some 255 pydantic cannot serialize the
# config, and --check-config and the start's configuration log failed with a traceback.
MAX_EXTRA_DEPTH = 32


def nesting(value: Any) -> int:
    """How deep objects and arrays nest in ``value`` (a plain value: 0), counted level by
    level, not by recursion."""
    depth, level = 0, [value]
    while level := [node for node in level if isinstance(node, (dict, list))]:
        depth += 1
        level = [child for node in level for child in (node.values() if isinstance(node, dict) else node)]
    return depth


class EngineConfig(Section):
    model: str | None = opt(None, "Model directory (or hub id) to serve. Required.", flag="--model")
    visible_devices: str | None = opt(
        None,
        'Sets CUDA_VISIBLE_DEVICES before torch or vLLM is imported, e.g. "2" or "0,1".',
        flag="--visible-devices",
    )
    tensor_parallel_size: int = opt(1, "GPUs one model is split over.", flag="--tensor-parallel-size", ge=1)
    gpu_memory_utilization: float = opt(
        0.9,
        "Share of GPU memory vLLM may take (on the CPU backend: of host memory).",
        flag="--gpu-memory-utilization",
        gt=0,
        le=1,
    )
    max_model_len: int | None = opt(
        None,
        "Context length (prompt + reply) in tokens. Default: the model's.",
        flag="--max-model-len",
        ge=16,
    )
    max_num_seqs: int | None = opt(
        None,
        "Most requests running in the engine at once (its batch). Default (unset): chosen at start from the GPU: "
        "1024 on a GPU of 70 GiB or more other than an A100 (H100, H200), 256 on others (what vllm serve "
        "chooses there; vLLM's library default is 128), and more (powers of two, up to 4x that) where the KV cache "
        "holds more sessions of max_history_tokens + max_tokens at once; on the CPU backend vLLM's default. The "
        'start log says the value and where it came from (docs/performance.md, "Engine limits").',
        flag="--max-num-seqs",
        ge=1,
    )
    max_num_batched_tokens: int | None = opt(
        None,
        "Most tokens one engine step computes (prefill chunks and decodes together). Default (unset): 8192 on a "
        "GPU of 70 GiB or more other than an A100, 2048 on others (vllm serve's; vLLM's library default is 2048), "
        "at least max_num_seqs; on the CPU backend vLLM's default. Set together with max_num_seqs, it must be at "
        "least that (each running request takes a token of a step): the worker refuses the pair otherwise.",
        flag="--max-num-batched-tokens",
        ge=1,
    )
    admission: Literal["fair", "off"] = opt(
        "fair",
        "Which requests go to the engine now. fair: up to max_num_seqs plus admission_waiting_requests (and "
        "admission_waiting_tokens, where set); the rest wait in the worker and go users in turn, each user's in "
        "order. off: every request at once, in vLLM's order (first come, first served). "
        'docs/performance.md, "Admission".',
        flag="--admission",
    )
    admission_waiting_requests: int | None = opt(
        None,
        "Requests the engine may hold beyond max_num_seqs (fair admission), to take sequences as they free "
        "up. Default: max_num_seqs / 8, at least 16.",
        flag="--admission-waiting-requests",
        ge=0,
    )
    admission_waiting_tokens: int | None = opt(
        None,
        "Prompt tokens (not found in the prefix cache, estimated) of requests in the engine that have no token "
        "yet (fair admission): more waits in the worker. Default: no such bound (holding prompts back to 4 x "
        "max_num_batched_tokens cut the tokens/s at 320 sessions on an H100 from 14.4k to 5.4k). A request goes when "
        "nothing waits in the engine, however long its prompt.",
        flag="--admission-waiting-tokens",
        ge=1,
    )
    frontend_process: Literal["auto", "on", "off"] = opt(
        "auto",
        "Run vLLM's frontend (its AsyncLLM: each request's input processing, the output handler, the "
        "detokenizer) in a process of its own beside the worker, so that the worker's intake (MQTT, sessions, "
        "chat template, tokenizer) and vLLM's frontend run at once instead of taking turns on one interpreter. "
        "auto: on with an NVIDIA GPU, off on the CPU backend. "
        'docs/performance.md, "The frontend in a process of its own".',
        flag="--frontend-process",
    )
    allow_idle_gpus: bool = opt(
        False,
        "Start with several visible GPUs, no tensor parallel and a model that fits one GPU, using one of them. "
        "Off: such a start is refused with the commands that run one worker per GPU in one share group "
        '(docs/operations.md, "Several GPUs on one host").',
        flag="--allow-idle-gpus",
    )
    enforce_eager: bool = opt(False, "Disable CUDA graphs (slower decode; faster start).", flag="--enforce-eager")
    block_size: int | None = opt(
        None,
        "KV-cache block size in tokens; prefixes are cached in whole blocks. Default: vLLM's.",
        flag="--block-size",
        ge=1,
    )
    dtype: str = opt("auto", "Weight and activation dtype (auto, bfloat16, float16, float32).", flag="--dtype")
    quantization: str | None = opt(
        None,
        "Weight quantization, e.g. fp8 (vLLM quantizes bf16/fp16 weights as it loads them; about half "
        "the weight memory, so more KV cache; check the model's answers on your own prompts). "
        "Default: none, or what the model's config says. Not on the CPU backend (logged and ignored there).",
        flag="--quantization",
    )
    kv_cache_dtype: str = opt(
        "auto",
        "KV-cache element type: auto (the model's dtype) or fp8 (half the bytes per token on the GPU "
        "and in the host tier: about twice the sessions whose prefixes stay cached; with the default "
        "tier it kept every returning session's prefix at 10x the sessions the bf16 GPU cache holds, "
        "docs/performance.md). Without calibrated scales vLLM uses 1.0: check the model's answers. "
        "Not on the CPU backend (logged and ignored there).",
        flag="--kv-cache-dtype",
    )
    kv_offload_gib: float | None = opt(
        None,
        "GiB of host memory (pinned) that keeps KV-cache blocks evicted from the GPU, so a session "
        "that returns after its prefix left the GPU loads it back instead of computing its whole "
        "prompt again (vLLM's kv_offloading_size). 0: off. Default (unset): sized at start from the "
        "memory available (MemAvailable, or the room under the worker's cgroup memory limit if less), "
        "less a reserve of 16 GiB or a fifth of it if more, for the engine, the worker, the page cache and other "
        "processes, shared among the host's GPUs (times tensor_parallel_size); the largest power of "
        "two GiB in that, as torch pins powers of two (a 40 GiB tier pins 64 GiB), at most 64 GiB, "
        "off below 1 GiB (64 GiB on a 125 GiB one-GPU host); off on the CPU backend. The start log "
        "says the size and the numbers it came from. The worker has torch pin it with 16 threads: "
        "the 64 GiB default made a 68 s start 76 s on an H100 host (docs/benchmarks/kv-tier-start.md).",
        flag="--kv-offload-gib",
        ge=0,
    )
    kv_offload_block_tokens: int = opt(
        256,
        "Tokens per block that the native host-memory KV tier stores and loads (vLLM's "
        "kv_connector_extra_config block_size): a multiple of the GPU cache's block_size. 0: the GPU "
        "cache's block (vLLM's default, 16 tokens on most GPUs). Larger blocks mean fewer transfers and "
        "less bookkeeping per engine step: with the 64 GiB default tier on an H200 (qwen3-1.7b geometry, "
        "320 sessions of 300-token prompts at once, raw vLLM), 16-token blocks gave 13.2-13.4k tok/s, "
        "256-token blocks 18.8-24.1k and the tier off 21.7-23.5k (docs/performance.md). A prompt's last "
        "partial block is not kept in the tier. Left at its default, it gives way to vLLM's unit where a "
        "set block_size does not divide it and for a model with recurrent layers (Mamba, linear "
        "attention, as its config.json says), whose cache blocks are sized to its state. Not used when "
        "engine.extra gives kv_transfer_config.",
        flag="--kv-offload-block-tokens",
        ge=0,
    )
    kv_offload_backend: Literal["native", "lmcache"] = opt(
        "native",
        "Who keeps the offloaded blocks: native (vLLM's CPU offloading connector, in this process) "
        "or lmcache (an LMCache server, configured in engine.extra's kv_transfer_config).",
        flag="--kv-offload-backend",
    )
    warmup: Literal["auto", "on", "off"] = opt(
        "auto",
        "Before announcing itself online, run a short warm-up through the engine: the sampling "
        "variants requests use (temperature, top_p, greedy, JSON output) at batch sizes up to "
        "warmup_max_batch, and a prompt long enough for chunked prefill, so that the first real "
        "requests do not wait for kernels compiled on first use. auto: on GPUs, off on the CPU backend.",
        flag="--warmup",
    )
    warmup_max_batch: int | None = opt(
        None,
        "Largest batch the warm-up runs (powers of two up to it). Default: the engine's max_num_seqs.",
        flag="--warmup-max-batch",
        ge=1,
    )
    warmup_timeout: float = opt(
        300.0,
        "Seconds the warm-up may take; what is left after it is skipped (and logged).",
        flag="--warmup-timeout",
        ge=0,
    )
    seed: int = opt(0, "Engine random seed.", flag="--seed")
    tool_parser: str = opt(
        "auto",
        "vLLM tool-call parser for the model's replies: auto (chosen from the chat template: hermes for "
        "<tool_call> templates such as Qwen2.5, QwQ and Qwen3, llama3_json for Llama 3.x), none (no tool "
        "calling), or a vLLM parser name.",
        flag="--tool-parser",
    )
    extra: dict[str, Any] = opt(
        {},
        "Any other vLLM engine argument, as a JSON object of AsyncEngineArgs fields.",
        flag="--engine-extra",
    )

    @field_validator("extra")
    @classmethod
    def _check_extra_depth(cls, value: dict[str, Any]) -> dict[str, Any]:
        if nesting(value) > MAX_EXTRA_DEPTH:
            raise ValueError(
                f"nests deeper than {MAX_EXTRA_DEPTH} levels of objects and arrays (vLLM's engine arguments nest a few)"
            )
        return value

    @model_validator(mode="after")
    def _check_limits(self) -> EngineConfig:
        """Both engine limits set, the token budget below the batch: refused here, where vLLM
        refused it only once imported, with a traceback (one running request takes at least one
        token of a step). One of them set alone is matched by the other's choice at start
        (engine/limits.py)."""
        seqs, tokens = self.set_limit("max_num_seqs"), self.set_limit("max_num_batched_tokens")
        if _plain_int(seqs) and _plain_int(tokens) and tokens < seqs:
            raise ValueError(
                f"max_num_batched_tokens ({tokens}) is below max_num_seqs ({seqs}): each running request takes "
                "at least one token of an engine step; raise max_num_batched_tokens, lower max_num_seqs, or set "
                "only one of them"
            )
        # The tier's blocks are whole GPU blocks: vLLM refuses others only once the engine is
        # up, with a traceback. Only a value the operator set is refused; the default gives way
        # at start to vLLM's unit (engine/vllm.py offload_block_args).
        block, unit = self.gpu_block_size(), self.kv_offload_block_tokens
        if "kv_offload_block_tokens" in self.model_fields_set and block and unit and unit % block:
            raise ValueError(
                f"kv_offload_block_tokens ({unit}) is not a multiple of block_size ({block}): the host-memory "
                f"tier keeps whole GPU cache blocks; use a multiple of {block}, or 0 for the GPU cache's block"
            )
        return self

    def gpu_block_size(self) -> int | None:
        """The KV cache's block size as the configuration sets it (engine.extra's, else the
        field's); None: vLLM's choice."""
        block = self.extra.get("block_size", self.block_size)
        return block if _plain_int(block) else None

    def set_limit(self, key: Literal["max_num_seqs", "max_num_batched_tokens"]) -> Any:
        """An engine limit as the configuration sets it: engine.extra's value, else the field's
        (None: unset, chosen at start)."""
        return self.extra.get(key, getattr(self, key))


def _plain_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


class HistoryConfig(Section):
    max_history_turns: int = opt(6, "Most user/assistant turns kept per session.", flag="--max-history-turns", ge=1)
    max_history_tokens: int = opt(
        2000,
        "Most tokens of kept turns per session (the system prompt is not counted).",
        flag="--max-history-tokens",
        ge=16,
    )
    system_prompt: str | None = opt(
        None,
        "System prompt of sessions whose first request has no systemPrompt.",
        flag="--system-prompt",
    )
    max_sessions: int = opt(
        10000,
        "Most sessions held in memory; beyond it the least recently used is dropped from memory "
        "(it stays in the store and is loaded again when it is used).",
        flag="--max-sessions",
        ge=1,
    )
    store: Literal["sqlite", "memory", "redis"] = opt(
        "sqlite",
        "Where sessions and answers live: sqlite (in state_dir; survives restarts and crashes), "
        "memory (lost when the worker stops; for tests and throwaway runs) or redis (shared by "
        "the workers of a share group, at redis.url; requests then go through Redis streams, "
        "see docs/scaling.md).",
        flag="--store",
    )
    state_dir: Path = opt(
        Path("state"),
        "Directory of the SQLite store (relative: to the working directory, which the systemd "
        "unit sets to its StateDirectory).",
        flag="--state-dir",
    )
    session_ttl: float = opt(
        7 * 24 * 3600.0,
        "Seconds after its last turn that a session, its answers and request keys are deleted; 0: never.",
        flag="--session-ttl",
        ge=0,
    )


class RedisConfig(Section):
    url: str = opt(
        "redis://127.0.0.1:6379/0",
        "Redis of the shared store (history.store = redis), as redis://[[user]:password@]host:port/db "
        "or rediss:// for TLS. Hidden in logs: it may carry a password.",
        flag="--redis-url",
        secret=True,
    )
    worker_lease: float = opt(
        10.0,
        "Seconds a worker counts as alive after its last heartbeat (renewed every third of it). "
        "Once it has passed, another worker takes over the dead one's unanswered requests.",
        flag="--redis-worker-lease",
        ge=1,
    )
    owner_lease: float = opt(
        3600.0,
        "Seconds a session stays with its worker after its last request; then the next request "
        "goes to whichever worker receives it. Longer than any request waits (request_deadline).",
        flag="--redis-owner-lease",
        ge=1,
    )
    route_to_owner: bool = opt(
        True,
        "Send each request to the worker that owns its session (its turns in order on one worker, "
        "its prefix cache warm). Off: the receiving worker runs it; for measurement only, as two "
        "workers may then run turns of one session at once.",
        flag="--redis-route-to-owner",
    )


class GenerationConfig(Section):
    max_tokens: int = opt(256, "Reply length cap when a request gives no maxTokens.", flag="--max-tokens", ge=1)
    max_tokens_limit: int = opt(
        1024,
        "Largest maxTokens a request may ask for; above it the request is invalid_request.",
        flag="--max-tokens-limit",
        ge=1,
    )
    # The sampling defaults below (model_default) are the model's own where the configuration
    # leaves them unset, as with `vllm serve` (generation_config "auto") and Ollama: the demo
    # model at the built-in 0.7 drifted into French word salad where its card recommends 0.2.
    # "Unset" is pydantic's fields-set: a key given anywhere, even at its default value, is set.
    # The server resolves them once at start (resolve_sampling); the rest reads the values.
    temperature: float = opt(
        0.7,
        "Sampling temperature of requests that give none. Unset: the model's generation_config.json "
        "value, else 0.7. Set (even to 0.7), it overrides the model's.",
        flag="--temperature",
        model_default=True,
        ge=0,
        le=2,
    )
    top_p: float = opt(
        0.95,
        "Nucleus sampling top_p of requests that give none. Unset: the model's generation_config.json "
        "value, else 0.95.",
        flag="--top-p",
        model_default=True,
        gt=0,
        le=1,
    )
    top_k: int = opt(
        0,
        "Top-k sampling of every request (0: off; requests have no field for it). Unset: the model's "
        "generation_config.json value, else off.",
        flag="--top-k",
        model_default=True,
        ge=-1,
    )
    min_p: float = opt(
        0.0,
        "Min-p sampling of every request (0: off; requests have no field for it). Unset: the model's "
        "generation_config.json value, else off.",
        flag="--min-p",
        model_default=True,
        ge=0,
        le=1,
    )
    repetition_penalty: float = opt(
        1.0,
        "Repetition penalty of every request (1: off; requests have no field for it). Unset: the model's "
        "generation_config.json value, else off.",
        flag="--repetition-penalty",
        model_default=True,
        gt=0,
        le=2,
    )
    stream_interval_ms: float = opt(
        50.0,
        "Stream deltas are published at most this often (the first at once); 0: every engine step.",
        flag="--stream-interval-ms",
        ge=0,
    )
    max_reasoning_tokens: int = opt(
        0,
        "Thinking budget of reasoning models: a generation still inside its think block after "
        "this many tokens is stopped, with finishReason reasoning_budget. 0: no budget of its own "
        "(maxTokens bounds the reasoning). Also the cap of a request's maxReasoningTokens.",
        flag="--max-reasoning-tokens",
        ge=0,
    )
    stop: list[str] = opt(
        [], "Extra stop strings. The end of turn is detected by the tokenizer's stop tokens.", flag="--stop"
    )
    json_disable_any_whitespace: bool = opt(
        True,
        "Structured output (responseFormat) as compact JSON, without whitespace outside strings; "
        "otherwise a weak model may pad the JSON with whitespace until maxTokens. Goes into vLLM's "
        "structured_outputs_config (backend xgrammar), whose keys in engine.extra take precedence.",
        flag="--json-disable-any-whitespace",
    )

    @model_validator(mode="after")
    def _check_limits(self) -> GenerationConfig:
        if self.max_tokens > self.max_tokens_limit:
            raise ValueError(f"max_tokens ({self.max_tokens}) exceeds max_tokens_limit ({self.max_tokens_limit})")
        return self

    def unset_model_defaults(self) -> list[str]:
        """The sampling defaults this configuration leaves to the model (not given by a flag,
        the environment or the TOML file)."""
        return [name for name in model_default_fields() if name not in self.model_fields_set]

    def engine_sampling(self) -> dict[str, Any]:
        """The sampling defaults that requests cannot change, as the engine applies them to
        every request (vLLM's SamplingParams names); left out where off."""
        return {name: getattr(self, name) for name, off in SAMPLING_OFF.items() if getattr(self, name) not in off}


MODEL_DEFAULTS_FILE = "generation_config.json"
# The values of the engine-wide sampling defaults that turn them off (vLLM: top_k 0 or -1).
SAMPLING_OFF: dict[str, tuple[float, ...]] = {"top_k": (0, -1), "min_p": (0.0,), "repetition_penalty": (1.0,)}


def model_default_fields() -> list[str]:
    """The GenerationConfig keys that come from the model's generation_config.json when unset."""
    return [name for name, info in GenerationConfig.model_fields.items() if _extra(info).get("model_default")]


def read_model_defaults(model: str | None) -> tuple[dict[str, Any], str | None]:
    """The sampling values of the model's generation_config.json (Hugging Face's names, which
    are the worker's), and a problem reading it, if any. A model that is not a local directory
    (a .gguf file), or a directory without the file, has none."""
    if not model:
        return {}, None
    path = Path(model).expanduser() / MODEL_DEFAULTS_FILE
    if not path.is_file():
        return {}, None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return {}, f"cannot read {path}: {exc}"
    if not isinstance(data, dict):
        return {}, f"{path} is not a JSON object"
    return {name: data[name] for name in model_default_fields() if data.get(name) is not None}, None


@dataclass(frozen=True)
class SamplingSource:
    """Where one effective sampling default came from."""

    name: str
    value: Any
    source: str  # "config", "model" or "built-in"
    note: str | None = None  # why a model's value was not taken


def resolve_sampling(
    generation: GenerationConfig, model_values: dict[str, Any], where: str = MODEL_DEFAULTS_FILE
) -> tuple[GenerationConfig, list[SamplingSource]]:
    """The effective sampling defaults, highest first: the configuration's (a flag, the
    environment or the TOML file), the model's (``model_values``, read from ``where``), the
    built-in default. A model's value outside the key's bounds is not taken (noted)."""
    unset = set(generation.unset_model_defaults())
    updates: dict[str, Any] = {}
    sources: list[SamplingSource] = []
    for name in model_default_fields():
        if name not in unset:
            sources.append(SamplingSource(name, getattr(generation, name), "config"))
            continue
        note = None
        if name in model_values:
            value = model_values[name]
            try:
                checked = GenerationConfig.model_validate({name: value})
            except ValidationError as exc:
                note = f"{where} has {name} = {value!r}, not usable: {exc.errors()[0]['msg']}"
            else:
                updates[name] = getattr(checked, name)
                sources.append(SamplingSource(name, updates[name], "model"))
                continue
        sources.append(SamplingSource(name, getattr(generation, name), "built-in", note))
    return generation.model_copy(update=updates), sources


class LimitsConfig(Section):
    max_payload_bytes: int = opt(
        65536, "Largest request payload in bytes; above it too_large.", flag="--max-payload-bytes", ge=64
    )
    max_message_tokens: int = opt(
        4096, "Largest user message in tokens; above it too_long.", flag="--max-message-tokens", ge=1
    )
    max_tool_result_bytes: int = opt(
        16384,
        "Largest tool result (one toolResults entry's content) in bytes; above it too_large.",
        flag="--max-tool-result-bytes",
        ge=1,
    )
    # 4096: four times what vllm serve runs at once on an H100 or H200 (max_num_seqs 1024), so a
    # burst of thousands of sessions waits in the worker's fair admission, not refused. At 1024,
    # 2,000 one-turn sessions at once on an H200 were answered busy beyond the 1,024th.
    max_pending_requests: int = opt(
        4096,
        "Requests accepted and not yet answered, all sessions together; above it busy. Also sent "
        "to the broker as the MQTT 5 Receive Maximum (at most 65535), so the broker holds back "
        "what would exceed it instead of sending it. The start warns where it is below what the "
        "engine takes at once (max_num_seqs and the requests admission queues in it).",
        flag="--max-pending-requests",
        ge=1,
    )
    max_queued_per_session: int = opt(
        4,
        "Requests of one session waiting behind its running turn; above it busy, so one chatty "
        "session cannot fill the worker.",
        flag="--max-queued-per-session",
        ge=1,
    )
    request_deadline: float = opt(
        300.0,
        "Seconds a request may wait, from its arrival at the worker until its turn starts; past "
        "it the request is answered with expired instead of generated. 0: no deadline (an MQTT "
        "Message Expiry on the request still applies).",
        flag="--request-deadline",
        ge=0,
    )
    max_deliveries: int = opt(
        3,
        "Deliveries of one request that ended without an answer (the worker crashed or the engine "
        "died on it) before it is answered with a final engine_error instead of generated again.",
        flag="--max-deliveries",
        ge=1,
    )
    drain_timeout: float = opt(
        60.0,
        "Seconds a stop waits for running generations before aborting them.",
        flag="--drain-timeout",
        ge=0,
    )
    max_requests_per_user_per_minute: int = opt(
        600,
        "Requests one user namespace (the topic level after the prefix) may send per minute, all "
        "its sessions together, in bursts of up to this many; above it rate_limited. 0: no limit.",
        flag="--max-requests-per-user-per-minute",
        ge=0,
    )


NAME_OF_TOOL = re.compile(r"[A-Za-z0-9_-]{1,64}")  # with fullmatch (TOPIC_PART says why)


def _json_object(value: Any, what: str) -> Any:
    """A JSON Schema given as JSON text (a TOML string) or as a table: the table."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"{what} is not valid JSON: {exc}") from None
        except RecursionError:  # which pydantic would let through, not a validation error
            raise ValueError(f"{what} is not usable JSON: its arrays or objects nest too deep") from None
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object (a JSON Schema)")
    return value


def _some_namespaces(value: list[str]) -> list[str]:
    if not value:
        raise ValueError('users must name at least one user namespace, or be ["*"] for all')
    return value


# The user namespaces a worker tool (or a vision topic) is offered to: at least one (or "*");
# never a default.
Namespaces = Annotated[list[str], AfterValidator(_some_namespaces)]


def namespace_allowed(users: Sequence[str], user: str) -> bool:
    """Whether a Namespaces allowlist lets the user namespace ``user`` in: it names it, or is "*"."""
    return "*" in users or user in users


class MqttToolConfig(Section):
    """One device tool: a named MQTT 5 request/response endpoint (``[[tools.mqtt]]``)."""

    name: str = Field(description="The tool's name as the model sees it (^[A-Za-z0-9_-]{1,64}$).")
    description: str | None = Field(None, description="What the tool does, for the model.")
    parameters: dict[str, Any] | None = Field(
        None, description="JSON Schema of the arguments: JSON text or a TOML table. None: no arguments."
    )
    topic: str = Field(description="Where the call's arguments are published (QoS 1); the device answers there.")
    timeout: float = Field(5.0, gt=0, le=3600, description="Seconds to wait for the device's response.")
    users: Namespaces = Field(description='User namespaces that may use it; ["*"]: all. No default.')
    confirm: bool = Field(False, description="The client must approve each call before the worker runs it.")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not NAME_OF_TOOL.fullmatch(value):
            raise ValueError(f"tool name {value[:80]!r} must match ^[A-Za-z0-9_-]{{1,64}}$")
        return value

    @field_validator("parameters", mode="before")
    @classmethod
    def _parameters(cls, value: Any) -> Any:
        value = _json_object(value, "parameters")
        if value is not None:
            # Checked as a client tool's parameters are: a bad schema is a config error at
            # start, never a request that fails later (and no reference is ever fetched).
            try:
                check_parameters(value)
            except SchemaUnusable as exc:
                raise ValueError(f"parameters: {exc.message}") from None
        return value

    @field_validator("description")
    @classmethod
    def _description(cls, value: str | None) -> str | None:
        if value is not None and not is_valid_text(value):
            raise ValueError("description is not valid Unicode (a lone surrogate)")
        return value

    @field_validator("topic")
    @classmethod
    def _topic(cls, value: str) -> str:
        if not value or any(c in value for c in "+#\x00") or value.startswith("$"):
            raise ValueError(f"topic {value[:120]!r} must be a plain topic name (no wildcards, no leading $)")
        return value


class McpServerConfig(Section):
    """One MCP server whose tools the worker may offer (``[[tools.mcp]]``)."""

    name: str = Field(description="Its tools are offered as <name>_<tool> (e.g. calc_add).")
    command: list[str] | None = Field(None, description="A stdio server: the command line that starts it.")
    url: str | None = Field(None, description="A streamable HTTP server: its URL (http://host:port/mcp).")
    env: dict[str, str] = Field({}, description="Extra environment variables of a stdio server.")
    allow: list[str] = Field(description='The server\'s tools that may be offered; ["*"]: all of them.')
    users: Namespaces = Field(description='User namespaces that may use its tools; ["*"]: all. No default.')
    timeout: float = Field(30.0, gt=0, le=3600, description="Seconds one call may take.")
    confirm: bool = Field(False, description="The client must approve each call of its tools first.")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9-]{1,32}", value):
            raise ValueError(f"MCP server name {value[:80]!r} must match ^[A-Za-z0-9-]{{1,32}}$")
        return value

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerConfig:
        if (self.command is None) == (self.url is None):
            raise ValueError(f"MCP server {self.name!r} needs exactly one of command (stdio) and url (HTTP)")
        if self.command is not None and not self.command:
            raise ValueError(f"MCP server {self.name!r}: command is empty")
        return self


class McpMqttConfig(Section):
    """MCP servers discovered on the broker (EMQX's MCP over MQTT; ``[tools.mcp_mqtt]``)."""

    server_filter: str | None = opt(
        None,
        "Server names to discover (an MQTT topic filter over the server name, e.g. 'devices/#'). None: no discovery.",
    )
    allow: list[str] = opt(["*"], 'Tools of discovered servers that may be offered; ["*"]: all.')
    users: list[str] = opt([], 'User namespaces that may use them; ["*"]: all. Required with a filter.')
    timeout: float = opt(30.0, "Seconds one call may take.", gt=0, le=3600)
    confirm: bool = opt(False, "The client must approve each call first.")
    topic_root: str = opt(
        "$mcp",
        "The first level of the MCP topics ($mcp-server/..., $mcp-rpc/...): '$mcp' as the "
        "specification says; another where the broker does not carry $ topics.",
    )

    @model_validator(mode="after")
    def _users_with_filter(self) -> McpMqttConfig:
        if self.server_filter is not None and not self.users:
            raise ValueError('tools.mcp_mqtt.users must be set with server_filter (["*"] for all namespaces)')
        return self


class ToolsConfig(Section):
    mqtt: list[MqttToolConfig] = opt(
        [],
        "Device tools: MQTT request/response endpoints the worker calls for the model ([[tools.mqtt]] "
        "tables; see docs/tools.md). As a flag or variable: one JSON object per tool.",
        flag="--tools-mqtt",
    )
    mcp: list[McpServerConfig] = opt(
        [],
        "MCP servers whose tools the worker offers ([[tools.mcp]] tables; see docs/tools.md). As a flag "
        "or variable: one JSON object per server.",
        flag="--tools-mcp",
    )
    mcp_mqtt: McpMqttConfig = opt(
        McpMqttConfig(),
        "MCP servers discovered on the broker ([tools.mcp_mqtt]; see docs/tools.md). As a flag or "
        "variable: a JSON object.",
        flag="--tools-mcp-mqtt",
    )
    max_tool_rounds: int = opt(
        8,
        "Rounds of worker tool calls in one request; the last round is generated without tools.",
        flag="--max-tool-rounds",
        ge=1,
        le=64,
    )
    max_calls_per_round: int = opt(
        8, "Worker tool calls one round may make; more get an error result.", flag="--max-calls-per-round", ge=1
    )
    max_tool_time: float = opt(
        60.0,
        "Seconds all worker tool calls of one request may take together; past it, calls get an error result "
        "and the model answers without tools.",
        flag="--max-tool-time",
        gt=0,
    )
    max_tool_result_tokens: int = opt(
        1024,
        "Longest worker tool result given to the model, in tokens; a longer one is cut, and the cut is "
        "noted to the model.",
        flag="--max-tool-result-tokens",
        ge=16,
    )
    max_tool_result_bytes: int = opt(
        65536,
        "Largest worker tool result (a device's answer, an MCP server's result) in bytes of UTF-8: a "
        "longer one is cut on a character boundary before its tokens are counted, and the cut is said to "
        "the model; then max_tool_result_tokens applies. Bounds the work one result costs (a 10 MB answer "
        "is never tokenized). Not limits.max_tool_result_bytes, which refuses a client's toolResults entry.",
        flag="--tools-max-tool-result-bytes",
        ge=256,
    )

    @model_validator(mode="after")
    def _unique_names(self) -> ToolsConfig:
        names = [tool.name for tool in self.mqtt]
        servers = [server.name for server in self.mcp]
        for kind, seen in (("tools.mqtt tool", names), ("tools.mcp server", servers)):
            duplicates = sorted({n for n in seen if seen.count(n) > 1})
            if duplicates:
                raise ValueError(f"two {kind}s are named {duplicates[0]!r}")
        return self


def _filters_overlap(first: str, second: str) -> bool:
    """Whether some topic name matches both filters."""
    a, b = first.split("/"), second.split("/")
    for index in range(max(len(a), len(b))):
        x = a[index] if index < len(a) else None
        y = b[index] if index < len(b) else None
        if x == "#" or y == "#":
            return True
        if x is None or y is None:
            return False
        if x != "+" and y != "+" and x != y:
            return False
    return True


class VisionTopicConfig(Section):
    """MQTT topics whose latest image a session may ask for (``[[vision.topics]]``): a camera's
    snapshots, such as Frigate's ``frigate/<camera>/<object>/snapshot``."""

    name: str = Field(description="What logs and metrics call it (^[A-Za-z0-9_-]{1,64}$).")
    topic: str = Field(
        description="An MQTT topic filter (+ and # allowed): a request's imageTopics entry must be a topic it matches."
    )
    users: Namespaces = Field(description='User namespaces that may read it; ["*"]: all. No default.')
    max_age: float = Field(
        60.0,
        ge=0,
        description="Oldest image taken, in seconds since the worker received it; an older one is "
        "waited on like a topic without one. A retained image the broker held before the worker "
        "subscribed has no known age: it is taken only with 0 (any age).",
    )
    timeout: float = Field(
        5.0, gt=0, le=600, description="Seconds to wait for an image where the topic has none recent enough."
    )

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not NAME_OF_TOOL.fullmatch(value):
            raise ValueError(f"vision topic name {value[:80]!r} must match ^[A-Za-z0-9_-]{{1,64}}$")
        return value

    @field_validator("topic")
    @classmethod
    def _topic(cls, value: str) -> str:
        levels = value.split("/")
        if (
            not value
            or value.startswith("$")
            or "\x00" in value
            or any(("+" in level or "#" in level) and len(level) > 1 for level in levels)
            or "#" in levels[:-1]
        ):
            raise ValueError(
                f"vision topic {value[:120]!r} must be an MQTT topic filter (+ a whole level, # the last "
                "level) that does not start with $"
            )
        return value

    def allows(self, user: str) -> bool:
        return namespace_allowed(self.users, user)


class VisionConfig(Section):
    max_request_bytes: int = opt(
        4 * 1024 * 1024,
        "Largest payload of a request that carries images, in bytes (base64 makes an image a third "
        "larger); above it too_large. limits.max_payload_bytes stays the limit of every other "
        "payload. The broker has its own limit, which must be at least this: mosquitto's "
        "message_size_limit (default: none), EMQX's mqtt.max_packet_size (default 1 MB).",
        flag="--max-image-request-bytes",
        ge=1024,
    )
    max_images_per_request: int = opt(
        4,
        "Images one request may carry: content parts, images and imageTopics together; above it invalid_request.",
        flag="--max-images-per-request",
        ge=1,
    )
    max_images_per_session: int = opt(
        32,
        "Images a session's kept history may hold; a request that would exceed it is refused "
        "(invalid_request) until a reset or the trimming of old turns makes room.",
        flag="--max-images-per-session",
        ge=1,
    )
    max_images_in_prompt: int = opt(
        8,
        "Images one prompt may hold, the kept history's included (the engine's limit_mm_per_prompt).",
        flag="--max-images-in-prompt",
        ge=1,
    )
    max_pixels: int = opt(
        1024 * 1024,
        "Pixels of an image as the model sees it: a larger image is scaled down to it (keeping its "
        "aspect) by the model's processor. Bounds an image's tokens: about max_pixels / 784 for "
        "Qwen2-VL and Qwen3-VL (28x28 pixels a token), 1337 tokens at the default.",
        flag="--max-pixels",
        ge=784,
    )
    image_threads: int | None = opt(
        None,
        "Threads that process images for the engine (scale, normalise and cut into patches: about "
        "45 ms for a 1024x768 image). Default: one, with vLLM's processor cache, which keeps an "
        "image that a session's history sends again from being processed again. More than one "
        "turns that cache off (it is not thread-safe); measured on a GPU host they gained little "
        "and stalled the first burst of images (docs/performance.md, Images).",
        flag="--image-threads",
        ge=1,
        le=64,
    )
    image_torch_threads: int | None = opt(
        None,
        "Torch threads that process one image (vLLM runs an image's resize and normalisation with "
        "OMP_NUM_THREADS threads, 1 where unset). Default: OMP_NUM_THREADS where set; else on a "
        "GPU host a quarter of the CPUs, at most 4; 1 on the CPU backend, whose model has the cores.",
        flag="--image-torch-threads",
        ge=1,
        le=64,
    )
    max_image_pixels: int = opt(
        50_000_000,
        "Largest image accepted, in pixels (width x height, read from its header before its "
        "pixels are decoded); above it invalid_request. Bounds the memory a decompression bomb "
        "can take (3 bytes a pixel).",
        flag="--max-image-pixels",
        ge=1,
    )
    max_stored_bytes_per_session: int = opt(
        32 * 1024 * 1024,
        "Bytes of images one session's stored history may hold (each image once, as sent); a "
        "request that would exceed it is refused (invalid_request).",
        flag="--max-image-bytes-per-session",
        ge=1,
    )
    max_stored_bytes_per_user: int = opt(
        256 * 1024 * 1024,
        "Bytes of images the stored sessions of one user namespace may hold together; a request that "
        "would exceed it is refused (invalid_request).",
        flag="--max-image-bytes-per-user",
        ge=1,
    )
    topics: list[VisionTopicConfig] = opt(
        [],
        "MQTT topics a session may read images from with imageTopics ([[vision.topics]] tables; see "
        "docs/protocol.md#images). As a flag or variable: one JSON object per topic.",
        flag="--vision-topics",
    )

    @model_validator(mode="after")
    def _unique_names(self) -> VisionConfig:
        names = [topic.name for topic in self.topics]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"two vision.topics are named {duplicates[0]!r}")
        return self


class StatsConfig(Section):
    interval: float = opt(
        30.0, "Seconds between stats log lines and stats messages; 0 disables.", flag="--stats-interval", ge=0
    )
    metrics_port: int | None = opt(
        None,
        "TCP port of a Prometheus /metrics endpoint (see docs/operations.md, Metrics). Default: none, no endpoint.",
        flag="--metrics-port",
        ge=1,
        le=65535,
    )
    metrics_host: str = opt(
        "127.0.0.1",
        "Address the /metrics endpoint listens on. Loopback by default: the endpoint has no "
        "authentication or TLS and tells whoever reaches it the worker's load, model and version. "
        "Use 0.0.0.0 or an interface address only where a firewall lets only Prometheus reach it.",
        flag="--metrics-host",
    )


class LoggingConfig(Section):
    level: Literal["TRACE", "DEBUG", "INFO", "WARNING", "ERROR"] = opt(
        "INFO", "Log level. Message text is logged at DEBUG only.", flag="--log-level"
    )
    json_logs: bool = opt(False, "Log one JSON object per line (for journald/log shippers).", flag="--log-json")
    vllm_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = opt(
        "WARNING",
        "Log level of vLLM's own lines (in the worker and in vLLM's engine processes). At INFO, "
        "vLLM logs its whole configuration and every step of the model load (35 lines on a CPU "
        "engine's start); the worker's own start lines say what each phase took either way.",
        flag="--vllm-log-level",
    )

    @field_validator("level", "vllm_level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value


class WorkerConfig(Section):
    mqtt: MqttConfig = MqttConfig()
    engine: EngineConfig = EngineConfig()
    history: HistoryConfig = HistoryConfig()
    redis: RedisConfig = RedisConfig()
    generation: GenerationConfig = GenerationConfig()
    limits: LimitsConfig = LimitsConfig()
    stats: StatsConfig = StatsConfig()
    logging: LoggingConfig = LoggingConfig()
    tools: ToolsConfig = ToolsConfig()
    vision: VisionConfig = VisionConfig()

    @field_validator("vision")
    @classmethod
    def _vision_topics_outside_the_workers(cls, vision: VisionConfig, info: ValidationInfo) -> VisionConfig:
        # A vision topic under the worker's prefix would let a session read other sessions'
        # requests and replies as "images". (mqtt is validated before vision: declared first.)
        mqtt = info.data.get("mqtt")
        if mqtt is None:
            return vision
        own = mqtt.topic_prefix + "/#"
        for entry in vision.topics:
            if _filters_overlap(entry.topic, own):
                raise ValueError(
                    f"vision topic {entry.name!r} ({entry.topic}) overlaps the worker's own topics ({own})"
                )
        return vision

    @property
    def effective_worker_id(self) -> str:
        return self.mqtt.worker_id or default_worker_id(self.engine.visible_devices)

    def mqtt_password(self) -> str | None:
        """The password from the file, else the value given directly."""
        return self.mqtt.password_value()

    def masked(self) -> dict[str, Any]:
        """The effective config as plain data, secrets replaced by ``***``."""
        data = self.model_dump(mode="json")
        for section, fields in sections().items():
            for name, info in fields.items():
                if field_is_secret(info) and data[section][name] is not None:
                    data[section][name] = "***"
        data["mqtt"]["worker_id"] = self.effective_worker_id
        for name in self.generation.unset_model_defaults():  # the model's, resolved at start
            data["generation"][name] = None
        return data


def nvidia_gpu_present() -> bool:
    """Whether this machine has an NVIDIA driver with a device (without importing torch, which
    takes seconds): the driver's control device exists on every host and container with one."""
    return Path("/dev/nvidiactl").exists()


def default_worker_id(visible_devices: str | None, *, gpu: bool | None = None) -> str:
    """``<host>-gpu<devices>`` (``-gpuall`` for every GPU), so that one worker per GPU on a host
    never share a client id; ``<host>-cpu`` on a machine without a GPU (``gpu``: whether it
    has one; default: looked up)."""
    host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:100] or "host"
    if visible_devices:
        return f"{host}-gpu{re.sub(r'[^0-9A-Za-z]+', '_', visible_devices).strip('_')}"
    if gpu is None:
        gpu = nvidia_gpu_present()
    return f"{host}-gpuall" if gpu else f"{host}-cpu"


def sections() -> dict[str, dict[str, Any]]:
    """Section name -> {key -> pydantic FieldInfo}, in declaration order."""
    out: dict[str, dict[str, Any]] = {}
    for name, info in WorkerConfig.model_fields.items():
        section_model = info.annotation
        assert isinstance(section_model, type) and issubclass(section_model, Section)
        out[name] = dict(section_model.model_fields)
    return out


def _extra(info: Any) -> dict[str, Any]:
    extra = info.json_schema_extra
    return extra if isinstance(extra, dict) else {}


def field_is_secret(info: Any) -> bool:
    return bool(_extra(info).get("secret"))


def field_is_model_default(info: Any) -> bool:
    return bool(_extra(info).get("model_default"))


def flag_for(section: str, key: str, info: Any) -> str:
    flag = _extra(info).get("flag")
    return str(flag) if flag else f"--{section}-{key}".replace("_", "-")


def env_for(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()
