"""SessionCache: the live sessions in memory, over any HistoryStore.

What a turn reads, and commits its answer to (store first, memory second)."""

from __future__ import annotations

from collections import OrderedDict

from ..session import SessionHistory
from ..store.port import HistoryStore


class SessionCache:
    """The live sessions in memory, least recently used first, over the store: beyond
    capacity the oldest is dropped from memory (it stays in the store)."""

    def __init__(self, store: HistoryStore, capacity: int) -> None:
        self.store = store
        self.capacity = capacity
        self._sessions: OrderedDict[str, SessionHistory] = OrderedDict()

    def get(self, name: str) -> SessionHistory:
        history = self._sessions.get(name)
        if history is None or self.store.shared:
            history = self._sessions[name] = self.store.load(name) or SessionHistory()
        self._sessions.move_to_end(name)
        self._evict()
        return history

    def _evict(self) -> None:
        while len(self._sessions) > self.capacity:
            self._sessions.popitem(last=False)

    def save(self, name: str, history: SessionHistory, key: str, payload: bytes | None) -> bytes | None:
        """Commit a session's new state with the answer to key: in the store (one
        transaction) first, then in memory, so a store that fails (StoreError) leaves both as
        they were. ``history`` is the draft the turn ran on (SessionHistory.draft). None, or
        the answer another worker stored for key first (HistoryStore.save)."""
        first = self.store.save(name, history, key, payload)
        if payload is not None:
            history.remember_answer(key, first if first is not None else payload)
        self._sessions[name] = history
        self._sessions.move_to_end(name)
        self._evict()
        return first

    def reset(self, name: str) -> None:
        """Forget the conversation, in the store first. The stored state is not read: a session
        whose row is unreadable can be reset."""
        self.store.reset(name)
        cached = self._sessions.get(name)
        if cached is not None:
            cached.reset()

    def expire(self, idle_seconds: float) -> int:
        names = self.store.expire(idle_seconds)
        for name in names:
            self._sessions.pop(name, None)
        return len(names)

    def __len__(self) -> int:
        return len(self._sessions)
