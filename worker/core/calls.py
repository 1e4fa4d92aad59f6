"""Tool calling, without I/O: the session's tools, the client's results, the model's calls
checked, and the grammar of a forced call.

The engine adapter parses a reply with vLLM's parser for the model's family (``ToolParser`` in
engine/port.py); what it finds is checked here against the declared tools before anything
leaves the worker: a call to an undeclared tool, arguments that are not a JSON object, or
(for strict tools and forced calls) arguments that break the tool's schema are never passed
on as calls. The reply then carries the model's text and says what was wrong.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema

from ..engine.port import ParsedTools, ToolCallFormat
from ..protocol.messages import (
    ChatRequest,
    ErrorCode,
    NamedToolChoice,
    RequestError,
    ToolResult,
    ToolSpecIn,
)
from ..schemacheck import SchemaUnusable, grammar_schema, validator
from ..session import DECLINED_RESULT, NOT_RUN_RESULT, AssistantMessage, ToolCall, ToolResultMessage, ToolSpec, Turn
from .history import partial_tag_suffix


def specs_from_request(tools: Sequence[ToolSpecIn]) -> list[ToolSpec]:
    return [ToolSpec(t.function.name, t.function.description, t.function.parameters, t.function.strict) for t in tools]


def call_key(scope: str, session: str, key: str) -> str:
    """What a request's call ids are derived from: the deployment's ``scope`` (the topic
    prefix and the worker's share group, or its id), the ``session`` (``user/session``) and the
    request's ``key``. The key alone is the client's ``requestId``, which any client may
    choose: two users, or two sessions, sending ``"requestId": "h1"`` would name their calls
    alike, and a device that deduplicates by ``toolCallId`` would answer one with the other's
    result. With the namespace and the session in it, no client can name another's calls; a
    redelivery of the same request (the same scope, session and key) names them as before.
    JSON: the parts cannot run into each other, and any text encodes."""
    return json.dumps([scope, session, key])


def call_id(request: str, round_: int, index: int) -> str:
    """A call's id, derived from the request's ``call_key``, the round and the call's place
    in it: the same request (a redelivery) names its calls the same way."""
    return f"{round_prefix(request, round_)}{index}"


def round_prefix(request: str, round_: int) -> str:
    """What the ids of a round's calls begin with (``request``: its ``call_key``)."""
    digest = hashlib.sha256(f"{request}\x00{round_}".encode()).hexdigest()[:16]
    return f"call_{digest}_"


@dataclass(frozen=True)
class ToolPlan:
    """What a request does with the session's tools."""

    offered: bool  # the model may call tools: its reply is parsed for calls
    forced: tuple[ToolSpec, ...] = ()  # required / named: the reply is one call to one of these


def plan_tools(
    request: ChatRequest, tools: Sequence[ToolSpec], *, round_in_request: int = 0, final: bool = False
) -> ToolPlan:
    """The request's toolChoice over the session's tools; RequestError for a choice that
    names an undeclared tool or forces a call with no tools, or for responseFormat together
    with tools the model may call (vLLM silently drops the calls then: vllm-project/vllm#39929).
    A forced choice applies to the request's first generation only (``round_in_request`` 0):
    the rounds after the worker's calls are ``auto``; the ``final`` one is ``none``."""
    choice = request.tool_choice
    if final:
        choice = "none"
    elif round_in_request > 0 and choice != "none":
        choice = "auto"
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, NamedToolChoice):
        named = choice.function.name
        chosen = [t for t in tools if t.name == named]
        if not chosen:
            declared = ", ".join(t.name for t in tools) or "none"
            raise RequestError(
                ErrorCode.INVALID_REQUEST,
                f"toolChoice names tool {named[:80]!r}, which is not declared (the session's tools: {declared[:300]})",
            )
        plan = ToolPlan(True, (chosen[0],))
    elif choice == "required":
        if not tools:
            raise RequestError(ErrorCode.INVALID_REQUEST, "toolChoice 'required' needs tools; the session has none")
        plan = ToolPlan(True, tuple(tools))
    elif choice == "auto":
        plan = ToolPlan(bool(tools))
    else:
        plan = ToolPlan(False)
    if plan.offered and request.response_format is not None:
        raise RequestError(
            ErrorCode.INVALID_REQUEST,
            "responseFormat cannot be combined with tools the model may call: set toolChoice to 'none' "
            "for a formatted reply, or leave out responseFormat",
        )
    return plan


def apply_results(
    turn: Turn, results: Sequence[ToolResult], max_bytes: int, confirmable: Collection[str] = ()
) -> list[ToolCall]:
    """Add the client's answers to the turn's pending calls, in the calls' order: a client
    tool's result (``content``), or for a worker tool that asked for confirmation (its name in
    ``confirmable``) the approval: declined calls get a result saying so; the approved ones are
    returned, still pending, for the worker to run. Refused (RequestError, nothing changed)
    when nothing is pending, an id is not pending, a pending call has no answer, an answer is
    of the wrong kind, or a result is larger than max_bytes."""
    pending = turn.pending_calls()
    if not pending:
        raise RequestError(ErrorCode.INVALID_REQUEST, "toolResults sent, but the session has no pending tool calls")
    by_id = {call.id: call for call in pending}
    given = {result.tool_call_id: result for result in results}
    unknown = [r.tool_call_id for r in results if r.tool_call_id not in by_id]
    if unknown:
        raise RequestError(
            ErrorCode.INVALID_REQUEST,
            f"toolCallId {unknown[0][:140]!r} is not a pending call of this session "
            f"(pending: {', '.join(by_id)[:400]})",
        )
    missing = [call.id for call in pending if call.id not in given]
    if missing:
        raise RequestError(
            ErrorCode.INVALID_REQUEST, f"toolResults has no result for the pending call(s) {', '.join(missing)[:400]}"
        )
    for call in pending:
        result = given[call.id]
        if call.name in confirmable and result.approved is None:
            raise RequestError(
                ErrorCode.INVALID_REQUEST,
                f"toolCallId {call.id!r} is a worker tool's call that needs confirmation: answer it with "
                "'approved': true or false, not with 'content'",
            )
        if call.name not in confirmable and result.content is None:
            raise RequestError(
                ErrorCode.INVALID_REQUEST,
                f"toolCallId {call.id!r} is a call of the client's tool {call.name!r}: answer it with its 'content'",
            )
        size = len((result.content or "").encode())
        if size > max_bytes:
            raise RequestError(
                ErrorCode.TOO_LARGE,
                f"the result of toolCallId {call.id[:140]!r} is {size} bytes; the limit is {max_bytes}",
            )
    approved: list[ToolCall] = []
    for call in pending:
        result = given[call.id]
        if result.approved:
            approved.append(call)
        elif result.approved is False:
            turn.messages.append(ToolResultMessage(call.id, call.name, DECLINED_RESULT))
        else:
            turn.messages.append(ToolResultMessage(call.id, call.name, result.content or ""))
    return approved


def order_results(turn: Turn) -> None:
    """Put the tool messages after the turn's last assistant message in its calls' order (the
    worker's parallel calls end in any order; the template shows results as the calls were made)."""
    last = turn.last_assistant()
    if last < 0:
        return
    message = turn.messages[last]
    assert isinstance(message, AssistantMessage)
    order = {call.id: index for index, call in enumerate(message.tool_calls)}
    tail = turn.messages[last + 1 :]
    results = [m for m in tail if isinstance(m, ToolResultMessage)]
    if len(results) == len(tail):
        results.sort(key=lambda m: order.get(m.call_id, len(order)))
        turn.messages[last + 1 :] = results


def close_unanswered(turn: Turn) -> None:
    """A new message while calls are pending: each pending call gets a result saying it was
    not run, so the template never sees a call without its result."""
    for call in turn.pending_calls():
        turn.messages.append(ToolResultMessage(call.id, call.name, NOT_RUN_RESULT))


def escape_raw_controls(body: str) -> str:
    """A forced call's JSON as strict JSON. The grammar backend lets raw control characters
    (U+0000-U+001F) into JSON strings, which JSON forbids unescaped: on the QwQ-32B geometry
    (random weights, H100, vLLM 0.26 with xgrammar) 7 of 200 forced calls had one and failed
    every strict parser, vLLM's included. Re-encoded, their structure unchanged, they parse."""
    try:
        json.loads(body)
        return body
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python decodes
        pass
    try:
        value = json.loads(body, strict=False)
    except (ValueError, RecursionError):
        return body  # cut off at maxTokens, say: the parser reports it
    return json.dumps(value, ensure_ascii=False)


@dataclass(frozen=True)
class CheckedCalls:
    content: str  # the text before the calls (all of it when there are none)
    calls: tuple[ToolCall, ...] = ()
    error: str | None = None  # why markup in the text was not taken as calls


def check_calls(
    text: str, parsed: ParsedTools, tools: Sequence[ToolSpec], *, key: str, round_: int, validate_all: bool
) -> CheckedCalls:
    """The parser's calls, checked, and named by ``key`` (the request's ``call_key``): each
    names a declared tool and has a JSON object as its arguments; for strict tools (and every
    tool when ``validate_all``: a forced call) the arguments also validate against the tool's
    parameters. Any failure: no calls, the text as
    the model wrote it, and the reason."""
    if not parsed.calls:
        if parsed.markup:
            return CheckedCalls(text, error="the model wrote a tool call that could not be parsed")
        return CheckedCalls(text)
    declared = {tool.name: tool for tool in tools}
    calls: list[ToolCall] = []
    for index, (name, arguments_text) in enumerate(parsed.calls):
        tool = declared.get(name)
        if tool is None:
            return CheckedCalls(text, error=f"the model called {name[:80]!r}, which is not a declared tool")
        try:
            arguments = json.loads(arguments_text)
        except (ValueError, RecursionError):  # a model can write "[[[[..." past the decoder's depth
            return CheckedCalls(text, error=f"the arguments of the call to {name!r} are not valid JSON")
        if not isinstance(arguments, dict):
            return CheckedCalls(text, error=f"the arguments of the call to {name!r} are not a JSON object")
        if validate_all or tool.strict:
            problem = schema_violation(arguments, tool.arguments_schema())
            if problem is not None:
                return CheckedCalls(
                    text, error=f"the arguments of the call to {name!r} break its parameters: {problem}"
                )
        calls.append(ToolCall(call_id(key, round_, index), name, arguments))
    return CheckedCalls(parsed.content, tuple(calls))


def schema_violation(value: Any, schema: dict[str, Any]) -> str | None:
    """Why ``value`` breaks ``schema`` (None: it does not). References resolve only within the
    schema (schemacheck.REGISTRY): nothing is fetched, whatever the schema says."""
    try:
        error = jsonschema.exceptions.best_match(validator(schema).iter_errors(value))
    except RecursionError:
        return "unusable schema: it nests too deep to check"
    except Exception as exc:  # checked when the tool was declared or offered: should not happen
        return f"unusable schema: {str(getattr(exc, 'message', exc))[:200]}"
    if error is None:
        return None
    where = error.json_path if error.json_path != "$" else "the arguments"
    return f"{where}: {error.message[:200]}"


def forced_call_schema(tools: Sequence[ToolSpec], form: ToolCallFormat) -> dict[str, Any]:
    """The JSON Schema of one call in the model's own format ({"name": ..., "arguments": ...}
    for Hermes): what a forced call's JSON is constrained to. Each tool's arguments schema is
    no longer the root here, so its references are rewritten (schemacheck.grammar_schema):
    each subschema a reference leads to (``#``, ``#/properties/...``, ``#/$defs/...``, an
    anchor) moves to the combined schema's $defs as ``t<tool>_<n>``, and every reference
    points there."""
    options: list[dict[str, Any]] = []
    defs: dict[str, Any] = {}
    for index, tool in enumerate(tools):
        try:
            arguments, tool_defs = grammar_schema(tool.arguments_schema(), prefix=f"t{index}_")
        except SchemaUnusable as exc:  # a session stored before its tools were checked this way
            raise RequestError(ErrorCode.INVALID_SCHEMA, f"tool {tool.name!r}: parameters: {exc.message}") from None
        defs.update(tool_defs)
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.name}, form.arguments_key: arguments},
                "required": ["name", form.arguments_key],
                "additionalProperties": False,
            }
        )
    combined: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    if defs:
        combined = {**combined, "$defs": defs}
    return combined


class MarkupHold:
    """Keeps tool-call markup out of stream deltas: text goes out as it comes until a marker
    (``<tool_call>``) begins; from there on nothing more is streamed (the calls come in the
    reply). A possible marker split over deltas is held until it is told apart. Leading
    markers (Llama 3's bare ``{``) count only before any other answer text."""

    def __init__(self, form: ToolCallFormat) -> None:
        self.markers, self.leading = form.markers, form.leading_markers
        self.stopped = False
        self._held = ""
        self._started = False  # non-whitespace answer text has gone out

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        held = self._held + text
        if not self._started:
            body = held.lstrip()
            if any(body.startswith(m) for m in self.leading):
                self.stopped, self._held = True, ""
                return held[: len(held) - len(body)]
            if body and any(m.startswith(body) for m in self.leading):
                self._held = held
                return ""
        found = [i for i in (held.find(m) for m in self.markers) if i >= 0]
        if found:
            self.stopped, self._held = True, ""
            out = held[: min(found)]
        else:
            keep = max((partial_tag_suffix(held, m) for m in self.markers), default=0)
            out, self._held = held[: len(held) - keep], held[len(held) - keep :]
        self._started = self._started or bool(out.strip())
        return out

    def flush(self) -> str:
        """The end of the generation: what was held as a possible marker was text after all."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
