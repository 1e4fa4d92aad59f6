"""The session store in this process's memory (history.store = "memory").

For tests and throwaway runs: the sessions are gone when the worker exits. Called like every
store, on the store's thread (core/session_cache.py), though nothing here waits: the tests run the
service's one path."""

from __future__ import annotations

import time

from ..session import SessionHistory, StoredImage
from .port import stored_images


class MemoryStore:
    """The same contract in this process's memory: gone when it exits."""

    shared = False
    waits = False  # a dict in this process: called on the event loop

    def __init__(self) -> None:
        self._sessions: dict[str, tuple[SessionHistory, float]] = {}
        self._deliveries: dict[tuple[str, str], int] = {}
        self._progress: dict[tuple[str, str], str] = {}
        # A session's images by hash, as the other stores keep them: each added once, by the
        # save whose turns first refer to it, and dropped by the save that trims the last turn
        # showing it, by a reset or an expiry.
        self._images: dict[str, dict[str, StoredImage]] = {}

    def load(self, session: str) -> SessionHistory | None:
        entry = self._sessions.get(session)
        return entry[0] if entry else None

    def save(self, session: str, history: SessionHistory, key: str, payload: bytes | None) -> bytes | None:
        images = self._images.setdefault(session, {})
        new, gone = stored_images(history, set(images))
        images.update(new)
        for sha in gone:
            del images[sha]
        # The history keeps what the store keeps: a trimmed turn's images go with it.
        history.images = dict(images)
        if not images:
            del self._images[session]
        self._sessions[session] = (history, time.time())
        self._deliveries.pop((session, key), None)
        self._progress.pop((session, key), None)
        return None

    def reset(self, session: str) -> None:
        for done in [k for k in self._progress if k[0] == session]:
            del self._progress[done]
        self._images.pop(session, None)
        entry = self._sessions.get(session)
        if entry:
            # A reset copy: the object stored may be the one the cache holds, which the cache
            # resets itself, on the event loop (this runs on the store's thread).
            history = entry[0].draft()
            history.reset()
            self._sessions[session] = (history, entry[1])

    def count_delivery(self, session: str, key: str) -> int:
        count = self._deliveries[(session, key)] = self._deliveries.get((session, key), 0) + 1
        return count

    def uncount_delivery(self, session: str, key: str) -> None:
        if self._deliveries.get((session, key), 0) > 0:
            self._deliveries[(session, key)] -= 1

    def expire(self, idle_seconds: float) -> list[str]:
        cutoff = time.time() - idle_seconds
        names = [name for name, (_, updated) in self._sessions.items() if updated < cutoff]
        for name in names:
            del self._sessions[name]
            self._images.pop(name, None)
        return names

    def save_progress(self, session: str, key: str, progress: str) -> None:
        self._progress[(session, key)] = progress

    def load_progress(self, session: str, key: str) -> str | None:
        return self._progress.get((session, key))

    def close(self) -> None:
        self._sessions.clear()
