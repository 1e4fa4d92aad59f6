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
from typing import Protocol

from loguru import logger

from ..config.models import GenerationConfig, ToolsConfig
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
    RoundOut,
    StreamDelta,
    ToolCallOut,
    ToolEvent,
    Usage,
    WorkerCallOut,
    log_ref,
    log_text,
)
from ..protocol.packets import split_to_fit
from ..protocol.topics import SessionAddress, Topics
from ..schemacheck import grammar_document
from ..session import (
    THINK_CLOSE,
    UNKNOWN_RESULT,
    Progress,
    SessionHistory,
    ToolCall,
    ToolSpec,
    Turn,
    WorkerCallRecord,
    assistant_message,
    calls_of,
    tool_message,
)
from ..tools.port import CallContext, Toolbox, ToolOutcome, WorkerTool, cut_utf8, safe_text, utf8_size
from ..transport.port import InboundMessage, Publisher
from .calls import (
    MarkupHold,
    ToolPlan,
    apply_results,
    call_key,
    check_calls,
    close_unanswered,
    escape_raw_controls,
    forced_call_schema,
    order_results,
    plan_tools,
    round_prefix,
    rounds_in,
    specs_from_request,
)
from .history import (
    HistoryLimits,
    PromptRenderer,
    ReasoningSplitter,
    build_prompt,
    split_reasoning,
    user_message,
)
from .stats import StatsCollector


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
    confirm_ids: set[str] = field(default_factory=set)  # of tool_calls: worker calls to approve
    worker_calls: list[WorkerCallOut] = field(default_factory=list)  # the worker's own calls
    rounds: list[RoundOut] = field(default_factory=list)  # the generations, when the worker called tools
    raw_text: str = ""  # the engine's text as generated (``text`` becomes the answer)
    token_ids: list[int] = field(default_factory=list)  # the ids generated, where the engine says


@dataclass(frozen=True)
class _Continuation:
    """A generation of the loop, for the next one to continue token for token: its prompt
    (ids, and the text they encode), and what it generated (text and ids)."""

    prompt_ids: list[int]
    prompt_text: str
    generated_text: str
    generated_ids: list[int]
    forced: bool = False  # a forced call: the generated text is the call's JSON


# A worker call's result as the reply lists it (the model got all of it, up to max_tool_result_tokens).
WORKER_RESULT_CHARS = 1000


class ProgressJournal(Protocol):
    """Where a request's tool-loop progress is kept (core/session_cache.py SessionCache)."""

    async def asave_progress(self, name: str, key: str, progress: Progress) -> None: ...

    async def aload_progress(self, name: str, key: str) -> Progress | None: ...


@dataclass
class _Loop:
    """One request's tool loop: the turn it works on, the worker tools offered, and what its
    generations and calls have added up to."""

    turn: PendingTurn
    history: SessionHistory
    worker: dict[str, WorkerTool]
    max_tool_time: float
    current: Turn = field(default_factory=lambda: Turn(""))
    progress: Progress = field(default_factory=lambda: Progress(Turn("")))
    stream: _DeltaStream | None = None
    rounds: int = 0  # rounds of worker calls run in this request
    generations: int = 0
    tool_seconds: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)
    round_outs: list[RoundOut] = field(default_factory=list)
    previous: _Continuation | None = None

    def tool_time_left(self) -> float:
        return self.max_tool_time - self.tool_seconds

    def add(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)
        self.round_outs.append(
            RoundOut(
                prompt_tokens=outcome.prompt_tokens,
                cached_tokens=outcome.cached_tokens,
                completion_tokens=outcome.completion_tokens,
                ms=ms_between(outcome.submitted, time.monotonic()),
                tool_ms=0.0,
            )
        )

    def reply_outcome(self, last: Outcome) -> Outcome:
        """The request's outcome: the last generation's text and calls; the first one's times;
        the tokens of all of them; the worker's calls."""
        first = self.outcomes[0] if self.outcomes else last
        out = Outcome(
            submitted=first.submitted,
            first_token=next((o.first_token for o in self.outcomes if o.first_token is not None), last.first_token),
            text=last.text,
            finish_reason=last.finish_reason,
            prompt_tokens=sum(o.prompt_tokens for o in self.outcomes) or last.prompt_tokens,
            completion_tokens=sum(o.completion_tokens for o in self.outcomes) or last.completion_tokens,
            cached_tokens=sum(o.cached_tokens for o in self.outcomes) or last.cached_tokens,
            reasoning=last.reasoning,
            reasoning_tokens=last.reasoning_tokens,
            tool_calls=last.tool_calls,
            tool_parse_error=last.tool_parse_error,
            confirm_ids=last.confirm_ids,
            worker_calls=self.worker_calls(),
        )
        if out.worker_calls:
            out.rounds = self.round_outs
        return out

    def worker_calls(self) -> list[WorkerCallOut]:
        records = self.progress.calls
        if not records:
            return []
        results = {
            m.get("tool_call_id"): str(m.get("content") or "") for m in self.current.messages if m.get("role") == "tool"
        }
        out = []
        for call in (c for m in self.current.messages for c in calls_of(m)):  # in the calls' order
            record = records.get(call.id)
            if record is None:
                continue
            result = results.get(call.id, "")
            out.append(
                WorkerCallOut(
                    id=call.id,
                    name=call.name,
                    arguments=json.dumps(call.arguments, ensure_ascii=False),
                    result=result if len(result) <= WORKER_RESULT_CHARS else result[:WORKER_RESULT_CHARS] + "…",
                    outcome=record.outcome,
                    duration_ms=record.duration_ms,
                    round=record.round,
                )
            )
        return out


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
        # References rewritten to plain #/$defs/<name>: the grammar backend resolves neither
        # escaped pointers (~1, %20) nor anchors (schemacheck.grammar_schema).
        return StructuredOutput(json_schema=grammar_document(request.response_format.json_schema))
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

    def event(self, event: ToolEvent) -> None:
        """A worker call started or ended: published at once (after the text before it)."""
        self.flush()
        payload = StreamDelta(request_id=self._request_id, seq=self._seq, delta="", tool_event=event).to_json()
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
        toolbox: Toolbox | None = None,
        tools_config: ToolsConfig | None = None,
        journal: ProgressJournal | None = None,
        call_scope: str = "",
    ) -> None:
        """``call_scope``: what makes the ids of this worker's calls its own among workers
        (the topic prefix and the share group, or the worker id: see ``call_key``)."""
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
        self.toolbox = toolbox
        self.tools_config = tools_config or ToolsConfig()
        self.journal = journal
        self.call_scope = call_scope

    def call_key(self, turn: PendingTurn) -> str:
        """What the ids of the request's calls derive from (core/calls.py ``call_key``)."""
        return call_key(self.call_scope, str(turn.address), turn.key)

    async def run(self, turn: PendingTurn, history: SessionHistory) -> TurnAnswer:
        """Answer the request on ``history``, a draft of the session (its system prompt, tools,
        trimming and the new turn or tool round go there): generate, and while the model calls
        the worker's own tools, run them and generate again (the tool loop, docs/tools.md).
        The reply and the draft to commit. RequestError: refused; the caller drops the draft."""
        address, request = turn.address, turn.request
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
        if request.worker_tools is not None:
            history.worker_tools = self._choose_worker_tools(request.worker_tools, address.user)
        worker = self._offered_worker_tools(history, address.user)
        loop = _Loop(turn, history, worker, self.tools_config.max_tool_time)
        progress = await self._load_progress(turn, history)
        current, to_run = self._current_turn(turn, history, worker, progress)
        loop.current = current
        loop.progress = Progress(current, progress.calls if progress else {})
        if progress is not None:
            # A redelivery goes on where the first delivery stopped: its rounds so far count
            # (a forced toolChoice applied to its first, and max_tool_rounds counts them all).
            loop.generations = loop.rounds = rounds_of_request(self.call_key(turn), progress)
        loop.stream = _DeltaStream(self, turn) if request.stream else None
        if to_run and turn.key in turn.runtime.cancelled:
            # Cancelled while queued: the approved calls are not sent, and nothing changes (they
            # stay pending; the client may approve them again).
            return TurnAnswer(self.reply(turn, Outcome(submitted=time.monotonic(), finish_reason="cancelled")), None)
        if to_run:  # the calls the client approved
            await self._save_progress(loop)  # before any is sent: never sent twice
            await self._run_calls(loop, to_run, rounds_in(current) - 1)
        while True:
            waiting = self._awaiting_client(loop)
            if waiting:  # a redelivery that had come this far: the same calls go to the client
                return self._ask_client(loop, waiting, Outcome(submitted=time.monotonic()))
            final = loop.rounds >= self.tools_config.max_tool_rounds or loop.tool_time_left() <= 0
            outcome = await self._generate(loop, final=final)
            loop.add(outcome)
            if outcome.finish_reason == "cancelled":
                return self._cancelled(loop, outcome)
            calls = outcome.tool_calls
            current.messages.append(assistant_message(outcome.text, calls))
            if not calls:
                history.turns.append(current)
                return TurnAnswer(self.reply(turn, loop.reply_outcome(outcome)), history)
            runnable = [c for c in calls if c.name in worker and not worker[c.name].confirm]
            if runnable:
                await self._save_progress(loop)  # before any call is sent: never sent twice
                await self._run_calls(loop, runnable, rounds_in(current) - 1)
            loop.rounds += 1
            waiting = self._awaiting_client(loop)
            if waiting:
                return self._ask_client(loop, waiting, outcome)

    def _choose_worker_tools(self, names: list[str], user: str) -> list[str]:
        """The session's workerTools as asked: ["*"], or names this namespace may use (a name
        that is not configured or not allowed is refused the same way: a user learns nothing
        of the tools of other namespaces)."""
        if not names or names == ["*"]:
            return list(names)
        if self.toolbox is None:
            raise RequestError(ErrorCode.INVALID_REQUEST, "workerTools: this worker has no tools of its own")
        allowed = self.toolbox.available(user)
        for name in names:
            if name not in allowed:
                configured = self.toolbox.known(name) is not None
                # The name is the client's text: at DEBUG only (the reason is the operator's).
                logger.info(
                    "workerTools of {} refused: a name {}",
                    user,
                    "not allowed for this namespace" if configured else "not configured",
                )
                logger.debug("workerTools of {} refused: {}", user, log_text(name))
                raise RequestError(
                    ErrorCode.INVALID_REQUEST,
                    f"workerTools: {name!r} is not a worker tool that this user namespace may use",
                )
        return list(names)

    def _offered_worker_tools(self, history: SessionHistory, user: str) -> dict[str, WorkerTool]:
        """The worker tools the model is offered in this session now: those it chose that its
        namespace may use and that are available (an MCP server's tools come and go). A client
        tool with a worker tool's name is refused: the call could not be told apart."""
        if not history.worker_tools or self.toolbox is None:
            return {}
        allowed = self.toolbox.available(user)
        if history.worker_tools == ["*"]:
            offered = allowed
        else:
            offered = {name: allowed[name] for name in history.worker_tools if name in allowed}
        clash = sorted({tool.name for tool in history.tools} & set(offered))
        if clash:
            raise RequestError(
                ErrorCode.INVALID_REQUEST,
                f"the client tool {clash[0]!r} has the name of a worker tool of this session; rename it, "
                "or leave that worker tool out of workerTools",
            )
        return offered

    async def _load_progress(self, turn: PendingTurn, history: SessionHistory) -> Progress | None:
        """The request's stored progress. Only a request that may have run worker calls can
        have one: in a session with workerTools, or approving calls (toolResults); the others
        make no store call for it (one round trip to the store's thread less per request)."""
        if self.journal is None or not (history.worker_tools or turn.request.tool_results is not None):
            return None
        progress = await self.journal.aload_progress(str(turn.address), turn.key)
        if progress is not None:
            logger.info(
                "Request {} of {}: going on from its stored tool-loop progress", log_ref(turn.key), turn.address
            )
        return progress

    async def _save_progress(self, loop: _Loop) -> None:
        if self.journal is not None:
            await self.journal.asave_progress(str(loop.turn.address), loop.turn.key, loop.progress)

    def _current_turn(
        self, turn: PendingTurn, history: SessionHistory, worker: dict[str, WorkerTool], progress: Progress | None
    ) -> tuple[Turn, list[ToolCall]]:
        """The turn this request adds to, taken out of ``history.turns`` (which keeps the
        closed turns while the prompt is built), and the worker calls to run before the next
        generation (calls the client approved).

        - A new message: a new turn (any calls left open get a result saying they were not run).
        - toolResults: the open turn with the client's results and declines added.
        - A redelivery with stored progress: the turn as far as it had come; its worker calls
          that may have been sent and have no result get one saying the outcome is unknown:
          they are never sent again."""
        request, open_turn = turn.request, history.open_turn
        if progress is not None:
            if request.tool_results is not None and open_turn is not None and open_turn.key == progress.turn.key:
                history.turns.pop()
            elif request.message is not None and open_turn is not None:
                close_unanswered(open_turn)
            current = progress.turn.copy()
            approvals = {r.tool_call_id for r in request.tool_results or () if r.approved}
            client_tools = {tool.name for tool in history.tools}
            for call in current.pending_calls():
                confirm = call.name in worker and worker[call.name].confirm
                if call.name not in client_tools and (not confirm or call.id in approvals):
                    current.messages.append(tool_message(call.id, call.name, UNKNOWN_RESULT))
                    progress.calls[call.id] = WorkerCallRecord("unknown", 0.0, rounds_in(current) - 1)
                    self.stats.record_tool_call(call.name, "unknown", 0.0)
                    logger.warning(
                        "Request {} of {}: call {} to {} may have been sent before the worker stopped; "
                        "not sent again (its outcome is unknown)",
                        log_ref(turn.key),
                        turn.address,
                        call.id,
                        call.name,
                    )
            order_results(current)
            return current, []
        if request.tool_results is not None:
            if open_turn is None:
                raise RequestError(
                    ErrorCode.INVALID_REQUEST, "toolResults sent, but the session has no pending tool calls"
                )
            client_tools = {tool.name for tool in history.tools}
            confirmable = {c.name for c in open_turn.pending_calls() if c.name not in client_tools}
            approved = apply_results(open_turn, request.tool_results, self.max_tool_result_bytes, confirmable)
            return history.turns.pop(), approved
        if open_turn is not None:
            close_unanswered(open_turn)
        assert request.message is not None
        return Turn(turn.key, [user_message(request.message)]), []

    def _awaiting_client(self, loop: _Loop) -> list[ToolCall]:
        """The turn's pending calls that wait for the client: its own tools' calls, and worker
        calls that need its confirmation ([]: none; the loop goes on)."""
        return loop.current.pending_calls()

    def _ask_client(self, loop: _Loop, calls: list[ToolCall], outcome: Outcome) -> TurnAnswer:
        """End the request with calls for the client (finishReason tool_calls): the session
        keeps the open turn, and the next toolResults goes on from there."""
        confirm = {c.id for c in calls if c.name in loop.worker and loop.worker[c.name].confirm}
        outcome.tool_calls, outcome.finish_reason = tuple(calls), TOOL_CALLS
        outcome.confirm_ids = confirm
        loop.history.turns.append(loop.current)
        if loop.stream is not None:
            loop.stream.announce(wire_calls(outcome.tool_calls, confirm))
        return TurnAnswer(self.reply(loop.turn, loop.reply_outcome(outcome)), loop.history)

    def _cancelled(self, loop: _Loop, outcome: Outcome) -> TurnAnswer:
        """A cancel: nothing changes, unless the worker ran calls in this request; then the
        turn is kept as far as it came, closed with the text generated so far, and committed
        with the cancelled reply as its answer. A device may have acted: a history without the
        call would tell the model the lamp is still off, and a redelivery, finding no answer,
        would go on from the progress with the calls' outcomes unknown. So the calls and their
        results stay, a redelivery gets the stored reply, and nothing is sent twice
        (docs/protocol.md, control)."""
        if not loop.progress.calls:
            return TurnAnswer(self.reply(loop.turn, loop.reply_outcome(outcome)), None)
        loop.current.messages.append(assistant_message(outcome.text))
        loop.history.turns.append(loop.current)
        return TurnAnswer(self.reply(loop.turn, loop.reply_outcome(outcome)), loop.history)

    async def _run_calls(self, loop: _Loop, calls: list[ToolCall], round_: int) -> None:
        """Run one round's worker calls at once; each result joins the turn (as a ``tool``
        message) and is stored before the loop goes on. Calls over max_calls_per_round, or past
        the request's tool time, are not sent: their result says why."""
        limit = self.tools_config.max_calls_per_round
        started = time.monotonic()
        await asyncio.gather(
            *(self._run_call(loop, call, round_, skip=index >= limit) for index, call in enumerate(calls))
        )
        elapsed = time.monotonic() - started
        loop.tool_seconds += elapsed
        if loop.round_outs and loop.generations:  # the generation that made these calls
            loop.round_outs[-1].tool_ms = round(elapsed * 1000, 1)
        order_results(loop.current)

    async def _run_call(self, loop: _Loop, call: ToolCall, round_: int, *, skip: bool) -> None:
        assert self.toolbox is not None or skip or call.name not in loop.worker
        turn = loop.turn
        budget = loop.tool_time_left()
        started = time.monotonic()
        if loop.stream is not None:
            loop.stream.event(ToolEvent(event="start", tool_call_id=call.id, name=call.name, round=round_))
        if skip:
            result = ToolOutcome(
                f"Error: not run: the model made more than {self.tools_config.max_calls_per_round} calls in one round.",
                "skipped",
            )
        elif budget <= 0:
            result = ToolOutcome("Error: not run: the request's time for tool calls is used up.", "skipped")
        elif self.toolbox is None or call.name not in loop.worker:
            # Run only what this session is offered now (an approval may come after the tool
            # was withdrawn, or the namespace's rights changed).
            result = ToolOutcome(f"Error: the tool {call.name} is not available now.", "unavailable")
        else:
            context = CallContext(request_id=turn.key, tool_call_id=call.id, session=str(turn.address))
            try:
                async with asyncio.timeout(budget):  # not wait_for: see tools/toolbox.py
                    result = await self.toolbox.call(call.name, call.arguments, context)
            except TimeoutError:
                result = ToolOutcome("Error: the request's time for tool calls ran out during this call.", "timeout")
        seconds = time.monotonic() - started
        content = await self._cut_result(result)
        loop.current.messages.append(tool_message(call.id, call.name, content))
        loop.progress.calls[call.id] = WorkerCallRecord(result.outcome, round(seconds * 1000, 1), round_)
        self.stats.record_tool_call(call.name, result.outcome, seconds)
        # Stored first: the line below says the result is on record (a crash after it reuses it).
        await self._save_progress(loop)
        logger.info(
            "Request {} of {}: worker call {} ({}) {} in {:.0f} ms",
            log_ref(turn.key),
            turn.address,
            call.name,
            call.id,
            result.outcome,
            seconds * 1000,
        )
        logger.debug("Worker call {} result: {!r}", call.id, content[:2000])
        if loop.stream is not None:
            loop.stream.event(
                ToolEvent(
                    event="end",
                    tool_call_id=call.id,
                    name=call.name,
                    round=round_,
                    duration_ms=round(seconds * 1000, 1),
                    outcome=result.outcome,
                )
            )

    async def _cut_result(self, result: ToolOutcome) -> str:
        """A worker tool's result as the model gets it: control tokens are defused by the
        template renderer like any text; here invalid text is repaired (a lone surrogate
        becomes U+FFFD), the result is cut to max_tool_result_bytes on a character boundary,
        then to max_tool_result_tokens, and the cut is said.

        A short result is done here; a longer one in a thread, since counting its tokens grows
        with its size (a 10 MB answer tokenized on the event loop stalled every session for
        20-51 s; bounded first, the thread's work is at most a few counts of 64 KiB, and the
        tokenizer gives up the GIL while it counts)."""
        small = min(self.tools_config.max_tool_result_bytes, self.tools_config.max_tool_result_tokens)
        if result.size is None and len(result.content) * 4 <= small:
            return safe_text(result.content)  # 4 bytes a character at most, a token at least one byte
        return await asyncio.to_thread(self._fit_result, result.content, result.size)

    def _fit_result(self, content: str, size: int | None) -> str:
        """_cut_result's work (in a thread; the renderer's count_text is safe there)."""
        max_bytes, max_tokens = self.tools_config.max_tool_result_bytes, self.tools_config.max_tool_result_tokens
        text, cut = cut_utf8(content, max_bytes)
        if cut:
            size = utf8_size(content)
        shown = len(text.encode("utf-8"))
        if shown > max_tokens and (total := self.renderer.count_text(text)) > max_tokens:
            low, high = 0, min(len(text), max_tokens * 32)  # the longest start of at most max_tokens tokens
            while low < high:
                middle = (low + high + 1) // 2
                if self.renderer.count_text(text[:middle]) <= max_tokens:
                    low = middle
                else:
                    high = middle - 1
            if size is not None:
                note = f"it had {size} bytes; the first {max_tokens} tokens are shown"
                return f"{text[:low]}\n[The result was cut: {note}.]"
            return f"{text[:low]}\n[The result was cut: it had {total} tokens; the first {max_tokens} are shown.]"
        if size is not None:
            return f"{text}\n[The result was cut: it had {size} bytes; the first {shown} are shown.]"
        return text

    async def _generate(self, loop: _Loop, *, final: bool) -> Outcome:
        """One generation of the loop: the prompt (history, the turn so far), the engine's
        stream, and the calls the reply makes, checked."""
        turn, history, current = loop.turn, loop.history, loop.current
        address, request = turn.address, turn.request
        generation = self.generation
        specs = [*history.tools, *(tool.spec() for tool in loop.worker.values())]
        plan = plan_tools(request, specs, round_in_request=loop.generations, final=final)
        prefill_text, structured = "", structured_output(request) if loop.generations == 0 else None
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
        tools = [spec.template_form() for spec in specs] or None
        await self.renderer.prepare([*history.messages(), *current.messages], tools)
        prompt = build_prompt(
            self.renderer,
            history,
            current.messages,
            limits=self.limits,
            max_tokens=max_tokens,
            max_model_len=self.engine.info.max_model_len,
            prefill=self.renderer.encode(prefill_text) if prefill_text else (),
            tools=tools,
        )
        prefill_ids = self.renderer.encode(prefill_text) if prefill_text else []
        token_ids = prompt.token_ids
        # The text is needed only where a generation of the loop continues or may be continued:
        # a request whose calls all go to the client ends after its one generation.
        prompt_text = ""
        if (plan.offered and loop.worker) or loop.previous is not None:
            prompt_text = self.renderer.render_text(
                [*history.messages(), *current.messages], add_generation_prompt=True, tools=tools
            )
        if loop.previous is not None and not prompt.trims:
            spliced = self._continuation(loop.previous, prompt_text)
            if spliced is not None:
                token_ids = [*spliced, *prefill_ids]
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
            return Outcome(submitted=time.monotonic(), finish_reason="cancelled")
        if loop.generations == 0:
            logger.debug("Request {} of {}: {!r}", turn.key, address, request.message or request.tool_results)
        loop.generations += 1
        stream = loop.stream
        hold = MarkupHold(parser.format) if plan.offered and parser is not None and parser.format else None
        if parser is not None and parser.format is not None and final and specs:
            hold = MarkupHold(parser.format)  # calls the last round may not make are not streamed either
        outcome = await self._stream(
            turn,
            # vLLM logs request ids (an abort at INFO): the escaped request id, as in the worker's log.
            GenerationRequest(f"{address}/{log_ref(turn.key)}/{next(self._ids)}", token_ids, sampling),
            reasoning_budget(request, generation, structured=structured is not None),
            stream=None if plan.forced else stream,  # a forced reply is all call: no text to stream
            hold=hold,
        )
        loop.previous = (
            _Continuation(
                token_ids, prompt_text + prefill_text, outcome.raw_text, outcome.token_ids, forced=bool(plan.forced)
            )
            if prompt_text
            else None
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
            return outcome
        if plan.offered:
            self._take_calls(turn, plan, outcome, specs, round_=rounds_in(current))
        elif final and specs and parser is not None:
            self._drop_late_calls(turn, outcome, specs)
        return outcome

    def _continuation(self, previous: _Continuation, prompt_text: str) -> list[int] | None:
        """The prompt of the loop's next generation as the previous prompt plus the ids it
        generated, plus the rest (the call's closing markup, the results) encoded: the prefix
        cache then holds all of it. Re-encoding the generated text instead can split it into
        other tokens than the model chose (a grammar lets a random-weights model pick any
        split: on the QwQ-32B geometry, 33 of 48 continuations lost the cache from the call's
        first token). None, for the prompt as rendered, where the text does not continue the
        previous generation as generated (the template rewrote it), or the ids are unknown."""
        generated = previous.generated_ids
        if not generated or not prompt_text.startswith(previous.prompt_text):
            return None
        rest = len(previous.prompt_text) + len(previous.generated_text)
        if not prompt_text.startswith(previous.generated_text, len(previous.prompt_text)):
            # A forced call's JSON, as the template writes it again (its own spacing and
            # escapes): the same call when it is the same JSON value.
            if not previous.forced:
                return None
            try:
                written, rest = json.JSONDecoder().raw_decode(prompt_text, len(previous.prompt_text))
                if written != json.loads(previous.generated_text, strict=False):
                    return None
            except ValueError:
                return None
        stops = set(self.renderer.stop_token_ids)
        if generated[-1] in stops:
            generated = generated[:-1]  # the end of the turn: the template writes its own
        if any(token in stops for token in generated):
            return None
        return [*previous.prompt_ids, *generated, *self.renderer.encode(prompt_text[rest:])]

    def _drop_late_calls(self, turn: PendingTurn, outcome: Outcome, specs: list[ToolSpec]) -> None:
        """The last round (max_tool_rounds, or the tool time used up) is generated with
        toolChoice none; calls it writes anyway are not taken: the reply is the text before
        them, and says why."""
        parser = self.tools.parser
        assert parser is not None
        parsed = parser.parse(outcome.text, specs)
        if parsed.calls or parsed.markup:
            outcome.text = parsed.content.strip()
            outcome.tool_parse_error = (
                "the model called tools again after the last round this request may run "
                f"(tools.max_tool_rounds = {self.tools_config.max_tool_rounds}, or the request's tool time was used up)"
            )
            logger.info("Request {} of {}: calls after the last tool round dropped", log_ref(turn.key), turn.address)

    def _take_calls(
        self, turn: PendingTurn, plan: ToolPlan, outcome: Outcome, specs: list[ToolSpec], *, round_: int
    ) -> None:
        """Parse the answer's calls with the model's parser and check them (core/calls.py):
        valid calls end the generation with finishReason tool_calls; markup that is no valid
        call leaves the text as it is, with the reason."""
        parser = self.tools.parser
        assert parser is not None
        parsed = parser.parse(outcome.text, specs)
        checked = check_calls(
            outcome.text, parsed, specs, key=self.call_key(turn), round_=round_, validate_all=bool(plan.forced)
        )
        if checked.error is not None:
            # The reason quotes the model's call (its arguments, what the schema says of them):
            # the reply's toolParseError has it; the log at INFO says only that it happened.
            logger.info("Request {} of {}: tool call not taken (toolParseError)", log_ref(turn.key), turn.address)
            logger.debug("Request {} of {}: tool call not taken: {}", log_ref(turn.key), turn.address, checked.error)
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
                outcome.token_ids.extend(update.token_ids)
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
        outcome.text = outcome.raw_text = "".join(parts)
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
            tool_calls=wire_calls(outcome.tool_calls, outcome.confirm_ids) or None,
            tool_parse_error=outcome.tool_parse_error,
            worker_calls=outcome.worker_calls or None,
            rounds=outcome.rounds or None,
            finish_reason=outcome.finish_reason,
            usage=usage,
            latency=latency,
        )
        return reply.to_json()


def rounds_of_request(key: str, progress: Progress) -> int:
    """How many rounds of worker calls the request itself generated (``key``: its
    ``call_key``), in its stored progress (a toolResults request's progress also holds the
    calls it approved, which an earlier request generated)."""
    rounds = {record.round for record in progress.calls.values()}
    return sum(1 for r in rounds if any(call_id.startswith(round_prefix(key, r)) for call_id in progress.calls))


def wire_calls(calls: tuple[ToolCall, ...], confirm: set[str] | frozenset[str] = frozenset()) -> list[ToolCallOut]:
    return [
        ToolCallOut(
            id=c.id,
            function=FunctionCall(name=c.name, arguments=json.dumps(c.arguments, ensure_ascii=False)),
            needs_confirmation=True if c.id in confirm else None,
        )
        for c in calls
    ]
