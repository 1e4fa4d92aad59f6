"""Where sessions live between requests and across restarts: SQLite by default, memory for
tests and throwaway runs.

What is stored per session: the system prompt and the kept turns (as trimmed), and the
answers given to its requests by request key, so a redelivered request is answered from here
and never generates twice. ``reset`` deletes the conversation and the answers' text but keeps
their keys (tombstones). Per request key, the number of deliveries that did not end in an
answer: a request that keeps killing the worker is recognised (a poison request).

SQLite runs in WAL mode with ``synchronous=NORMAL``: a turn is one transaction, and a
committed transaction survives the worker's crash or SIGKILL (it is in the OS's page cache
and the WAL); only a power loss can take the last transactions since a checkpoint. A
database that cannot be opened or read is moved aside with an error log and a new one is
started: losing history beats a worker that cannot start (systemd would restart it forever).

Deleting means the text is gone from the files, not only from the tables: ``secure_delete``
overwrites deleted rows with zeros, and a reset or an expiry checkpoints and truncates the
WAL, which still holds the pages as they were before.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections import OrderedDict
from pathlib import Path
from typing import Protocol

from loguru import logger

from .config import HistoryConfig, RedisConfig
from .history import ANSWERED_KEYS_PER_SESSION, SessionHistory, Turn

DATABASE_NAME = "sessions.sqlite3"
SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    name TEXT PRIMARY KEY,
    state TEXT NOT NULL,            -- {"systemPrompt": ..., "turns": [{"key", "user", "assistant"}]}
    updated REAL NOT NULL           -- time.time() of the last change
);
CREATE TABLE IF NOT EXISTS answers (
    session TEXT NOT NULL,
    key TEXT NOT NULL,
    payload BLOB,                   -- NULL: a tombstone (the session was reset)
    created REAL NOT NULL,
    PRIMARY KEY (session, key)
);
CREATE INDEX IF NOT EXISTS answers_by_age ON answers (session, created);
CREATE TABLE IF NOT EXISTS deliveries (
    session TEXT NOT NULL,
    key TEXT NOT NULL,
    count INTEGER NOT NULL,
    updated REAL NOT NULL,
    PRIMARY KEY (session, key)
);
"""


def open_store(config: HistoryConfig, redis: RedisConfig, prefix: str) -> HistoryStore:
    if config.store == "memory":
        return MemoryStore()
    if config.store == "redis":
        from .redisstore import RedisStore  # imports redis, an optional dependency

        logger.info("Sessions are stored in Redis, shared with the worker's group")
        return RedisStore(redis.url, prefix, config.session_ttl)
    store = SqliteStore(config.state_dir)
    logger.info("Sessions are stored in {}", store.path)
    return store


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


def _state(history: SessionHistory) -> str:
    turns = [{"key": t.key, "user": t.user, "assistant": t.assistant} for t in history.turns]
    return json.dumps({"systemPrompt": history.system_prompt, "turns": turns}, ensure_ascii=False)


def _history(state: str, answers: list[tuple[str, bytes | None]]) -> SessionHistory:
    data = json.loads(state)
    turns = [Turn(t["key"], t["user"], t["assistant"]) for t in data["turns"]]
    return SessionHistory(data["systemPrompt"], turns, OrderedDict(answers))


class SqliteStore:
    shared = False

    def __init__(self, state_dir: Path) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        self.path = state_dir / DATABASE_NAME
        try:
            self._db = self._open()
        except sqlite3.DatabaseError as exc:
            aside = self._move_aside()
            logger.error("Session database {} is unreadable ({}); moved to {}, starting empty", self.path, exc, aside)
            self._db = self._open()

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA secure_delete=ON")
            check = db.execute("PRAGMA quick_check").fetchone()
            if check is None or check[0] != "ok":
                raise sqlite3.DatabaseError(f"integrity check failed: {check}")
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                raise sqlite3.DatabaseError(f"schema version {version}; this worker knows {SCHEMA_VERSION}")
            db.executescript(_SCHEMA)
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except BaseException:
            db.close()
            raise
        return db

    def _move_aside(self) -> Path:
        aside = self.path.with_name(f"{self.path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
        for suffix in ("", "-wal", "-shm"):
            part = Path(f"{self.path}{suffix}")
            if part.exists():
                part.rename(Path(f"{aside}{suffix}"))
        return aside

    def load(self, session: str) -> SessionHistory | None:
        row = self._db.execute("SELECT state FROM sessions WHERE name = ?", (session,)).fetchone()
        answers = self._db.execute(
            "SELECT key, payload FROM answers WHERE session = ? ORDER BY created DESC LIMIT ?",
            (session, ANSWERED_KEYS_PER_SESSION),
        ).fetchall()
        if row is None and not answers:
            return None
        return _history(row[0] if row else _state(SessionHistory()), list(reversed(answers)))

    def save(self, session: str, history: SessionHistory, key: str, payload: bytes | None) -> bytes | None:
        now = time.time()
        with self._transaction():
            self._db.execute(
                "INSERT INTO sessions (name, state, updated) VALUES (?, ?, ?) "
                "ON CONFLICT (name) DO UPDATE SET state = excluded.state, updated = excluded.updated",
                (session, _state(history), now),
            )
            if payload is not None:
                self._db.execute(
                    "INSERT OR REPLACE INTO answers (session, key, payload, created) VALUES (?, ?, ?, ?)",
                    (session, key, payload, now),
                )
                self._db.execute(
                    "DELETE FROM answers WHERE session = ? AND key NOT IN "
                    "(SELECT key FROM answers WHERE session = ? ORDER BY created DESC LIMIT ?)",
                    (session, session, ANSWERED_KEYS_PER_SESSION),
                )
            self._db.execute("DELETE FROM deliveries WHERE session = ? AND key = ?", (session, key))
        return None

    def reset(self, session: str) -> None:
        with self._transaction():
            self._db.execute("DELETE FROM sessions WHERE name = ?", (session,))
            self._db.execute("UPDATE answers SET payload = NULL WHERE session = ?", (session,))
        self._purge_wal()

    def count_delivery(self, session: str, key: str) -> int:
        row = self._db.execute(
            "INSERT INTO deliveries (session, key, count, updated) VALUES (?, ?, 1, ?) "
            "ON CONFLICT (session, key) DO UPDATE SET count = count + 1, updated = excluded.updated "
            "RETURNING count",
            (session, key, time.time()),
        ).fetchone()
        return int(row[0])

    def uncount_delivery(self, session: str, key: str) -> None:
        self._db.execute(
            "UPDATE deliveries SET count = count - 1 WHERE session = ? AND key = ? AND count > 0", (session, key)
        )

    def expire(self, idle_seconds: float) -> list[str]:
        cutoff = time.time() - idle_seconds
        with self._transaction():
            names = [
                row[0]
                for row in self._db.execute(
                    "SELECT name FROM sessions WHERE updated < ? UNION "
                    "SELECT session FROM answers GROUP BY session HAVING max(created) < ?",
                    (cutoff, cutoff),
                )
            ]
            self._db.execute("DELETE FROM sessions WHERE updated < ?", (cutoff,))
            self._db.execute(
                "DELETE FROM answers WHERE session IN "
                "(SELECT session FROM answers GROUP BY session HAVING max(created) < ?)",
                (cutoff,),
            )
            self._db.execute("DELETE FROM deliveries WHERE updated < ?", (cutoff,))
        if names:
            self._purge_wal()
        return names

    def _purge_wal(self) -> None:
        """Copy the WAL into the database and empty it: its older frames still hold what was
        just deleted. A few milliseconds, on resets and expiries only."""
        self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def _transaction(self) -> _Transaction:
        return _Transaction(self._db)

    def close(self) -> None:
        self._db.close()


class _Transaction:
    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._db.execute("COMMIT" if exc_type is None else "ROLLBACK")


class MemoryStore:
    """The same contract in this process's memory: gone when it exits."""

    shared = False

    def __init__(self) -> None:
        self._sessions: dict[str, tuple[SessionHistory, float]] = {}
        self._deliveries: dict[tuple[str, str], int] = {}

    def load(self, session: str) -> SessionHistory | None:
        entry = self._sessions.get(session)
        return entry[0] if entry else None

    def save(self, session: str, history: SessionHistory, key: str, payload: bytes | None) -> bytes | None:
        self._sessions[session] = (history, time.time())
        self._deliveries.pop((session, key), None)
        return None

    def reset(self, session: str) -> None:
        entry = self._sessions.get(session)
        if entry:
            entry[0].reset()  # the same object the cache holds: already reset, kept for clarity

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
        return names

    def close(self) -> None:
        self._sessions.clear()


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
        """Store the session as it is now, with the answer to key (one transaction). The
        history object is the one the turn ran on: had the session been dropped from memory
        meanwhile, loading it again would lose that turn. None, or the answer another worker
        stored for key first (HistoryStore.save)."""
        self._sessions[name] = history
        self._sessions.move_to_end(name)
        self._evict()  # it may have been dropped meanwhile: putting it back must not exceed capacity
        if payload is not None:
            history.remember_answer(key, payload)
        return self.store.save(name, history, key, payload)

    def reset(self, name: str) -> None:
        self.get(name).reset()
        self.store.reset(name)

    def expire(self, idle_seconds: float) -> int:
        names = self.store.expire(idle_seconds)
        for name in names:
            self._sessions.pop(name, None)
        return len(names)

    def __len__(self) -> int:
        return len(self._sessions)
