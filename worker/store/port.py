"""The session store's port: the HistoryStore contract, its typed faults, the stored state.

Every store keeps the contract; the faults are those of docs/reliability.md; SQLite and Redis
share the stored state's JSON encoding.

What is stored per session: the system prompt and the kept turns (as trimmed), and the
answers given to its requests by request key, so a redelivered request is answered from here
and never generates twice. ``reset`` deletes the conversation and the answers' text but keeps
their keys (tombstones). Per request key, the number of deliveries that did not end in an
answer: a request that keeps killing the worker is recognised (a poison request).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Protocol

from ..core.history import SessionHistory, Turn


class StoreError(Exception):
    """A store operation failed. The request it served gets an error answer, never silence."""


class StoreUnavailable(StoreError):
    """The store cannot be used now (locked past the busy timeout, disk full, read-only, I/O
    error, Redis unreachable). It may recover by itself; the request can be sent again."""


class SessionUnreadable(StoreError):
    """One session's stored state cannot be parsed: that session alone is affected."""

    def __init__(self, session: str, detail: str) -> None:
        super().__init__(f"the stored state of session {session} cannot be read: {detail}")
        self.session = session


class HistoryStore(Protocol):
    # Shared by several workers (Redis): another worker may have changed a session since this
    # one loaded it, so it is loaded again for every request.
    shared: bool

    def load(self, session: str) -> SessionHistory | None: ...

    def save(self, session: str, history: SessionHistory, key: str, payload: bytes | None) -> bytes | None:
        """The session's state and one answer (payload None: the state only), at once. None,
        or, from a shared store, the answer another worker stored for key first: then nothing
        was written, and that answer is the one to give."""

    def reset(self, session: str) -> None: ...

    def count_delivery(self, session: str, key: str) -> int:
        """Count one more delivery of a request; how many there have been."""

    def uncount_delivery(self, session: str, key: str) -> None:
        """A delivery that ended without an answer for a reason other than the request (a
        graceful stop): not held against it."""

    def expire(self, idle_seconds: float) -> list[str]:
        """Delete sessions idle for longer; their names."""

    def close(self) -> None: ...


def encode_state(history: SessionHistory) -> str:
    turns = [{"key": t.key, "user": t.user, "assistant": t.assistant} for t in history.turns]
    return json.dumps({"systemPrompt": history.system_prompt, "turns": turns}, ensure_ascii=False)


def parse_state(session: str, state: str | bytes) -> tuple[str | None, list[Turn]]:
    """The system prompt and turns of a stored state; SessionUnreadable when it is damaged."""
    try:
        data = json.loads(state)
        turns = [Turn(str(t["key"]), str(t["user"]), str(t["assistant"])) for t in data["turns"]]
        system_prompt = data["systemPrompt"]
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise TypeError("systemPrompt is not a string")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SessionUnreadable(session, f"{type(exc).__name__}: {str(exc)[:200]}") from None
    return system_prompt, turns


def decode_history(session: str, state: str, answers: list[tuple[str, bytes | None]]) -> SessionHistory:
    system_prompt, turns = parse_state(session, state)
    return SessionHistory(system_prompt, turns, OrderedDict(answers))
