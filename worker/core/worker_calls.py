"""The worker's own tools in a request: which the session may use and is offered, a round's
calls run at once, their results cut to size, and the progress kept so that no call is ever
sent twice (docs/reliability.md). The loop that calls these is core/rounds.py."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from loguru import logger

from ..config.models import ToolsConfig
from ..protocol.messages import ErrorCode, RequestError, RoundOut, ToolEvent, WorkerCallOut, log_ref, log_text
from ..session import Progress, SessionHistory, ToolCall, ToolResultMessage, Turn, WorkerCallRecord
from ..tools.port import CallContext, Toolbox, ToolOutcome, WorkerTool, cut_utf8, safe_text, utf8_size
from .calls import order_results
from .pending import PendingTurn
from .stats import StatsCollector
from .stream import DeltaStream

# A worker call's result as the reply lists it (the model got all of it, up to max_tool_result_tokens).
WORKER_RESULT_CHARS = 1000


class ProgressJournal(Protocol):
    """Where a request's tool-loop progress is kept (core/session_cache.py SessionCache)."""

    async def asave_progress(self, name: str, key: str, progress: Progress) -> None: ...

    async def aload_progress(self, name: str, key: str) -> Progress | None: ...


class RoundState(Protocol):
    """A request's loop as its worker calls see it (core/rounds.py ``ToolRounds``): the turn
    their results join, the progress they are recorded in, the tools offered, the stream of
    their events, and the request's time for tool calls."""

    pending: PendingTurn
    turn: Turn
    progress: Progress
    worker: dict[str, WorkerTool]
    stream: DeltaStream | None
    tool_seconds: float
    round_outs: list[RoundOut]

    def tool_time_left(self) -> float: ...


class WorkerCalls:
    """The worker's own tools (``toolbox``), within ``limits`` ([tools]); ``count_text``
    counts a result's tokens (the renderer's)."""

    def __init__(
        self,
        toolbox: Toolbox | None,
        limits: ToolsConfig,
        stats: StatsCollector,
        count_text: Callable[[str], int],
        journal: ProgressJournal | None,
    ) -> None:
        self.toolbox = toolbox
        self.limits = limits
        self.stats = stats
        self.count_text = count_text
        self.journal = journal

    def choose(self, names: list[str], user: str) -> list[str]:
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

    def offered(self, history: SessionHistory, user: str) -> dict[str, WorkerTool]:
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

    async def load_progress(self, pending: PendingTurn, history: SessionHistory) -> Progress | None:
        """The request's stored progress. Only a request that may have run worker calls can
        have one: in a session with workerTools, or approving calls (toolResults); the others
        make no store call for it (one round trip to the store's thread less per request)."""
        if self.journal is None or not (history.worker_tools or pending.request.tool_results is not None):
            return None
        progress = await self.journal.aload_progress(str(pending.address), pending.key)
        if progress is not None:
            logger.info(
                "Request {} of {}: going on from its stored tool-loop progress", log_ref(pending.key), pending.address
            )
        return progress

    async def save_progress(self, pending: PendingTurn, progress: Progress) -> None:
        if self.journal is not None:
            await self.journal.asave_progress(str(pending.address), pending.key, progress)

    async def run_round(self, rounds: RoundState, calls: Sequence[ToolCall], round_: int) -> None:
        """Run one round's worker calls at once; each result joins the turn (as a tool result)
        and is stored before the loop goes on. Calls over max_calls_per_round, or past the
        request's tool time, are not sent: their result says why. The progress is stored
        first: a call is never sent twice."""
        await self.save_progress(rounds.pending, rounds.progress)
        limit = self.limits.max_calls_per_round
        started = time.monotonic()
        await asyncio.gather(
            *(self._run_call(rounds, call, round_, skip=index >= limit) for index, call in enumerate(calls))
        )
        elapsed = time.monotonic() - started
        rounds.tool_seconds += elapsed
        if rounds.round_outs:  # the generation of this request that made these calls
            rounds.round_outs[-1].tool_ms = round(elapsed * 1000, 1)
        order_results(rounds.turn)

    async def _call(self, rounds: RoundState, call: ToolCall, *, skip: bool) -> ToolOutcome:
        """One call's outcome: sent to the toolbox, or why it was not."""
        budget = rounds.tool_time_left()
        if skip:
            limit = self.limits.max_calls_per_round
            return ToolOutcome(f"Error: not run: the model made more than {limit} calls in one round.", "skipped")
        if budget <= 0:
            return ToolOutcome("Error: not run: the request's time for tool calls is used up.", "skipped")
        if self.toolbox is None or call.name not in rounds.worker:
            # Run only what this session is offered now (an approval may come after the tool
            # was withdrawn, or the namespace's rights changed).
            return ToolOutcome(f"Error: the tool {call.name} is not available now.", "unavailable")
        pending = rounds.pending
        context = CallContext(request_id=pending.key, tool_call_id=call.id, session=str(pending.address))
        try:
            async with asyncio.timeout(budget):  # not wait_for: see tools/toolbox.py
                return await self.toolbox.call(call.name, call.arguments, context)
        except TimeoutError:
            return ToolOutcome("Error: the request's time for tool calls ran out during this call.", "timeout")

    async def _run_call(self, rounds: RoundState, call: ToolCall, round_: int, *, skip: bool) -> None:
        pending = rounds.pending
        started = time.monotonic()
        if rounds.stream is not None:
            rounds.stream.event(ToolEvent(event="start", tool_call_id=call.id, name=call.name, round=round_))
        result = await self._call(rounds, call, skip=skip)
        seconds = time.monotonic() - started
        content = await self._cut_result(result)
        rounds.turn.messages.append(ToolResultMessage(call.id, call.name, content))
        rounds.progress.calls[call.id] = WorkerCallRecord(result.outcome, round(seconds * 1000, 1), round_)
        self.stats.record_tool_call(call.name, result.outcome, seconds)
        # Stored first: the line below says the result is on record (a crash after it reuses it).
        await self.save_progress(pending, rounds.progress)
        logger.info(
            "Request {} of {}: worker call {} ({}) {} in {:.0f} ms",
            log_ref(pending.key),
            pending.address,
            call.name,
            call.id,
            result.outcome,
            seconds * 1000,
        )
        logger.debug("Worker call {} result: {!r}", call.id, content[:2000])
        if rounds.stream is not None:
            rounds.stream.event(
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
        small = min(self.limits.max_tool_result_bytes, self.limits.max_tool_result_tokens)
        if result.size is None and len(result.content) * 4 <= small:
            return safe_text(result.content)  # 4 bytes a character at most, a token at least one byte
        return await asyncio.to_thread(self._fit_result, result.content, result.size)

    def _fit_result(self, content: str, size: int | None) -> str:
        """_cut_result's work (in a thread; the renderer's count_text is safe there)."""
        max_bytes, max_tokens = self.limits.max_tool_result_bytes, self.limits.max_tool_result_tokens
        text, cut = cut_utf8(content, max_bytes)
        if cut:
            size = utf8_size(content)
        shown = len(text.encode("utf-8"))
        if shown > max_tokens and (total := self.count_text(text)) > max_tokens:
            low, high = 0, min(len(text), max_tokens * 32)  # the longest start of at most max_tokens tokens
            while low < high:
                middle = (low + high + 1) // 2
                if self.count_text(text[:middle]) <= max_tokens:
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


def listed_calls(turn: Turn, records: dict[str, WorkerCallRecord]) -> list[WorkerCallOut]:
    """The worker's calls of the turn as the reply lists them, in the calls' order."""
    if not records:
        return []
    results = turn.results()
    out = []
    for call in turn.calls():
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
