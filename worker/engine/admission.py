"""Admission: which requests the worker hands to the engine now, and which wait in the worker.

vLLM runs at most ``max_num_seqs`` requests at once and computes at most
``max_num_batched_tokens`` tokens a step; what it is handed beyond that waits in its own queue,
first come first served. Handing it requests beyond its sequences gives the engine nothing it
could not take later, and takes away what the worker can still do with a request that has
not reached the engine: serve users in turn rather than in arrival order (one user's 3,000
requests do not push another user's one behind them all), and cancel it without the engine's
round trip.

The policy (``may_admit``): a request goes to the engine now unless

- the engine already has ``max_num_seqs + waiting_requests`` requests (every sequence taken and
  ``waiting_requests`` more queued there to take the next free ones at once), or
- ``waiting_tokens`` is set and the requests handed to it that have no token yet (waiting, or
  in their prefill) hold that much prompt not in the prefix cache (estimated), and this one
  would add to it. With nothing waiting, a request goes whatever its length.

So no request waits in the worker while the engine has a free sequence: up to max_num_seqs
everything goes at once, and vLLM's scheduler fills each step's token budget from its own
queue. ``waiting_requests`` defaults to max_num_seqs / 8 (at least 16): when requests end, as
many wait in the engine to take their sequences at the next step.

``waiting_tokens`` is off by default: measured on one H100 (vLLM 0.26, a 2B geometry, one-turn
sessions of 300 prompt tokens, docs/performance.md "Admission"), holding prompts back to 4 x
max_num_batched_tokens waiting for their prefill cut tokens/s at 320 sessions from 14.4k to
5.4k and tripled TTFT p50: the worker sees a request's first token (and lets the next one in)
a loop pass and an engine step after vLLM could have scheduled more, so the engine ran short of
prefill. vLLM's own queue is the better buffer for prompts; the worker's is for requests beyond
the engine's sequences.

Waiting requests are released fairly: users in turn (round robin), each user's requests in
the order they came. Turns of one session are already in order (one at a time, by the
session's lock), so a user's order is theirs.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from dataclasses import dataclass

# A prompt's tokens counted as uncached when its session's last prompt and reply are known:
# at least one block (the prefix cache hits whole blocks; the last is always computed).
MIN_UNCACHED = 16
SESSIONS_REMEMBERED = 65536


@dataclass(frozen=True)
class AdmissionLimits:
    max_num_seqs: int
    waiting_requests: int  # beyond max_num_seqs, requests queued in the engine
    waiting_tokens: int | None  # prompt tokens (uncached, estimated) in the engine without a token yet; None: any

    def words(self) -> str:
        tokens = "" if self.waiting_tokens is None else f", {self.waiting_tokens} prompt tokens waiting there"
        return f"up to max_num_seqs {self.max_num_seqs} + {self.waiting_requests} requests in the engine{tokens}"


def admission_limits(
    max_num_seqs: int,
    *,
    waiting_requests: int | None = None,
    waiting_tokens: int | None = None,
) -> AdmissionLimits:
    """The limits for an engine of these scheduler limits; set values win (engine.admission_*)."""
    return AdmissionLimits(
        max_num_seqs=max(1, max_num_seqs),
        waiting_requests=max(16, max_num_seqs // 8) if waiting_requests is None else max(0, waiting_requests),
        waiting_tokens=None if waiting_tokens is None else max(1, waiting_tokens),
    )


@dataclass
class EngineLoad:
    """What the worker has handed to the engine and not had back."""

    in_engine: int = 0  # handed over, not finished
    unstarted: int = 0  # of those, without a first token (waiting in the engine, or in their prefill)
    unstarted_tokens: int = 0  # their prompt tokens, less what the prefix cache likely holds


def may_admit(load: EngineLoad, tokens: int, limits: AdmissionLimits) -> bool:
    """Whether a request of ``tokens`` uncached prompt tokens goes to the engine now."""
    if load.in_engine >= limits.max_num_seqs + limits.waiting_requests:
        return False
    if limits.waiting_tokens is None or load.unstarted == 0:
        return True  # nothing else waits in the engine: a prompt longer than waiting_tokens goes too
    return load.unstarted_tokens + tokens <= limits.waiting_tokens


class _Ticket:
    __slots__ = ("admitted", "cancelled", "request_id", "started", "tokens", "user")

    def __init__(self, request_id: str, user: str, tokens: int) -> None:
        self.request_id, self.user, self.tokens = request_id, user, tokens
        self.admitted: asyncio.Future[None] | None = None  # set while it waits
        self.started = False  # its first token came
        self.cancelled = False


def session_of(request_id: str) -> tuple[str, str]:
    """(user, session) of an engine request id: the worker's start with its session's address,
    ``user/session/...``; another id is its own user and session."""
    parts = request_id.split("/", 2)
    if len(parts) < 3:
        return request_id, request_id
    return parts[0], f"{parts[0]}/{parts[1]}"


class Admission:
    """The engine's door (see the module's docstring); one per engine, on the event loop."""

    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self.load = EngineLoad()
        self._waiting: OrderedDict[str, deque[_Ticket]] = OrderedDict()  # user -> tickets, users in turn
        self._held = 0
        self._tickets: dict[str, _Ticket] = {}
        # Session -> its last request's prompt and reply tokens: what its next prompt likely
        # finds in the prefix cache.
        self._previous: OrderedDict[str, int] = OrderedDict()

    @property
    def held(self) -> int:
        """Requests waiting in the worker for the engine."""
        return self._held

    def estimate(self, request_id: str, prompt_tokens: int) -> int:
        _, session = session_of(request_id)
        previous = self._previous.get(session, 0)
        if previous and prompt_tokens > previous:
            return max(MIN_UNCACHED, prompt_tokens - previous)
        return prompt_tokens

    async def enter(self, request_id: str, prompt_tokens: int) -> bool:
        """Wait until the request may go to the engine: True; False when it was cancelled
        (``cancel``) while it waited. The caller then calls ``started`` at its first token
        and ``leave`` once it is done, whatever happened (also when this raised)."""
        user, _ = session_of(request_id)
        ticket = _Ticket(request_id, user, self.estimate(request_id, prompt_tokens))
        self._tickets[request_id] = ticket
        if not self._held and may_admit(self.load, ticket.tokens, self.limits):
            self._hand_over(ticket)
            return True
        ticket.admitted = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(user, deque()).append(ticket)
        self._held += 1
        try:
            await ticket.admitted
        except asyncio.CancelledError:
            self._drop(ticket)
            raise
        return not ticket.cancelled

    def started(self, request_id: str) -> None:
        ticket = self._tickets.get(request_id)
        if ticket is not None and not ticket.started and ticket.admitted is None:
            ticket.started = True
            self.load.unstarted -= 1
            self.load.unstarted_tokens -= ticket.tokens
            self._release()

    def leave(self, request_id: str, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        """The request is done (or never went): its place is free. Its session's next prompt
        likely finds this one's prompt and reply in the prefix cache."""
        ticket = self._tickets.pop(request_id, None)
        if ticket is None:
            return
        if ticket.admitted is not None:  # still waiting (its waiter was cancelled)
            self._drop(ticket)
            return
        self.load.in_engine -= 1
        if not ticket.started:
            self.load.unstarted -= 1
            self.load.unstarted_tokens -= ticket.tokens
        if prompt_tokens:
            _, session = session_of(request_id)
            self._previous[session] = prompt_tokens + completion_tokens
            self._previous.move_to_end(session)
            if len(self._previous) > SESSIONS_REMEMBERED:
                self._previous.popitem(last=False)
        self._release()

    def cancel(self, request_id: str) -> bool:
        """Cancel a request waiting in the worker: True; False when it is not waiting (it is
        in the engine, or unknown)."""
        ticket = self._tickets.get(request_id)
        if ticket is None or ticket.admitted is None:
            return False
        ticket.cancelled = True
        future = ticket.admitted
        self._drop(ticket)
        if not future.done():
            future.set_result(None)
        return True

    def _drop(self, ticket: _Ticket) -> None:
        """Take a waiting ticket out of the queue."""
        if ticket.admitted is None:
            return
        queue = self._waiting.get(ticket.user)
        if queue is not None and ticket in queue:
            queue.remove(ticket)
            self._held -= 1
            if not queue:
                del self._waiting[ticket.user]
        ticket.admitted = None
        self._tickets.pop(ticket.request_id, None)

    def _hand_over(self, ticket: _Ticket) -> None:
        self.load.in_engine += 1
        self.load.unstarted += 1
        self.load.unstarted_tokens += ticket.tokens

    def _release(self) -> None:
        """Hand over waiting requests while the policy allows, users in turn."""
        while self._waiting:
            user, queue = next(iter(self._waiting.items()))
            ticket = queue[0]
            if not may_admit(self.load, ticket.tokens, self.limits):
                return
            queue.popleft()
            self._held -= 1
            if queue:
                self._waiting.move_to_end(user)  # the next user's turn
            else:
                del self._waiting[user]
            future, ticket.admitted = ticket.admitted, None
            self._hand_over(ticket)
            if future is not None and not future.done():
                future.set_result(None)
