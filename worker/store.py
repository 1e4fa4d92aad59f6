"""Where sessions live between requests and across restarts: SQLite by default, memory for
tests and throwaway runs.

What is stored per session: the system prompt and the kept turns (as trimmed), and the
answers given to its requests by request key, so a redelivered request is answered from here
and never generates twice. ``reset`` deletes the conversation and the answers' text but keeps
their keys (tombstones). Per request key, the number of deliveries that did not end in an
answer: a request that keeps killing the worker is recognised (a poison request).

SQLite runs in WAL mode with ``synchronous=NORMAL``: a turn is one transaction, and a
committed transaction survives the worker's crash or SIGKILL (it is in the OS's page cache
and the WAL); only a power loss can take the last transactions since a checkpoint.

Faults are typed (docs/reliability.md): a database locked by another connection (an
operator's sqlite3 shell, a backup) is waited for, within a busy timeout and a few retries,
then StoreUnavailable; so are a full disk, a read-only state directory and I/O errors, and the
request gets a ``store_unavailable`` answer. A database is moved aside (and a new one started)
only when SQLite itself proves it corrupt (not a database, malformed, failed integrity check):
never for a lock. One session whose stored state cannot be parsed raises SessionUnreadable for
that session alone; its reset still works (it deletes the row without reading it).

Deleting means the text is gone from the files, not only from the tables: ``secure_delete``
overwrites deleted rows with zeros, and a reset or an expiry checkpoints and truncates the
WAL, which still holds the pages as they were before.
"""

from __future__ import annotations

import functools
import json
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from loguru import logger

from .config import HistoryConfig, RedisConfig
from .history import ANSWERED_KEYS_PER_SESSION, SessionHistory, Turn

DATABASE_NAME = "sessions.sqlite3"
# How long one statement waits for another connection's lock, and how often it is tried: the
# store runs on the event loop, so a wait holds every session's streaming. 1 s x 3 tries
# rides out a backup's or a shell's short transaction; a lock held longer gets
# store_unavailable answers until it is released.
BUSY_TIMEOUT = 1.0
BUSY_TRIES = 3
# At start a lock is waited for longer (nothing is being served yet), then the start fails
# with a clear error: systemd restarts it, and the database is left as it is.
OPEN_LOCKED_TIMEOUT = 60.0
_CORRUPTION = {11, 26}  # SQLITE_CORRUPT, SQLITE_NOTADB: the only errors that prove a damaged file
_BUSY = {5, 6}  # SQLITE_BUSY, SQLITE_LOCKED


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


def _sqlite_code(exc: sqlite3.Error) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)  # Python >= 3.11
    return code & 0xFF if isinstance(code, int) else None


def is_corruption(exc: sqlite3.Error) -> bool:
    code = _sqlite_code(exc)
    if code is not None:
        return code in _CORRUPTION
    # Python 3.10 has no error codes: sqlite3 raises the bare DatabaseError for exactly these.
    return type(exc) is sqlite3.DatabaseError


def is_busy(exc: sqlite3.Error) -> bool:
    code = _sqlite_code(exc)
    if code is not None:
        return code in _BUSY
    return isinstance(exc, sqlite3.OperationalError) and ("locked" in str(exc) or "busy" in str(exc))


T = TypeVar("T")


def _guarded(method: Callable[..., T]) -> Callable[..., T]:
    """SqliteStore methods: a lock is retried (BUSY_TRIES, each waiting BUSY_TIMEOUT), and
    every SQLite error ends as StoreUnavailable."""

    @functools.wraps(method)
    def guarded(self: SqliteStore, *args: Any, **kwargs: Any) -> T:
        for attempt in range(1, BUSY_TRIES + 1):
            try:
                return method(self, *args, **kwargs)
            except sqlite3.Error as exc:
                if is_busy(exc) and attempt < BUSY_TRIES:
                    logger.warning("Session database is locked by another connection; retrying ({})", attempt)
                    continue
                logger.error("Session database error in {}: {}", method.__name__, exc)
                raise StoreUnavailable(f"the session store failed: {exc}") from exc
        raise AssertionError("unreachable")

    return guarded


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


def _history(session: str, state: str, answers: list[tuple[str, bytes | None]]) -> SessionHistory:
    system_prompt, turns = parse_state(session, state)
    return SessionHistory(system_prompt, turns, OrderedDict(answers))


class SqliteStore:
    shared = False

    def __init__(self, state_dir: Path, *, open_locked_timeout: float = OPEN_LOCKED_TIMEOUT) -> None:
        self.path = state_dir / DATABASE_NAME
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreUnavailable(f"cannot create the state directory {state_dir}: {exc}") from exc
        deadline = time.monotonic() + open_locked_timeout
        while True:
            try:
                self._db = self._open()
                return
            except sqlite3.Error as exc:
                if is_corruption(exc):
                    damage = exc
                    break
                if is_busy(exc) and time.monotonic() < deadline:
                    logger.warning("Session database {} is locked by another connection ({}); waiting", self.path, exc)
                    time.sleep(1.0)
                    continue
                raise StoreUnavailable(f"cannot open the session database {self.path}: {exc}") from exc
        aside = self._move_aside()
        logger.error("Session database {} is corrupt ({}); moved to {}, starting empty", self.path, damage, aside)
        try:
            self._db = self._open()
        except sqlite3.Error as exc:
            raise StoreUnavailable(f"cannot open the session database {self.path}: {exc}") from exc

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT, isolation_level=None, check_same_thread=False)
        try:
            # Read-only checks first: a database this worker must not use is left untouched.
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                # A newer worker's database: refuse to start rather than throw it away.
                raise StoreUnavailable(
                    f"{self.path} has schema version {version}; this worker knows {SCHEMA_VERSION} (a newer worker's?)"
                )
            check = db.execute("PRAGMA quick_check").fetchone()
            if check is None or check[0] != "ok":
                raise sqlite3.DatabaseError(f"integrity check failed: {check}")  # corruption, proven
            if db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":  # changing it takes a lock
                db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA secure_delete=ON")
            if version != SCHEMA_VERSION:  # a new database: writing takes the lock, so only then
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

    @_guarded
    def load(self, session: str) -> SessionHistory | None:
        row = self._db.execute("SELECT state FROM sessions WHERE name = ?", (session,)).fetchone()
        answers = self._db.execute(
            "SELECT key, payload FROM answers WHERE session = ? ORDER BY created DESC LIMIT ?",
            (session, ANSWERED_KEYS_PER_SESSION),
        ).fetchall()
        if row is None and not answers:
            return None
        return _history(session, row[0] if row else _state(SessionHistory()), list(reversed(answers)))

    @_guarded
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

    @_guarded
    def reset(self, session: str) -> None:
        with self._transaction():
            self._db.execute("DELETE FROM sessions WHERE name = ?", (session,))
            self._db.execute("UPDATE answers SET payload = NULL WHERE session = ?", (session,))
        self._purge_wal()

    @_guarded
    def count_delivery(self, session: str, key: str) -> int:
        row = self._db.execute(
            "INSERT INTO deliveries (session, key, count, updated) VALUES (?, ?, 1, ?) "
            "ON CONFLICT (session, key) DO UPDATE SET count = count + 1, updated = excluded.updated "
            "RETURNING count",
            (session, key, time.time()),
        ).fetchone()
        return int(row[0])

    @_guarded
    def uncount_delivery(self, session: str, key: str) -> None:
        self._db.execute(
            "UPDATE deliveries SET count = count - 1 WHERE session = ? AND key = ? AND count > 0", (session, key)
        )

    @_guarded
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
