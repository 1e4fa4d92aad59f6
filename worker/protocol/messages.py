"""Wire models: the JSON payloads of the MQTT contract (docs/protocol.md).

Field names on the wire are camelCase, compatible with the script this worker replaces
(``{"sessionId": ..., "message": ..., "maxTokens": ...}``). No I/O here.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError
from pydantic.alias_generators import to_camel

from ..schemacheck import MAX_SCHEMA_DEPTH as MAX_SCHEMA_DEPTH  # the schema caps, as they were named here
from ..schemacheck import MAX_SCHEMA_NODES as MAX_SCHEMA_NODES
from ..schemacheck import (
    SchemaUnusable,
    check_parameters,
    check_schema,
)
from .images import (
    ImageError,
    ImageInput,
    ImageLimits,
    may_carry_images,
    parse_content_parts,
    parse_images,
)

# Tools: OpenAI's limits on names and on how many a request may declare.
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128
TOOL_CALLS = "tool_calls"  # finishReason of a reply that asks the client to run tools


class ErrorCode(str, Enum):
    """Every error a reply can carry. Documented in docs/protocol.md."""

    BAD_JSON = "bad_json"  # payload is not a JSON object
    INVALID_REQUEST = "invalid_request"  # wrong field, type or value
    TOO_LONG = "too_long"  # message or prompt does not fit the token limits
    TOO_LARGE = "too_large"  # payload exceeds max_payload_bytes
    BUSY = "busy"  # too many requests pending
    EXPIRED = "expired"  # the request waited past its deadline
    RATE_LIMITED = "rate_limited"  # the namespace sent too many requests
    INVALID_SCHEMA = "invalid_schema"  # responseFormat schema unusable
    UNSUPPORTED_ACTION = "unsupported_action"  # unknown control action
    ENGINE_ERROR = "engine_error"  # the engine failed this request
    INTERNAL_ERROR = "internal_error"  # an unexpected error in the worker; sending again may work
    STORE_UNAVAILABLE = "store_unavailable"  # the session store cannot be used now; send again later
    SESSION_UNREADABLE = "session_unreadable"  # the session's stored history is damaged; reset it
    DUPLICATE_REQUEST = "duplicate_request"  # requestId answered before a reset; send a new requestId


class RequestError(Exception):
    """A request that is answered with an error reply instead of a generation."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class WireModel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    def to_json(self) -> bytes:
        return self.model_dump_json(by_alias=True, exclude_none=True).encode()


class InboundModel(WireModel):
    """Client payloads: camelCase names only, so a snake_case typo is an error, not ignored.
    Types are strict: ``"5"`` is not a number, ``2.0`` or ``true`` not an integer, ``1`` not a
    boolean; a client that sends the wrong type has a bug it should hear about."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=False, extra="forbid", strict=True)


class JsonSchemaFormat(InboundModel):
    """Reply with JSON valid for ``schema`` (a JSON Schema object)."""

    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class JsonObjectFormat(InboundModel):
    """Reply with any JSON object."""

    type: Literal["json_object"]


ResponseFormat = Annotated[JsonSchemaFormat | JsonObjectFormat, Field(discriminator="type")]


class FunctionSpec(InboundModel):
    """A tool's function, as OpenAI's API declares it."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments object
    strict: bool | None = None


class ToolSpecIn(InboundModel):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(InboundModel):
    name: str


class NamedToolChoice(InboundModel):
    """toolChoice naming the one tool the model must call."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice


class ToolResult(InboundModel):
    """The client's answer to one of the session's pending tool calls: its result (``content``,
    for a client tool), or its approval (``approved``, for a worker tool with confirm = true,
    which the client was asked to approve with ``needsConfirmation``)."""

    tool_call_id: str = Field(min_length=1, max_length=128)
    content: str | None = None
    approved: bool | None = None


class ChatRequest(InboundModel):
    # Exactly one of message and toolResults (checked by parse_chat_request; said in the schema).
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=False,
        extra="forbid",
        strict=True,
        json_schema_extra={
            "oneOf": [
                {"required": ["message"], "properties": {"message": {"type": ["string", "array"]}}},
                {"required": ["toolResults"], "properties": {"toolResults": {"type": "array"}}},
            ]
        },
    )

    # The text. On the wire also a list of OpenAI content parts (text and image_url), which
    # parse_chat_request turns into this text and image_inputs (the JSON Schema says both).
    # "" only with images (checked by parse_chat_request).
    message: str | None = None
    session_id: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    system_prompt: str | None = None
    request_id: str | None = Field(None, min_length=1, max_length=128)
    stream: bool = False
    response_format: ResponseFormat | None = None
    include_reasoning: bool = False
    max_reasoning_tokens: int | None = Field(None, ge=1)
    # Tool calling (docs/protocol.md#tools): tools are kept by the session, like systemPrompt;
    # toolChoice applies to this request; toolResults answer the session's pending calls.
    tools: list[ToolSpecIn] | None = None
    tool_choice: ToolChoice | None = None
    tool_results: list[ToolResult] | None = None
    # The worker's own tools this session may use (docs/tools.md): names, or ["*"] for every
    # tool its user namespace may use; kept by the session like tools; [] clears.
    worker_tools: list[str] | None = None
    # Images (docs/protocol.md#images): Ollama's base64 strings, placed before the text; and
    # MQTT topics whose latest image the worker reads for this message ([[vision.topics]]).
    images: list[str] | None = None
    image_topics: list[str] | None = None
    # Every image the message carries, decoded from base64, in order: content parts first,
    # then images (imageTopics are the vision topics' to read). Set by parse_chat_request.
    _image_inputs: tuple[ImageInput, ...] = PrivateAttr(default=())

    @property
    def image_inputs(self) -> tuple[ImageInput, ...]:
        # Read from pydantic's dict of private values: ``self._image_inputs`` goes through
        # BaseModel.__getattr__, 5.7 us a read against 0.2 for a field (pydantic 2, 2 cores),
        # and every request reads it.
        private = self.__pydantic_private__
        return private.get("_image_inputs", ()) if private else ()

    @property
    def image_count(self) -> int:
        """The images this message asks for, its topics' included."""
        return len(self.image_inputs) + len(self.image_topics or ())


class ControlRequest(InboundModel):
    action: str
    request_id: str | None = Field(None, min_length=1, max_length=128)


class Usage(WireModel):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # Of prompt_tokens, those the prompt's images took (vision models; left out without images).
    image_tokens: int | None = None
    # Of completion_tokens, those spent inside the think block (reasoning models only).
    reasoning_tokens: int | None = None


class Latency(WireModel):
    queue_ms: float  # received -> handed to the engine (session order and admission)
    ttft_ms: float  # received -> first generated token
    total_ms: float  # received -> reply built (its turn is then committed to the store, then published)
    # Of ttft_ms, by the engine's own clock (vLLM's request stats; left out where it keeps none):
    # waiting in its scheduler's queue (queued -> first scheduled), and computing the prompt
    # (first scheduled -> first token). The rest is the way to the engine and back.
    engine_queue_ms: float | None = None
    prefill_ms: float | None = None


# finishReason of a reply whose thinking used up its budget (the request's reasoningBudget,
# else generation.reasoning_budget): the worker stopped the generation there.
REASONING_BUDGET = "reasoning_budget"


class FunctionCall(WireModel):
    name: str
    arguments: str  # the JSON text of an object


class ToolCallOut(WireModel):
    """A call the client is asked to run (OpenAI's shape)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
    # A worker tool with confirm = true: the worker runs it once the client answers with
    # {"toolCallId": ..., "approved": true} (false: the model is told the user declined).
    needs_confirmation: bool | None = None


class WorkerCallOut(WireModel):
    """A call the worker ran itself during the request, and how it ended."""

    id: str
    name: str
    arguments: str  # the JSON text of an object
    result: str  # as the model got it, cut to WORKER_RESULT_CHARS for the reply
    outcome: str  # ok, error, timeout, unavailable, declined, unknown, skipped
    duration_ms: float
    round: int


class RoundOut(WireModel):
    """One generation of a request that ran tool rounds."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ms: float  # the generation's wall time
    tool_ms: float  # the worker calls that followed it, in wall time (0: none)


class ToolEvent(WireModel):
    """A worker call starting or ending, on the stream topic."""

    event: Literal["start", "end"]
    tool_call_id: str
    name: str
    round: int
    duration_ms: float | None = None  # end only
    outcome: str | None = None  # end only


class ChatReply(WireModel):
    session_id: str
    request_id: str
    reply: str
    reasoning: str | None = None  # the think block, when the request asked for it
    tool_calls: list[ToolCallOut] | None = None  # finishReason tool_calls: run these, send toolResults
    # Set when the model wrote tool-call markup that is not a valid call (malformed JSON, an
    # undeclared tool, arguments that are not an object): the reply is then its text as written.
    tool_parse_error: str | None = None
    # The worker's own calls made while answering (docs/tools.md), and its generations.
    worker_calls: list[WorkerCallOut] | None = None
    rounds: list[RoundOut] | None = None
    finish_reason: str
    usage: Usage
    latency: Latency


class ErrorBody(WireModel):
    code: ErrorCode
    message: str


class ErrorReply(WireModel):
    session_id: str
    request_id: str | None = None
    error: ErrorBody


class ControlReply(WireModel):
    session_id: str
    action: Literal["reset"]
    ok: bool = True


class StreamDelta(WireModel):
    request_id: str
    seq: int
    delta: str  # answer text ("" in a delta of reasoning)
    reasoning: str | None = None  # reasoning text, only with includeReasoning
    # The last event of a reply that calls tools announces them (the reply carries them too).
    tool_calls: list[ToolCallOut] | None = None
    tool_event: ToolEvent | None = None  # a worker call started or ended (delta "")


def _load_json(payload: bytes, *, keep: bool = False) -> Any:
    """The payload's JSON value; RequestError(bad_json) unless it is UTF-8 JSON text whose
    strings are all valid Unicode. ``keep``: the caller only reads the value, and the next call
    for the same payload object gets it instead of a second decode (a request's payload is read
    for its requestId, then as the request: one decode at intake, not two)."""
    kept = _kept[0]
    _kept[0] = None
    if kept is not None and kept[0] is payload:
        return kept[1]
    data = _decode_json(payload)
    if keep:
        _kept[0] = (payload, data)
    return data


_kept: list[tuple[bytes, Any] | None] = [None]


def _decode_json(payload: bytes) -> Any:
    try:
        # Decoded here, not by json.loads: that would also take UTF-16 and UTF-32.
        text = payload.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(ErrorCode.BAD_JSON, f"payload is not UTF-8: {exc}") from None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:  # ValueError: also an int of over 4300 digits
        raise RequestError(ErrorCode.BAD_JSON, f"payload is not valid JSON: {str(exc)[:200]}") from None
    # A "\ud800" escape decodes to a lone surrogate, which no reply echoing it (a requestId,
    # an unknown field's name) could be encoded with. Only a \u escape can make one (the
    # UTF-8 decoding above refuses encoded surrogates): a payload without one is not encoded
    # again (53 ms for a 4 MB request with an image, measured on the 2-core CI machine).
    if b"\\u" in payload:
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except (UnicodeEncodeError, RecursionError):
            raise RequestError(ErrorCode.BAD_JSON, "payload has a string that is not valid Unicode") from None
    return data


def _payload_object(payload: bytes) -> dict[str, Any]:
    data = _load_json(payload)
    if not isinstance(data, dict):
        raise RequestError(ErrorCode.BAD_JSON, "payload must be a JSON object")
    return data


def _validation_message(exc: ValidationError, prefix: str = "") -> str:
    parts = []
    for error in exc.errors():
        field = ".".join([prefix, *(str(p) for p in error["loc"])] if prefix else [str(p) for p in error["loc"]])
        field = field or "payload"
        if error["type"] == "extra_forbidden":
            parts.append(f"unknown field '{field}'")
        else:
            parts.append(f"'{field}': {error['msg']}")
    return "; ".join(parts)


# The longest topic name MQTT allows, in bytes of UTF-8.
MAX_TOPIC_BYTES = 65535


def parse_chat_request(
    payload: bytes,
    session: str,
    max_payload_bytes: int,
    images: ImageLimits | None = None,
    *,
    model: str | None = None,
    check_schemas: bool = True,
) -> ChatRequest:
    """Validate a request payload for the session named by its topic.

    ``images``: the limits of a request with images, None where the model takes none (a
    request with images is then refused, naming ``model``). A payload over
    ``max_payload_bytes`` is refused unread unless it may carry images; then it may be up to
    ``images.max_request_bytes``, and is refused once read if it carries none; its text
    (message and system prompt) is held to ``max_payload_bytes`` all the same.
    ``check_schemas``: False leaves the JSON Schemas (check_request_schemas) to the caller."""
    size = len(payload)
    over = size > max_payload_bytes
    if over and (images is None or size > images.max_request_bytes or not may_carry_images(payload)):
        limit = f"the limit is {max_payload_bytes}"
        if images is not None and images.max_request_bytes > max_payload_bytes:
            limit += f" ({images.max_request_bytes} with images)"
        raise RequestError(ErrorCode.TOO_LARGE, f"payload is {size} bytes; {limit}")
    data = _payload_object(payload)
    content = data.get("message")
    if isinstance(content, list):
        # OpenAI content parts: checked here, so that their errors name the part, and the
        # request model keeps the text as the one message the core renders.
        text, part_images = _content_parts(content)
        data = {**data, "message": text}
    else:
        part_images = []
    try:
        request = ChatRequest.model_validate(data)
    except ValidationError as exc:
        message = _validation_message(exc)
        if "message" not in data and "toolResults" not in data:
            message += "; 'message' (or 'toolResults') is required"
        raise RequestError(ErrorCode.INVALID_REQUEST, message) from None
    if request.session_id is not None and request.session_id != session:
        raise RequestError(
            ErrorCode.INVALID_REQUEST, f"sessionId {request.session_id[:140]!r} differs from the topic's session"
        )
    if (request.message is None) == (request.tool_results is None):
        raise RequestError(ErrorCode.INVALID_REQUEST, "a request carries exactly one of 'message' and 'toolResults'")
    asks_images = bool(part_images) or request.images is not None or request.image_topics is not None
    if request.message == "" and not asks_images:
        raise RequestError(ErrorCode.INVALID_REQUEST, "'message': String should have at least 1 character")
    if asks_images:
        request._image_inputs = _request_images(request, part_images, images, model)
    if over and not request._image_inputs:
        raise RequestError(
            ErrorCode.TOO_LARGE,
            f"payload is {size} bytes; the limit is {max_payload_bytes} for a request without images",
        )
    if over:
        # Images raise the payload's limit, not the text's: the text is tokenized (its length
        # checked, then the prompt), and 4 MiB of it beside a tiny image held the event loop
        # for 4 s while its tokens were counted. A payload within the limit has no more text.
        text_bytes = len((request.message or "").encode(errors="surrogatepass"))
        text_bytes += len((request.system_prompt or "").encode(errors="surrogatepass"))
        if text_bytes > max_payload_bytes:
            raise RequestError(
                ErrorCode.TOO_LARGE,
                f"the request's text is {text_bytes} bytes; the limit is {max_payload_bytes}, with images too",
            )
    if request.tools is not None:
        check_tools(request.tools, parameters=False)
    if check_schemas:
        check_request_schemas(request)
    if request.tool_results is not None:
        check_tool_results(request.tool_results)
    if request.worker_tools is not None:
        check_worker_tool_names(request.worker_tools)
    return request


def _content_parts(content: list[Any]) -> tuple[str, list[ImageInput]]:
    try:
        return parse_content_parts(content)
    except ValidationError as exc:
        raise RequestError(ErrorCode.INVALID_REQUEST, _validation_message(exc, "message")) from None
    except ImageError as exc:
        raise RequestError(ErrorCode.INVALID_REQUEST, str(exc)) from None


def _request_images(
    request: ChatRequest, part_images: list[ImageInput], limits: ImageLimits | None, model: str | None
) -> tuple[ImageInput, ...]:
    """The request's images, decoded, once its shape is known to be right: refused where the
    model takes none, with tool results, over the count, or not images (invalid_request)."""
    if limits is None:
        named = f"the model {model[:200]!r}" if model else "this worker's model"
        raise RequestError(ErrorCode.INVALID_REQUEST, f"{named} does not take images (it has no vision)")
    if request.message is None:
        raise RequestError(ErrorCode.INVALID_REQUEST, "images come with a 'message', not with 'toolResults'")
    topics = request.image_topics or []
    count = len(part_images) + len(request.images or ()) + len(topics)
    if count > limits.max_images:
        raise RequestError(
            ErrorCode.INVALID_REQUEST,
            f"the request carries {count} images (content parts, images and imageTopics together); "
            f"the limit is {limits.max_images}",
        )
    if request.images is not None and not request.images:
        raise RequestError(ErrorCode.INVALID_REQUEST, "'images' is empty")
    if request.image_topics is not None:
        check_image_topics(request.image_topics)
    try:
        return (*part_images, *parse_images(request.images or ()))
    except ImageError as exc:
        raise RequestError(ErrorCode.INVALID_REQUEST, str(exc)) from None


def check_image_topics(topics: list[str]) -> None:
    """The shape of imageTopics (which topics the user may read is the vision topics' to say,
    in the same words for one not allowed as for one not configured): MQTT topic names."""
    if not topics:
        raise RequestError(ErrorCode.INVALID_REQUEST, "'imageTopics' is empty")
    for index, topic in enumerate(topics):
        if (
            not topic
            or any(c in topic for c in "+#\x00")
            or topic.startswith("$")
            or len(topic.encode("utf-8", "surrogatepass")) > MAX_TOPIC_BYTES
        ):
            raise RequestError(
                ErrorCode.INVALID_REQUEST,
                f"'imageTopics.{index}' {topic[:120]!r} is not a topic name (no wildcards, no leading $)",
            )
    if len(set(topics)) != len(topics):
        raise RequestError(ErrorCode.INVALID_REQUEST, "'imageTopics' names a topic twice")


def check_worker_tool_names(names: list[str]) -> None:
    """The shape of workerTools (which names are configured and allowed is the toolbox's to
    say): tool names, or ["*"] alone."""
    if len(names) > MAX_TOOLS:
        raise RequestError(ErrorCode.INVALID_REQUEST, f"'workerTools' has {len(names)} names; the limit is {MAX_TOOLS}")
    if "*" in names and names != ["*"]:
        raise RequestError(ErrorCode.INVALID_REQUEST, "'workerTools' is [\"*\"] alone, or a list of tool names")
    for name in names:
        if name != "*" and not TOOL_NAME.fullmatch(name):
            raise RequestError(ErrorCode.INVALID_REQUEST, f"'workerTools' has {name[:80]!r}, which is not a tool name")
    if len(set(names)) != len(names):
        raise RequestError(ErrorCode.INVALID_REQUEST, "'workerTools' names a tool twice")


def has_schemas(request: ChatRequest) -> bool:
    """Whether the request carries JSON Schemas to check (check_request_schemas)."""
    return isinstance(request.response_format, JsonSchemaFormat) or any(
        tool.function.parameters is not None for tool in request.tools or ()
    )


def check_request_schemas(request: ChatRequest) -> None:
    """Refuse (invalid_schema) a request whose responseFormat schema or a tool's parameters the
    worker cannot use. CPU-bound and in proportion to the schemas' size: checking each
    subschema against its metaschema costs 0.3-0.5 ms (2 cores), and a 62 KB payload of 128
    tools of 45 properties each took 2.3 s. The service runs it on a thread, in the request's
    turn: not on the event loop, and after the cheap refusals (tool calling not set up)."""
    if isinstance(request.response_format, JsonSchemaFormat):
        check_json_schema(request.response_format.json_schema)
    if request.tools is not None:
        check_tools(request.tools)


def check_tools(tools: list[ToolSpecIn], *, parameters: bool = True) -> None:
    """Refuse a tool list with too many tools, an invalid or duplicate name (invalid_request),
    or (``parameters``) an unusable parameters schema (invalid_schema, checked like a
    responseFormat schema). Every message names the tool."""
    if len(tools) > MAX_TOOLS:
        raise RequestError(ErrorCode.INVALID_REQUEST, f"'tools' has {len(tools)} tools; the limit is {MAX_TOOLS}")
    seen: set[str] = set()
    for index, tool in enumerate(tools):
        name = tool.function.name
        if not TOOL_NAME.fullmatch(name):
            raise RequestError(
                ErrorCode.INVALID_REQUEST,
                f"'tools.{index}.function.name' {name[:80]!r} is not a valid tool name: "
                "1 to 64 of A-Z, a-z, 0-9, _ and -",
            )
        if name in seen:
            raise RequestError(ErrorCode.INVALID_REQUEST, f"tool {name!r} is declared twice in 'tools'")
        seen.add(name)
        schema = tool.function.parameters
        if schema is None or not parameters:
            continue
        try:
            check_parameters(schema)
        except SchemaUnusable as exc:
            raise RequestError(ErrorCode.INVALID_SCHEMA, f"tool {name!r}: parameters: {exc.message}") from None


def check_tool_results(results: list[ToolResult]) -> None:
    """Refuse an empty list or one that answers a call twice; whether each call is pending is
    the session's to say (core/calls.py)."""
    if not results:
        raise RequestError(ErrorCode.INVALID_REQUEST, "'toolResults' is empty")
    seen: set[str] = set()
    for result in results:
        if result.tool_call_id in seen:
            raise RequestError(
                ErrorCode.INVALID_REQUEST, f"'toolResults' answers toolCallId {result.tool_call_id[:140]!r} twice"
            )
        seen.add(result.tool_call_id)
        if (result.content is None) == (result.approved is None):
            raise RequestError(
                ErrorCode.INVALID_REQUEST,
                f"the toolResults entry of {result.tool_call_id[:140]!r} carries exactly one of 'content' "
                "(a client tool's result) and 'approved' (a worker tool's confirmation)",
            )


def check_json_schema(schema: dict[str, Any]) -> None:
    """Refuse (invalid_schema) a schema the worker cannot use (schemacheck.check_schema): not
    a valid JSON Schema, a reference to another document (only local references, "#/..." or
    "#anchor", are allowed: nothing is ever fetched) or one that does not resolve, text that
    is not valid Unicode, or too large or deep to be compiled into a grammar in reasonable time."""
    try:
        check_schema(schema)
    except SchemaUnusable as exc:
        raise RequestError(ErrorCode.INVALID_SCHEMA, exc.message) from None


def parse_control(payload: bytes, max_payload_bytes: int) -> ControlRequest:
    if len(payload) > max_payload_bytes:
        raise RequestError(ErrorCode.TOO_LARGE, f"payload is {len(payload)} bytes; the limit is {max_payload_bytes}")
    try:
        return ControlRequest.model_validate(_payload_object(payload))
    except ValidationError as exc:
        raise RequestError(ErrorCode.INVALID_REQUEST, _validation_message(exc)) from None


def request_key(topic: str, payload: bytes, request_id: str | None, mid: int = 0) -> str:
    """The idempotency key: the client's requestId; else a hash of topic and payload with the
    MQTT packet id, which a redelivery of the message keeps (and a new message of the same
    text does not get: two publishes of "continue" are two turns). A QoS 0 message (no packet
    id) is never redelivered: its key is unique. The service tells a new message that reuses
    an answered key (a packet id used again) by MQTT's DUP flag."""
    if request_id:
        return request_id
    digest = hashlib.sha256(topic.encode() + b"\x00" + payload).hexdigest()[:24]
    return f"h-{digest}-{mid}" if mid else f"h-{digest}-{secrets.token_hex(4)}"


def fresh_key(key: str) -> str:
    """Another key for a new message whose hash key is already taken (see request_key)."""
    return f"{key}-{secrets.token_hex(4)}"


# What a client-chosen name may hold to be logged as it is; anything else is logged escaped.
_PLAIN_LOG_TEXT = re.compile(r"[A-Za-z0-9._:@+=~-]+")


def log_text(text: str, limit: int = 64) -> str:
    """A client-chosen name (a requestId, a topic) as a log line shows it: as sent when it is
    plain, else quoted and escaped (repr: no line break, control character or terminal escape
    reaches the log, so it cannot forge a line); cut after ``limit`` characters, marked "…"."""
    cut = text[:limit]
    shown = cut if _PLAIN_LOG_TEXT.fullmatch(cut) else repr(cut)
    return shown + ("…" if len(text) > limit else "")


def log_ref(key: str | None) -> str:
    """How logs name a request: its key, the requestId the client sent or the ``h-…`` key the
    reply carries (``requestId``), so that grep finds it; escaped and cut (log_text). A
    requestId is an id the client chose, not message text, which is logged at DEBUG only."""
    if key is None:
        return "-"
    return log_text(key)


def best_effort_request_id(payload: bytes, max_payload_bytes: int | None = None) -> str | None:
    """The requestId of a payload that failed validation, so its error can be correlated.
    None for a payload over max_payload_bytes: refusing it must not cost a parse of it."""
    if max_payload_bytes is not None and len(payload) > max_payload_bytes:
        return None
    try:
        data = _load_json(payload, keep=True)
    except RequestError:
        return None
    value = data.get("requestId") if isinstance(data, dict) else None
    return value if isinstance(value, str) and 0 < len(value) <= 128 else None


class StatsReport(BaseModel):
    """The stats message (camelCase JSON on <prefix>/_worker/<id>/stats)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)

    worker_id: str
    timestamp: float
    uptime_s: float
    interval_s: float
    # cumulative since start
    processed: int
    errors: int
    errors_by_code: dict[str, int]
    cancelled: int
    invalid_topics: int
    prompt_tokens_total: int
    completion_tokens_total: int
    cached_tokens_total: int
    # over the last interval; the averages and percentiles are None (left out of the JSON)
    # when it had no replies: no requests in the window, where 0 would read as a measurement
    requests: int
    avg_latency_ms: float | None = None
    p50_latency_ms: float | None = None
    p95_latency_ms: float | None = None
    avg_ttft_ms: float | None = None
    p95_ttft_ms: float | None = None
    avg_queue_ms: float | None = None
    avg_engine_queue_ms: float | None = None  # of the replies whose engine said (Latency.engine_queue_ms)
    gen_tokens_per_s: float
    # from the engine's scheduler
    prefix_cache_hit_rate: float | None = None  # over the interval, 0..1; None: no prompt looked up
    prefix_cache_hit_rate_total: float  # since start, 0..1
    kv_cache_usage: float  # 0..1
    # where the prompt tokens' KV came from over the interval (the engine's prefill counters):
    gpu_hit_tokens: int  # found in the GPU's prefix cache
    host_hit_tokens: int  # loaded back from the host-memory tier (kv_offload_gib)
    computed_prompt_tokens: int  # computed (prefilled)
    avg_recomputed_tokens_per_turn: float | None = None  # a reply's prompt tokens not found cached, averaged
    kv_offload_gib: float  # size of the host-memory tier; 0: off
    running: int
    waiting: int
    max_running: int  # most requests running at once during the interval
    # worker
    sessions: int
    pending: int
    # The worker's own tool calls since start, by outcome (ok, error, timeout, unavailable, ...);
    # left out when it made none.
    tool_calls: dict[str, int] | None = None

    def to_json(self) -> bytes:
        return self.model_dump_json(by_alias=True, exclude_none=True).encode()

    def log_line(self) -> str:
        if self.avg_latency_ms is None or self.p95_latency_ms is None or self.avg_ttft_ms is None:
            replies = "no requests in the window"
        else:
            replies = (
                f"AvgLatency={self.avg_latency_ms / 1000:.2f}s, P95={self.p95_latency_ms / 1000:.2f}s, "
                f"TTFT={self.avg_ttft_ms / 1000:.3f}s, Gen={self.gen_tokens_per_s:.1f} tok/s"
            )
        prefix = "" if self.prefix_cache_hit_rate is None else f"PrefixHit={self.prefix_cache_hit_rate * 100:.1f}%, "
        # "GPU hit" only beside a host-memory tier (GPUs only): elsewhere the one cache's hits.
        if self.kv_offload_gib > 0:
            sources = f"(GPU hit/host hit/computed)={self.gpu_hit_tokens}/{self.host_hit_tokens}/"
        else:
            sources = f"(cache hit/computed)={self.gpu_hit_tokens}/"
        recomputed = self.avg_recomputed_tokens_per_turn
        return (
            f"Stats: Processed={self.processed}, Errors={self.errors}, {replies}, "
            f"{prefix}KV={self.kv_cache_usage * 100:.1f}%, "
            f"PromptTokens{sources}{self.computed_prompt_tokens}, "
            + ("" if recomputed is None else f"RecomputedPerTurn={recomputed:.0f}, ")
            + f"Running={self.running}, MaxRunning={self.max_running}, Waiting={self.waiting}, "
            f"Sessions={self.sessions}, Pending={self.pending}"
        )
