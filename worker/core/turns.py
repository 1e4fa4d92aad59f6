"""One turn of a session: prompt, generation, streaming, reply.

The service decides *whether* and *when* a request runs (validation, admission, per-session
order); the TurnRunner runs it: builds the trimmed prompt from the session's history, streams
the generation from the engine (publishing deltas when asked), stores the turn, and builds the
reply with its token counts and latencies.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from loguru import logger

from ..config.models import GenerationConfig
from ..engine.port import (
    Engine,
    EngineDead,
    EngineError,
    GenerationRequest,
    SamplingOptions,
    StructuredOutput,
    StructuredOutputRejected,
    ToolSupport,
)
from ..protocol.messages import (
    REASONING_BUDGET,
    TOOL_CALLS,
    ChatReply,
    ChatRequest,
    ErrorCode,
    FunctionCall,
    JsonSchemaFormat,
    Latency,
    RequestError,
    StreamDelta,
    ToolCallOut,
    Usage,
    log_ref,
)
from ..protocol.packets import split_to_fit
from ..protocol.topics import SessionAddress, Topics
from ..session import THINK_CLOSE, SessionHistory, ToolCall, Turn, assistant_message
from ..transport.port import InboundMessage, Publisher
from .history import (
    HistoryLimits,
    PromptRenderer,
    ReasoningSplitter,
    build_prompt,
    split_reasoning,
    user_message,
)
from .stats import StatsCollector
from .tools import (
    MarkupHold,
    ToolPlan,
    apply_results,
    check_calls,
    close_unanswered,
    escape_raw_controls,
    forced_call_schema,
    plan_tools,
    rounds_in,
    specs_from_request,
)


@dataclass
class SessionRuntime:
    """What is in flight for one session; dropped when the session goes idle."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    waiting: int = 0  # tasks (turns and resets) waiting for the lock
    running: dict[str, str] = field(default_factory=dict)  # request key -> engine request id
    cancelled: set[str] = field(default_factory=set)  # keys cancelled while queued
    messages: dict[str, list[InboundMessage]] = field(default_factory=dict)  # key -> copies to ack


@dataclass(frozen=True)
class ReplyTarget:
    """Where a request's answer goes: a topic, and the MQTT 5 correlation data to echo."""

    topic: str
    correlation_data: bytes | None


@dataclass
class Outcome:
    """What a generation produced, and when."""

    submitted: float  # time.monotonic() when handed to the engine
    first_token: float | None = None
    text: str = ""
    finish_reason: str = "stop"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning: str | None = None  # the think block, when the request asked for it
    reasoning_tokens: int | None = None  # completion tokens spent reasoning (a model that thinks)
    tool_calls: tuple[ToolCall, ...] = ()  # calls for the client to run (finish_reason tool_calls)
    tool_parse_error: str | None = None  # call markup that was not a valid call


@dataclass
class PendingTurn:
    """One accepted request on its way through the session queue and the engine."""

    message: InboundMessage
    address: SessionAddress
    target: ReplyTarget
    key: str
    request: ChatRequest
    runtime: SessionRuntime
    deadline: float | None = None  # time.monotonic() by which its turn must start, else expired


@dataclass(frozen=True)
class TurnAnswer:
    """A turn's reply, and the session's new state to commit with it (None: nothing changes,
    as for a request cancelled before it ran)."""

    payload: bytes
    state: SessionHistory | None


def structured_output(request: ChatRequest) -> StructuredOutput | None:
    """The engine's form of the request's responseFormat (None: free text)."""
    if request.response_format is None:
        return None
    if isinstance(request.response_format, JsonSchemaFormat):
        return StructuredOutput(json_schema=request.response_format.json_schema)
    return StructuredOutput()


def reasoning_budget(request: ChatRequest, generation: GenerationConfig, *, structured: bool = False) -> int:
    """The request's thinking budget in tokens (0: none): its maxReasoningTokens capped by the
    configured max_reasoning_tokens, else that. Structured output (a responseFormat, a forced
    call) has no think block."""
    if structured:
        return 0
    configured, asked = generation.max_reasoning_tokens, request.max_reasoning_tokens
    if asked is None:
        return configured
    return min(asked, configured) if configured else asked


def ms_between(start: float, end: float) -> float:
    return round((end - start) * 1000, 1)


class _DeltaStream:
    """A request's stream deltas: the first published at once (the client's time to first
    token), later ones gathered and published at most once per ``stream_interval_ms``. One
    MQTT message per token would cost the worker more than a chat display gains from it
    (measured on the CPU: a third of batch-1 decode speed)."""

    def __init__(self, runner: TurnRunner, turn: PendingTurn) -> None:
        self._publisher = runner.publisher
        self._topic = runner.topics.stream(turn.address)
        self._request_id = turn.key
        self._interval = runner.generation.stream_interval_ms / 1000
        self._pending: list[str] = []
        self._reasoning = False  # what the pending text is: reasoning or answer
        self._seq = 0
        self._last = 0.0

    def add(self, text: str, *, reasoning: bool = False) -> None:
        if reasoning != self._reasoning:
            self.flush()  # a delta carries one kind of text
            self._reasoning = reasoning
        self._pending.append(text)
        if self._seq == 0 or time.monotonic() - self._last >= self._interval:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        limit = self._publisher.payload_limit(self._topic, qos=0)
        payloads = split_to_fit("".join(self._pending), self._delta, self._seq, limit)
        for payload in payloads:
            self._publisher.publish(self._topic, payload, qos=0)
        self._pending.clear()
        self._seq += len(payloads)
        self._last = time.monotonic()

    def announce(self, calls: list[ToolCallOut]) -> None:
        """The event that says the reply calls tools (after the last text delta)."""
        self.flush()
        payload = StreamDelta(request_id=self._request_id, seq=self._seq, delta="", tool_calls=calls).to_json()
        limit = self._publisher.payload_limit(self._topic, qos=0)
        if limit is None or len(payload) <= limit:
            self._publisher.publish(self._topic, payload, qos=0)
            self._seq += 1

    def _delta(self, seq: int, text: str) -> bytes:
        if self._reasoning:
            return StreamDelta(request_id=self._request_id, seq=seq, delta="", reasoning=text).to_json()
        return StreamDelta(request_id=self._request_id, seq=seq, delta=text).to_json()


class TurnRunner:
    def __init__(
        self,
        *,
        engine: Engine,
        renderer: PromptRenderer,
        generation: GenerationConfig,
        limits: HistoryLimits,
        default_system_prompt: str | None,
        topics: Topics,
        publisher: Publisher,
        stats: StatsCollector,
        engine_died: Callable[[int], None],
        tools: ToolSupport | None = None,
        max_tool_result_bytes: int = 65536,
    ) -> None:
        self.engine = engine
        self.renderer = renderer
        self.generation = generation
        self.limits = limits
        self.default_system_prompt = default_system_prompt
        self.topics = topics
        self.publisher = publisher
        self.stats = stats
        self._engine_died = engine_died
        self._ids = itertools.count(1)
        self.tools = tools or ToolSupport()
        self.max_tool_result_bytes = max_tool_result_bytes

    async def run(self, turn: PendingTurn, history: SessionHistory) -> TurnAnswer:
        """Generate the turn's reply on ``history``, a draft of the session (its system
        prompt, tools, trimming and the new turn or tool round go there); the reply and the
        draft to commit. RequestError: refused; the caller drops the draft."""
        address, request = turn.address, turn.request
        generation = self.generation
        if turn.deadline is not None and time.monotonic() > turn.deadline:
            waited = time.monotonic() - turn.message.received_at
            raise RequestError(ErrorCode.EXPIRED, f"the request expired after waiting {waited:.1f}s for its turn")
        if request.system_prompt is not None:
            history.system_prompt = request.system_prompt
        elif history.system_prompt is None:
            history.system_prompt = self.default_system_prompt
        if request.tools is not None:
            if request.tools and self.tools.unsupported is not None:
                raise RequestError(ErrorCode.INVALID_REQUEST, self.tools.unsupported)
            history.tools = specs_from_request(request.tools)
        plan = plan_tools(request, history.tools)
        current = self._current_turn(turn, history)
        prefill_text, structured = "", structured_output(request)
        parser = self.tools.parser
        if plan.offered and parser is None:
            raise RequestError(ErrorCode.INVALID_REQUEST, self.tools.unsupported or "tool calling is not available")
        if plan.forced:
            assert parser is not None
            if parser.format is None:
                raise RequestError(
                    ErrorCode.INVALID_REQUEST,
                    f"toolChoice 'required' or a named tool needs a known call format; the {parser.name} tool "
                    "parser has none in this worker (use toolChoice 'auto')",
                )
            # The reply opens with the call itself, written for the model in its own format,
            # and the grammar constrains the call's JSON: the call always parses, and the
            # stored history renders as the model was trained. A prompt that opened a think
            # block has it closed first (a forced call does not think).
            prefill_text = (f"{THINK_CLOSE}\n\n" if self.renderer.opens_reasoning else "") + parser.format.open
            structured = StructuredOutput(json_schema=forced_call_schema(plan.forced, parser.format))
        max_tokens = request.max_tokens or generation.max_tokens
        tools = history.tool_forms()
        await self.renderer.prepare([*history.messages(), *current.messages], tools)
        prompt = build_prompt(
            self.renderer,
            history,
            current.messages,
            limits=self.limits,
            max_tokens=max_tokens,
            max_model_len=self.engine.info.max_model_len,
            prefill=self.renderer.encode(prefill_text) if prefill_text else (),
        )
        for trim in prompt.trims:
            logger.info(
                "Dialog trimmed: session={} dropped={} kept={} tokens {} -> {}",
                address,
                trim.dropped_turns,
                trim.kept_turns,
                trim.tokens_before,
                trim.tokens_after,
            )
        sampling = SamplingOptions(
            max_tokens=max_tokens,
            temperature=generation.temperature if request.temperature is None else request.temperature,
            top_p=generation.top_p if request.top_p is None else request.top_p,
            stop=tuple(generation.stop),
            structured=structured,
        )
        if turn.key in turn.runtime.cancelled:
            # Cancelled while queued, or while its prompt was prepared (an await): checked here,
            # since from here on to the engine nothing awaits, and _stream marks it running,
            # where a cancel aborts it. No turn: the session stays as it was.
            return TurnAnswer(self.reply(turn, Outcome(submitted=time.monotonic(), finish_reason="cancelled")), None)
        logger.debug("Request {} of {}: {!r}", turn.key, address, request.message or request.tool_results)
        stream = _DeltaStream(self, turn) if request.stream else None
        hold = MarkupHold(parser.format) if plan.offered and parser is not None and parser.format else None
        outcome = await self._stream(
            turn,
            # vLLM logs request ids (an abort at INFO): the escaped request id, as in the worker's log.
            GenerationRequest(f"{address}/{log_ref(turn.key)}/{next(self._ids)}", prompt.token_ids, sampling),
            reasoning_budget(request, generation, structured=structured is not None),
            stream=None if plan.forced else stream,  # a forced reply is all call: no text to stream
            hold=hold,
        )
        if plan.forced:
            assert parser is not None and parser.format is not None
            answer = parser.format.open + escape_raw_controls(outcome.text) + parser.format.close
        elif sampling.structured is None:
            answer, reasoning = split_reasoning(outcome.text, opened_in_prompt=self.renderer.opens_reasoning)
            if request.include_reasoning:
                outcome.reasoning = reasoning  # in the reply only: the history keeps the answer
        else:
            # The grammar constrains the reply from its first token: there is no think block to
            # remove, and "</think>" inside a JSON string (or a prompt that opened <think>) must
            # not cut the JSON.
            answer = outcome.text
        outcome.text = answer
        logger.debug("Reply {} of {}: {!r}", turn.key, address, answer)
        if outcome.finish_reason == "cancelled":
            return TurnAnswer(self.reply(turn, outcome), None)  # no turn: the session stays as it was
        if plan.offered:
            assert parser is not None
            self._take_calls(turn, plan, outcome, history, round_=rounds_in(current))
        current.messages.append(assistant_message(outcome.text, outcome.tool_calls))
        history.turns.append(current)
        if stream and outcome.tool_calls:
            stream.announce(wire_calls(outcome.tool_calls))
        return TurnAnswer(self.reply(turn, outcome), history)

    def _current_turn(self, turn: PendingTurn, history: SessionHistory) -> Turn:
        """The turn this request adds to, taken out of ``history.turns`` (which keeps the
        closed turns while the prompt is built): the open turn with the client's results, or
        a new turn for a new message (any calls left open get a result saying they were not
        run)."""
        request, open_turn = turn.request, history.open_turn
        if request.tool_results is not None:
            if open_turn is None:
                raise RequestError(
                    ErrorCode.INVALID_REQUEST, "toolResults sent, but the session has no pending tool calls"
                )
            apply_results(open_turn, request.tool_results, self.max_tool_result_bytes)
            return history.turns.pop()
        if open_turn is not None:
            close_unanswered(open_turn)
        assert request.message is not None
        return Turn(turn.key, [user_message(request.message)])

    def _take_calls(
        self, turn: PendingTurn, plan: ToolPlan, outcome: Outcome, history: SessionHistory, *, round_: int
    ) -> None:
        """Parse the answer's calls with the model's parser and check them (core/tools.py):
        valid calls end the reply with finishReason tool_calls; markup that is no valid call
        leaves the text as it is, with the reason."""
        parser = self.tools.parser
        assert parser is not None
        parsed = parser.parse(outcome.text, history.tools)
        checked = check_calls(
            outcome.text, parsed, history.tools, key=turn.key, round_=round_, validate_all=bool(plan.forced)
        )
        if checked.error is not None:
            logger.info("Request {} of {}: tool call not taken: {}", log_ref(turn.key), turn.address, checked.error)
            outcome.tool_parse_error = checked.error
        elif checked.calls:
            outcome.text, outcome.tool_calls = checked.content.strip(), checked.calls
            outcome.finish_reason = TOOL_CALLS

    async def _stream(
        self,
        turn: PendingTurn,
        request: GenerationRequest,
        budget: int = 0,
        *,
        stream: _DeltaStream | None = None,
        hold: MarkupHold | None = None,
    ) -> Outcome:
        """Run the generation, publishing deltas to ``stream``; what came out of it.

        Free text is split into reasoning and answer as it comes: the stream carries the answer,
        and the reasoning only with includeReasoning; ``hold`` keeps tool-call markup out of the
        answer's deltas. A generation still reasoning after
        ``budget`` completion tokens (the engine's count) is aborted: finishReason
        reasoning_budget, and what came after the budget is dropped."""
        outcome = Outcome(submitted=time.monotonic(), prompt_tokens=len(request.prompt_token_ids))
        parts: list[str] = []
        show_reasoning = turn.request.include_reasoning
        splitter = None
        if request.sampling.structured is None:
            splitter = ReasoningSplitter(opened_in_prompt=self.renderer.opens_reasoning)
        over_budget = False
        turn.runtime.running[turn.key] = request.request_id
        try:
            async for update in self.engine.generate(request):
                if outcome.first_token is None and update.completion_tokens > 0:
                    outcome.first_token = time.monotonic()
                outcome.completion_tokens = update.completion_tokens
                outcome.prompt_tokens, outcome.cached_tokens = update.prompt_tokens, update.cached_tokens
                if update.finished:
                    outcome.finish_reason = update.finish_reason or "stop"
                if over_budget:
                    continue  # the abort takes effect within an engine step or two
                if update.delta:
                    parts.append(update.delta)
                    pieces = splitter.feed(update.delta) if splitter else [(False, update.delta)]
                    for is_reasoning, text in pieces:
                        if stream and (show_reasoning or not is_reasoning):
                            if hold is not None and not is_reasoning:
                                text = hold.feed(text)
                            if text:
                                stream.add(text, reasoning=is_reasoning)
                if splitter is None or not splitter.opened:
                    continue
                if outcome.reasoning_tokens is None and not splitter.reasoning:  # the think block closed
                    outcome.reasoning_tokens = update.completion_tokens
                elif splitter.reasoning and (update.finished or (budget and update.completion_tokens >= budget)):
                    outcome.reasoning_tokens = update.completion_tokens
                    if not update.finished:
                        over_budget = True
                        logger.info(
                            "Request {} of {}: reasoning budget of {} tokens reached",
                            log_ref(turn.key),
                            turn.address,
                            budget,
                        )
                        await self.engine.abort(request.request_id)
        except EngineDead as exc:
            logger.error(
                "Engine died: {}; stopping the worker (request {} is left for the restart)", exc, log_ref(turn.key)
            )
            self._engine_died(1)
            raise
        except StructuredOutputRejected as exc:
            logger.info("Engine refused the responseFormat of request {} of {}", log_ref(turn.key), turn.address)
            logger.debug("Engine's reason for refusing the responseFormat of {}: {}", turn.key, exc)
            message = f"the engine cannot use this schema: {str(exc)[:500]}"
            raise RequestError(ErrorCode.INVALID_SCHEMA, message) from None
        except EngineError as exc:
            logger.error("Engine error on request {} of {}: {}", log_ref(turn.key), turn.address, type(exc).__name__)
            logger.debug("Engine error on request {}: {}", turn.key, exc)
            raise RequestError(ErrorCode.ENGINE_ERROR, f"generation failed: {exc}") from None
        finally:
            turn.runtime.running.pop(turn.key, None)
        if over_budget:
            outcome.finish_reason = REASONING_BUDGET
        if stream:
            if splitter:
                for is_reasoning, text in splitter.flush():
                    if show_reasoning or not is_reasoning:
                        if hold is not None and not is_reasoning:
                            text = hold.feed(text)
                        if text:
                            stream.add(text, reasoning=is_reasoning)
            if hold is not None and (rest := hold.flush()):
                stream.add(rest)
            stream.flush()
        outcome.text = "".join(parts)
        return outcome

    def reply(self, turn: PendingTurn, outcome: Outcome) -> bytes:
        now = time.monotonic()
        received = turn.message.received_at
        latency = Latency(
            queue_ms=ms_between(received, outcome.submitted),
            total_ms=ms_between(received, now),
            ttft_ms=ms_between(received, outcome.first_token or now),
        )
        usage = Usage(
            prompt_tokens=outcome.prompt_tokens,
            completion_tokens=outcome.completion_tokens,
            cached_tokens=outcome.cached_tokens,
            reasoning_tokens=outcome.reasoning_tokens,
        )
        self.stats.record_reply(usage, latency, finish_reason=outcome.finish_reason)
        logger.info(
            "Replied {} of {}: {} prompt ({} cached) + {} tokens, {}, {:.0f} ms",
            log_ref(turn.key),
            turn.address,
            usage.prompt_tokens,
            usage.cached_tokens,
            usage.completion_tokens,
            outcome.finish_reason,
            latency.total_ms,
        )
        reply = ChatReply(
            session_id=turn.address.session,
            request_id=turn.key,
            reply=outcome.text,
            reasoning=outcome.reasoning,
            tool_calls=wire_calls(outcome.tool_calls) or None,
            tool_parse_error=outcome.tool_parse_error,
            finish_reason=outcome.finish_reason,
            usage=usage,
            latency=latency,
        )
        return reply.to_json()


def wire_calls(calls: tuple[ToolCall, ...]) -> list[ToolCallOut]:
    return [
        ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=json.dumps(c.arguments, ensure_ascii=False)))
        for c in calls
    ]
