"""A request's tool rounds: generate; while the model calls the worker's own tools, run them
and generate again; end when no call is left unanswered (docs/tools.md).

    the turn   <- a new message, toolResults added to the open turn, or a redelivery's progress
    while no call of the turn is left unanswered:
        generate (the prompt: history + the turn)                      core/turns.py
        the turn += the model's message: its text and its calls, checked (core/calls.py)
        no calls         -> the reply; the turn is closed and committed
        worker calls     -> run them at once; the turn += their results (core/worker_calls.py)
    calls left unanswered (the client's tools, calls to confirm) -> the reply asks for them;
    the turn stays open for the client's toolResults

One counter: a turn's rounds are its assistant messages with calls (``Turn.rounds``, which
also names the calls: core/calls.py ``call_id``). The rounds of this request are those it
added (``ToolRounds.rounds``): max_tool_rounds limits them, and a forced toolChoice applies to
the first only.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Protocol

from loguru import logger

from ..config.models import ToolsConfig
from ..protocol.messages import TOOL_CALLS, ErrorCode, RequestError, RoundOut, log_ref
from ..session import (
    UNKNOWN_RESULT,
    AssistantMessage,
    ImageRef,
    Progress,
    SessionHistory,
    ToolCall,
    ToolResultMessage,
    Turn,
    UserMessage,
    WorkerCallRecord,
)
from ..tools.port import WorkerTool
from .calls import apply_results, close_unanswered, order_results
from .pending import Continuation, Generated, PendingTurn, TurnAnswer, ms_between, wire_calls
from .stats import StatsCollector
from .stream import DeltaStream
from .worker_calls import WorkerCalls, listed_calls


class Runner(Protocol):
    """What the loop needs of the turn (core/turns.py ``TurnRunner``): each round's
    generation, the reply, the stream, and the worker's calls."""

    worker_calls: WorkerCalls
    tool_limits: ToolsConfig
    max_tool_result_bytes: int
    stats: StatsCollector

    async def generate(self, rounds: ToolRounds, *, final: bool) -> Generated: ...

    def reply(self, turn: PendingTurn, generated: Generated) -> bytes: ...

    def delta_stream(self, turn: PendingTurn) -> DeltaStream: ...


@dataclass
class ToolRounds:
    """One request's tool loop: the turn it works on (``turn``, out of ``history.turns`` until
    it is answered), the worker tools offered, and what its generations and calls add up to."""

    runner: Runner
    pending: PendingTurn
    history: SessionHistory
    worker: dict[str, WorkerTool]
    turn: Turn
    progress: Progress
    start: int  # the turn's rounds before this request (a toolResults request goes on from them)
    stream: DeltaStream | None
    generated: list[Generated] = field(default_factory=list)
    round_outs: list[RoundOut] = field(default_factory=list)
    tool_seconds: float = 0.0
    previous: Continuation | None = None  # the last generation, for the next to continue

    @property
    def worker_calls(self) -> WorkerCalls:
        return self.runner.worker_calls

    @property
    def rounds(self) -> int:
        """The rounds this request has generated (a redelivery's before the crash included)."""
        return self.turn.rounds - self.start

    async def run(self, approved: list[ToolCall]) -> TurnAnswer:
        """The loop; ``approved``: worker calls the client approved, run first."""
        if approved:
            await self.worker_calls.run_round(self, approved, self.turn.rounds - 1)
        while not self.turn.pending_calls():
            generated = await self.runner.generate(self, final=self._final())
            self._add(generated)
            if generated.finish_reason == "cancelled":
                return self._cancelled(generated)
            self.turn.messages.append(AssistantMessage(generated.text, generated.tool_calls))
            if not generated.tool_calls:
                return self._commit(generated)
            runnable = [c for c in generated.tool_calls if c.name in self.worker and not self.worker[c.name].confirm]
            if runnable:
                await self.worker_calls.run_round(self, runnable, self.turn.rounds - 1)
        return self._ask_client(self.turn.pending_calls())

    def tool_time_left(self) -> float:
        return self.runner.tool_limits.max_tool_time - self.tool_seconds

    def _final(self) -> bool:
        """The last round this request may run: generated with toolChoice none."""
        return self.rounds >= self.runner.tool_limits.max_tool_rounds or self.tool_time_left() <= 0

    def _add(self, generated: Generated) -> None:
        self.generated.append(generated)
        self.round_outs.append(
            RoundOut(
                prompt_tokens=generated.prompt_tokens,
                cached_tokens=generated.cached_tokens,
                completion_tokens=generated.completion_tokens,
                ms=ms_between(generated.submitted, time.monotonic()),
                tool_ms=0.0,
            )
        )

    def summed(self, last: Generated) -> Generated:
        """What the reply says: the last generation's text and calls; the first one's times;
        the tokens of all of them; the worker's calls."""
        every = self.generated or [last]
        worker_calls = listed_calls(self.turn, self.progress.calls)
        return dataclasses.replace(
            last,
            submitted=every[0].submitted,
            first_token=next((g.first_token for g in every if g.first_token is not None), last.first_token),
            engine_times=next((g.engine_times for g in every if g.engine_times is not None), last.engine_times),
            prompt_tokens=sum(g.prompt_tokens for g in every) or last.prompt_tokens,
            completion_tokens=sum(g.completion_tokens for g in every) or last.completion_tokens,
            cached_tokens=sum(g.cached_tokens for g in every) or last.cached_tokens,
            image_tokens=sum(g.image_tokens for g in every) or last.image_tokens,
            worker_calls=worker_calls,
            rounds=self.round_outs if worker_calls else [],
        )

    def _commit(self, last: Generated) -> TurnAnswer:
        """The turn is answered: it joins the history, committed with the reply."""
        self.history.turns.append(self.turn)
        return TurnAnswer(self.runner.reply(self.pending, self.summed(last)), self.history)

    def _ask_client(self, calls: list[ToolCall]) -> TurnAnswer:
        """End the request with calls for the client (finishReason tool_calls): the session
        keeps the open turn, and the next toolResults goes on from there."""
        last = self.generated[-1] if self.generated else Generated(submitted=time.monotonic())
        confirm = {c.id for c in calls if c.name in self.worker and self.worker[c.name].confirm}
        asking = dataclasses.replace(last, tool_calls=tuple(calls), finish_reason=TOOL_CALLS, confirm_ids=confirm)
        if self.stream is not None:
            self.stream.announce(wire_calls(asking.tool_calls, confirm))
        return self._commit(asking)

    def _cancelled(self, last: Generated) -> TurnAnswer:
        """A cancel: nothing changes, unless the worker ran calls in this request; then the
        turn is kept as far as it came, closed with the text generated so far, and committed
        with the cancelled reply as its answer. A device may have acted: a history without the
        call would tell the model the lamp is still off, and a redelivery, finding no answer,
        would go on from the progress with the calls' outcomes unknown. So the calls and their
        results stay, a redelivery gets the stored reply, and nothing is sent twice
        (docs/protocol.md, control)."""
        if not self.progress.calls:
            return TurnAnswer(self.runner.reply(self.pending, self.summed(last)), None)
        self.turn.messages.append(AssistantMessage(last.text))
        return self._commit(last)


async def start_rounds(
    runner: Runner, pending: PendingTurn, history: SessionHistory, images: tuple[ImageRef, ...] = ()
) -> TurnAnswer:
    """Find the turn the request works on, and run its rounds. ``images``: those of the
    request's message (their bytes are in ``history.images``)."""
    worker = runner.worker_calls.offered(history, pending.address.user)
    progress = await runner.worker_calls.load_progress(pending, history)
    open_turn = history.open_turn
    # The turn's rounds before this request: those of the open turn a toolResults goes on with.
    start = 0
    if pending.request.tool_results is not None and open_turn is not None:
        start = open_turn.rounds if progress is None or open_turn.key == progress.turn.key else 0
    approved: list[ToolCall] = []
    if progress is not None:
        turn = _resumed(runner, pending, history, worker, progress)
    else:
        turn, approved = _request_turn(runner, pending, history, images)
    stream = runner.delta_stream(pending) if pending.request.stream else None
    rounds = ToolRounds(
        runner, pending, history, worker, turn, Progress(turn, progress.calls if progress else {}), start, stream
    )
    if approved and pending.key in pending.runtime.cancelled:
        # Cancelled while queued: the approved calls are not sent, and nothing changes (they
        # stay pending; the client may approve them again).
        cancelled = Generated(submitted=time.monotonic(), finish_reason="cancelled")
        return TurnAnswer(runner.reply(pending, cancelled), None)
    return await rounds.run(approved)


def _request_turn(
    runner: Runner, pending: PendingTurn, history: SessionHistory, images: tuple[ImageRef, ...] = ()
) -> tuple[Turn, list[ToolCall]]:
    """The turn this request adds to, taken out of ``history.turns`` (which keeps the closed
    turns while the prompt is built), and the worker calls the client approved, to run first.

    - A new message: a new turn (any calls left open get a result saying they were not run).
    - toolResults: the open turn with the client's results and declines added."""
    request, open_turn = pending.request, history.open_turn
    if request.tool_results is not None:
        if open_turn is None:
            raise RequestError(ErrorCode.INVALID_REQUEST, "toolResults sent, but the session has no pending tool calls")
        client_tools = {tool.name for tool in history.tools}
        confirmable = {c.name for c in open_turn.pending_calls() if c.name not in client_tools}
        max_bytes = runner.max_tool_result_bytes
        approved = apply_results(open_turn, request.tool_results, max_bytes, confirmable)
        return history.turns.pop(), approved
    if open_turn is not None:
        close_unanswered(open_turn)
    assert request.message is not None
    return Turn(pending.key, [UserMessage(request.message, images)]), []


def _resumed(
    runner: Runner,
    pending: PendingTurn,
    history: SessionHistory,
    worker: dict[str, WorkerTool],
    progress: Progress,
) -> Turn:
    """A redelivery with stored progress: the turn as far as it had come. Its worker calls
    that may have been sent and have no result get one saying the outcome is unknown: they
    are never sent again."""
    request, open_turn = pending.request, history.open_turn
    if request.tool_results is not None and open_turn is not None and open_turn.key == progress.turn.key:
        history.turns.pop()
    elif request.message is not None and open_turn is not None:
        close_unanswered(open_turn)
    turn = progress.turn.copy()
    for sha, image in progress.images.items():
        history.images.setdefault(sha, image)
    approvals = {r.tool_call_id for r in request.tool_results or () if r.approved}
    client_tools = {tool.name for tool in history.tools}
    for call in turn.pending_calls():
        confirm = call.name in worker and worker[call.name].confirm
        if call.name not in client_tools and (not confirm or call.id in approvals):
            turn.messages.append(ToolResultMessage(call.id, call.name, UNKNOWN_RESULT))
            progress.calls[call.id] = WorkerCallRecord("unknown", 0.0, turn.rounds - 1)
            runner.stats.record_tool_call(call.name, "unknown", 0.0)
            logger.warning(
                "Request {} of {}: call {} to {} may have been sent before the worker stopped; "
                "not sent again (its outcome is unknown)",
                log_ref(pending.key),
                pending.address,
                call.id,
                call.name,
            )
    order_results(turn)
    return turn
