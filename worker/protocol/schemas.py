"""JSON Schemas (draft 2020-12) of the MQTT contract's payloads, generated from the wire models.

``python -m worker.protocol.schemas docs/schemas`` writes one ``<name>.schema.json`` per payload; a test
fails when the committed files are stale. No I/O at import.

- Inbound payloads (request, control) are validated with ``extra="forbid"``: their schemas say
  ``additionalProperties: false``, as the worker refuses unknown fields.
- Outbound payloads (reply, error, control reply, stream delta, stats) describe what this
  version sends: fields the worker leaves out when unset are optional and never ``null``,
  fields it always sends are required. They do not forbid other fields: a client should ignore
  fields it does not know, which a newer worker may add (``worker.chat`` does).
- The worker status is plain text (``online`` / ``offline``), not JSON: it has no schema.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode

from ..config.models import GenerationConfig, LimitsConfig, VisionConfig
from ..schemacheck import MAX_SCHEMA_DEPTH, MAX_SCHEMA_NODES
from .images import CONTENT_PARTS, MEDIA_TYPES
from .messages import (
    ChatReply,
    ChatRequest,
    ControlReply,
    ControlRequest,
    ErrorReply,
    StatsReport,
    StreamDelta,
)
from .topics import WORKER_NAMESPACE, Inbound

DRAFT = "https://json-schema.org/draft/2020-12/schema"
SUFFIX = ".schema.json"


def session_topic(kind: str) -> str:
    return f"<prefix>/<user>/<session>/{kind}"


def worker_topic(kind: str) -> str:
    return f"<prefix>/{WORKER_NAMESPACE}/<workerId>/{kind}"


@dataclass(frozen=True)
class Payload:
    """One payload of the contract: its model, where it travels, and what its schema cannot say."""

    name: str  # the file's stem
    title: str
    model: type[BaseModel]
    topic: str  # the topic layout of worker/protocol/topics.py, <prefix> being topic_prefix (default chat)
    inbound: bool  # client -> worker (validated), else worker -> client
    about: str  # the topic's delivery and the rules a schema cannot express

    def description(self) -> str:
        direction = "client → worker" if self.inbound else "worker → client"
        return f"Published on `{self.topic}` ({direction}). {self.about} See docs/protocol.md."


def request_rules() -> str:
    """What the worker checks in a request beyond its schema (limits at their defaults)."""
    generation, limits, vision = GenerationConfig(), LimitsConfig(), VisionConfig()
    return (
        "QoS 1, not retained (a retained request is ignored). A field that is absent or null takes the "
        "worker's configured default. Checked by the worker beyond this schema: the payload is UTF-8 JSON "
        "text without lone surrogates (else `bad_json`) of at most `max_payload_bytes` bytes (default "
        f"{limits.max_payload_bytes}; else `too_large`); `sessionId`, if given, equals the topic's "
        f"`<session>`; `maxTokens` is at most `max_tokens_limit` (default {generation.max_tokens_limit}); "
        "types are strict, so an integer written with a fraction (`2.0`), which JSON Schema counts as an "
        "integer, is refused (all `invalid_request`); the message is at most `max_message_tokens` tokens "
        f"(default {limits.max_message_tokens}) and, with `maxTokens`, fits the model's context (else "
        "`too_long`); `responseFormat.schema` is a valid JSON Schema for its `$schema` (default the latest "
        f"draft), nests at most {MAX_SCHEMA_DEPTH} levels, holds at most {MAX_SCHEMA_NODES} values and uses "
        "only what the grammar backend supports (else `invalid_schema`); requests per user namespace are "
        "limited (`rate_limited`) and so are pending ones (`busy`, `expired`). Tools: names are unique, "
        "`toolChoice` names a declared tool, `parameters` is checked like `responseFormat.schema` "
        "(`invalid_schema`, naming the tool), `toolResults` answer exactly the session's pending calls, each "
        f"of at most `max_tool_result_bytes` bytes (default {limits.max_tool_result_bytes}; else `too_large`). "
        "Images: a payload with images may be up to `vision.max_request_bytes` bytes (default "
        f"{vision.max_request_bytes}; else `too_large`); an `image_url` is a `data:` URL of a JPEG, PNG, GIF, "
        "WebP or BMP image in strict base64, never fetched, and so is each `images` entry; at most "
        f"`vision.max_images_per_request` images (default {vision.max_images_per_request}) with "
        "`imageTopics`, each a topic the configuration's `[[vision.topics]]` lets the user namespace read; "
        "a model without vision takes none (all `invalid_request`)."
    )


PAYLOADS: tuple[Payload, ...] = (
    Payload("request", "Chat request", ChatRequest, session_topic(Inbound.REQUEST.value), True, request_rules()),
    Payload(
        "control",
        "Control message",
        ControlRequest,
        session_topic(Inbound.CONTROL.value),
        True,
        "QoS 1. Actions: `reset` (answered with a control reply), `cancel` (with the `requestId` of "
        "the request to abort; no answer of its own). Any other action is answered with the error "
        "`unsupported_action`, not `invalid_request`. UTF-8 JSON of at most `max_payload_bytes` bytes.",
    ),
    Payload(
        "reply",
        "Chat reply",
        ChatReply,
        session_topic("reply"),
        False,
        "QoS 1, or on the request's MQTT 5 ResponseTopic where allowed. `finishReason` is `stop`, "
        "`length`, `cancelled` or `truncated` (a string, not an enum: an engine may report another "
        "reason). The reply topic also carries error replies (with `error`) and control replies "
        "(with `action`).",
    ),
    Payload(
        "error",
        "Error reply",
        ErrorReply,
        session_topic("reply"),
        False,
        "QoS 1, or on the request's MQTT 5 ResponseTopic where allowed. `requestId` is absent only "
        "when no key could be read from the payload.",
    ),
    Payload(
        "control-reply",
        "Control reply",
        ControlReply,
        session_topic("reply"),
        False,
        "QoS 1: the answer to a `reset` control message.",
    ),
    Payload(
        "stream-delta",
        "Stream delta",
        StreamDelta,
        session_topic("stream"),
        False,
        "QoS 0, for requests with `stream: true`. `seq` counts from 0 per request; the final reply "
        "on the reply topic is the authoritative text.",
    ),
    Payload(
        "stats",
        "Worker stats",
        StatsReport,
        worker_topic("stats"),
        False,
        "QoS 1, retained, every `stats_interval` seconds. Counters are cumulative since the worker "
        "started; latencies, `requests` and `genTokensPerS` cover the last interval; rates and "
        "`kvCacheUsage` are fractions 0..1. An interval without replies (`requests` 0: no requests "
        "in the window) has no latencies and no `avgRecomputedTokensPerTurn`, and one in which the "
        "engine looked up no prompt has no `prefixCacheHitRate`: those fields are left out.",
    ),
)


def _tidy(node: dict[str, Any]) -> None:
    """Pydantic titles each property after its alias ("Sessionid"): noise, removed; so is a
    default of null (the worker's configured default applies)."""
    for prop in node.get("properties", {}).values():
        prop.pop("title", None)
        if "default" in prop and prop["default"] is None:
            del prop["default"]


def _outbound(node: dict[str, Any]) -> None:
    """What to_json() sends: None fields are left out (optional, never null), others always present."""
    required: list[str] = node.setdefault("required", [])
    for name, prop in node.get("properties", {}).items():
        branches = prop.get("anyOf")
        if isinstance(branches, list) and {"type": "null"} in branches:
            kept = [branch for branch in branches if branch != {"type": "null"}]
            del prop["anyOf"]
            if len(kept) == 1:
                prop.update(kept[0])
            else:
                prop["anyOf"] = kept
        elif name not in required:
            required.append(name)
    if node.get("additionalProperties") is False:
        del node["additionalProperties"]


def _objects(schema: dict[str, Any]) -> list[dict[str, Any]]:
    """The schema itself and its $defs that describe objects."""
    nodes = [schema, *schema.get("$defs", {}).values()]
    return [node for node in nodes if node.get("type") == "object"]


def _with_content_parts(schema: dict[str, Any]) -> dict[str, Any]:
    """The request's ``message``: text, or OpenAI content parts, which parse_chat_request
    turns into the text and the images the request model keeps (so the model's own schema
    says text only)."""
    parts = CONTENT_PARTS.json_schema(ref_template="#/$defs/{model}")
    schema.setdefault("$defs", {}).update(parts.pop("$defs"))
    parts["minItems"] = 1
    schema["properties"]["message"] = {
        "anyOf": [{"type": "string"}, parts],
        "description": "The user's message: text (not empty, unless the request carries images), or a list "
        "of OpenAI content parts, text and image_url (a data: URL of " + ", ".join(MEDIA_TYPES) + ").",
    }
    # An empty text only beside images.
    schema["anyOf"] = [
        {"required": ["images"]},
        {"required": ["imageTopics"]},
        {"properties": {"message": {"not": {"const": ""}}}},
    ]
    return schema


def schema_for(payload: Payload) -> dict[str, Any]:
    mode: JsonSchemaMode = "validation" if payload.inbound else "serialization"
    generated = payload.model.model_json_schema(by_alias=True, mode=mode)
    if payload.model is ChatRequest:
        generated = _with_content_parts(generated)
    for node in _objects(generated):
        _tidy(node)
        if not payload.inbound:
            _outbound(node)
    generated.pop("title", None)
    generated.pop("description", None)
    head = {
        "$schema": DRAFT,
        "$id": payload.name + SUFFIX,
        "title": payload.title,
        "description": payload.description(),
    }
    return head | generated


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def rendered() -> dict[str, str]:
    """File name -> text, for every payload."""
    return {payload.name + SUFFIX: render(schema_for(payload)) for payload in PAYLOADS}


def write(directory: Path) -> list[Path]:
    """Write every schema into directory; remove stale ``*.schema.json`` files there."""
    directory.mkdir(parents=True, exist_ok=True)
    files = rendered()
    for stale in directory.glob("*" + SUFFIX):
        if stale.name not in files:
            stale.unlink()
    written = []
    for name, text in files.items():
        path = directory / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m worker.protocol.schemas DIRECTORY   (e.g. docs/schemas)", file=sys.stderr)
        return 2
    for path in write(Path(args[0])):
        print(path)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
