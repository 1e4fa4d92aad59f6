"""The default session store: one SQLite file in ``history.state_dir``.

The contract, and what is stored: port.py.

SQLite runs in WAL mode with ``synchronous=NORMAL``: a turn is one transaction (a savepoint
of one, when the store's thread commits several calls at once: ``run_batch``), and a
committed transaction survives the worker's crash or SIGKILL (it is in the OS's page cache
and the WAL); only a power loss can take the last transactions since a checkpoint.

Faults are typed (docs/reliability.md): a database locked by another connection (an
operator's sqlite3 shell, a backup) is waited for, within a busy timeout and a few retries,
then StoreUnavailable; so are a full disk, a read-only state directory and I/O errors, and the
request gets a ``store_unavailable`` answer. A database is moved aside (and a new one started)
only when SQLite itself proves it corrupt (not a database, malformed, failed integrity check):
never for a lock. One session whose stored state cannot be parsed raises SessionUnreadable for
that session alone; its reset still works (it deletes the row without reading it).

A session's images are rows of their own (``images``, by session and content hash): each is
written once, in the transaction of the save whose state first refers to it, and deleted in
the one that trims the last turn showing it; the state holds only their hashes.

Deleting means the text (and the images) is gone from the files, not only from the tables:
``secure_delete`` overwrites deleted rows with zeros, and a reset or an expiry checkpoints and
truncates the WAL, which still holds the pages as they were before.
"""

from __future__ import annotations

import contextlib
import functools
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from loguru import logger

from ..session import ANSWERED_KEYS_PER_SESSION, SessionHistory, StoredImage
from .port import StoreUnavailable, decode_history, encode_state, missing_images, outcome, stored_images

DATABASE_NAME = "sessions.sqlite3"
# How long one statement waits for another connection's lock, and how often it is tried. The
# service calls the store on a thread of its own (core/session_cache.py), so a wait holds the
# requests that need the store (their dispatch, their commit), not the event loop: streams go
# on (bench/storelock.py). 1 s x 3 tries rides out a backup's or a shell's short transaction;
# a lock held longer gets store_unavailable answers until it is released.
BUSY_TIMEOUT = 1.0
BUSY_TRIES = 3
# At start a lock is waited for longer (nothing is being served yet), then the start fails
# with a clear error: systemd restarts it, and the database is left as it is.
OPEN_LOCKED_TIMEOUT = 60.0
_CORRUPTION = {11, 26}  # SQLITE_CORRUPT, SQLITE_NOTADB: the only errors that prove a damaged file
_BUSY = {5, 6}  # SQLITE_BUSY, SQLITE_LOCKED


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
    """SqliteStore methods: one at a time on the connection (whichever thread calls), a lock
    is retried (BUSY_TRIES, each waiting BUSY_TIMEOUT), and every SQLite error ends as
    StoreUnavailable."""

    @functools.wraps(method)
    def guarded(self: SqliteStore, *args: Any, **kwargs: Any) -> T:
        with self._in_use:
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


SCHEMA_VERSION = 3
# A session's images (version 3; added to an older database on open): each once per session,
# by content hash, written by the save whose state first refers to it and deleted by the save
# that trims the last turn showing it (port.py stored_images), by a reset or an expiry. Per
# session, not shared between sessions: a reset or an expiry of one never touches another's,
# and no reference count has to be kept right (the same image in two sessions is stored twice).
_IMAGES = """
CREATE TABLE IF NOT EXISTS images (
    session TEXT NOT NULL,
    sha256 TEXT NOT NULL,           -- the hash the state's image parts name
    media_type TEXT NOT NULL,
    data BLOB NOT NULL,             -- the bytes as the client (a topic, a tool) sent them
    PRIMARY KEY (session, sha256)
);
"""
# A request's tool-loop progress (version 2; added to a version-1 database on open).
_PROGRESS = """
CREATE TABLE IF NOT EXISTS progress (
    session TEXT NOT NULL,
    key TEXT NOT NULL,
    progress TEXT NOT NULL,         -- encode_progress: the turn so far, how its worker calls ended
    updated REAL NOT NULL,
    PRIMARY KEY (session, key)
);
"""
_SCHEMA = (
    """
CREATE TABLE IF NOT EXISTS sessions (
    name TEXT PRIMARY KEY,
    state TEXT NOT NULL,            -- port.py encode_state: the turns (images by hash), tools, ...
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
    + _PROGRESS
    + _IMAGES
)


class SqliteStore:
    """The HistoryStore contract (port.py) on one SQLite connection. The service calls it from
    one thread (core/session_cache.py), which the connection allows (check_same_thread=False: it
    is opened on another); a call from elsewhere (a test reading what was stored, the close
    at the end) waits for the one under way, so a transaction is never interleaved with
    another call and the connection is not closed under a running statement."""

    shared = False
    waits = True  # for another connection's write lock (busy timeout)

    def __init__(self, state_dir: Path, *, open_locked_timeout: float = OPEN_LOCKED_TIMEOUT) -> None:
        self.path = state_dir / DATABASE_NAME
        self._in_use = threading.RLock()
        self._purge_due = False  # a reset or expiry in a batch: the WAL is emptied after its commit
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
            if not 0 <= version <= SCHEMA_VERSION:
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
            if version != SCHEMA_VERSION:  # a new or older database: writing takes the lock, so only then
                # Every table is "IF NOT EXISTS": an older database gets the tables it lacks, its
                # rows as they are (a state holding its images still reads: port.py
                # parse_state), all in one transaction with the new version.
                db.executescript(f"BEGIN IMMEDIATE; {_SCHEMA} PRAGMA user_version={SCHEMA_VERSION}; COMMIT;")
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
        with self._snapshot():  # one snapshot: the state and the images it refers to
            row = self._db.execute("SELECT state FROM sessions WHERE name = ?", (session,)).fetchone()
            answers = self._db.execute(
                "SELECT key, payload FROM answers WHERE session = ? ORDER BY created DESC LIMIT ?",
                (session, ANSWERED_KEYS_PER_SESSION),
            ).fetchall()
            if row is None and not answers:
                return None
            history = decode_history(
                session, row[0] if row else encode_state(SessionHistory()), list(reversed(answers))
            )
            missing = missing_images(history)
            if missing:
                for sha, media_type, data in self._db.execute(
                    "SELECT sha256, media_type, data FROM images WHERE session = ?", (session,)
                ):
                    if sha in missing:
                        history.images[sha] = StoredImage(bytes(data), media_type)
            return history

    @_guarded
    def save(self, session: str, history: SessionHistory, key: str, payload: bytes | None) -> bytes | None:
        now = time.time()
        with self._transaction():
            self._db.execute(
                "INSERT INTO sessions (name, state, updated) VALUES (?, ?, ?) "
                "ON CONFLICT (name) DO UPDATE SET state = excluded.state, updated = excluded.updated",
                (session, encode_state(history), now),
            )
            self._save_images(session, history)
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
            self._db.execute("DELETE FROM progress WHERE session = ? AND key = ?", (session, key))
        return None

    def _save_images(self, session: str, history: SessionHistory) -> None:
        """In the save's transaction: the images the state refers to that are not stored yet
        are written (once: a later save finds them), those it no longer refers to deleted."""
        stored = {row[0] for row in self._db.execute("SELECT sha256 FROM images WHERE session = ?", (session,))}
        new, gone = stored_images(history, stored)
        self._db.executemany(
            "INSERT OR IGNORE INTO images (session, sha256, media_type, data) VALUES (?, ?, ?, ?)",
            [(session, sha, image.media_type, image.data) for sha, image in new.items()],
        )
        self._db.executemany("DELETE FROM images WHERE session = ? AND sha256 = ?", [(session, sha) for sha in gone])

    @_guarded
    def reset(self, session: str) -> None:
        with self._transaction():
            self._db.execute("DELETE FROM sessions WHERE name = ?", (session,))
            self._db.execute("DELETE FROM images WHERE session = ?", (session,))
            self._db.execute("UPDATE answers SET payload = NULL WHERE session = ?", (session,))
            self._db.execute("DELETE FROM progress WHERE session = ?", (session,))
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
            self._db.execute(
                "DELETE FROM images WHERE session IN (SELECT name FROM sessions WHERE updated < ?)", (cutoff,)
            )
            self._db.execute("DELETE FROM sessions WHERE updated < ?", (cutoff,))
            self._db.execute(
                "DELETE FROM answers WHERE session IN "
                "(SELECT session FROM answers GROUP BY session HAVING max(created) < ?)",
                (cutoff,),
            )
            self._db.execute("DELETE FROM deliveries WHERE updated < ?", (cutoff,))
            self._db.execute("DELETE FROM progress WHERE updated < ?", (cutoff,))
        if names:
            self._purge_wal()
        return names

    @_guarded
    def save_progress(self, session: str, key: str, progress: str) -> None:
        self._db.execute(
            "INSERT INTO progress (session, key, progress, updated) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (session, key) DO UPDATE SET progress = excluded.progress, updated = excluded.updated",
            (session, key, progress, time.time()),
        )

    @_guarded
    def load_progress(self, session: str, key: str) -> str | None:
        row = self._db.execute("SELECT progress FROM progress WHERE session = ? AND key = ?", (session, key)).fetchone()
        return str(row[0]) if row else None

    def _purge_wal(self) -> None:
        """Copy the WAL into the database and empty it: its older frames still hold what was
        just deleted. A few milliseconds, on resets and expiries only. Within a batch
        (``run_batch``) once the batch is committed: a checkpoint cannot pass an open
        transaction."""
        if self._db.in_transaction:
            self._purge_due = True
            return
        self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def _transaction(self) -> _Transaction:
        return _Transaction(self._db, "BEGIN IMMEDIATE")

    def _snapshot(self) -> _Transaction:
        return _Transaction(self._db, "BEGIN")

    def run_batch(self, calls: Sequence[Callable[[], Any]]) -> list[tuple[Any, BaseException | None]]:
        """Group commit: the calls the store's thread took at once (core/session_cache.py) in one
        transaction, each in a savepoint of its own, so that one that fails is undone alone, as
        its own transaction would be; each call's (result, error), in order, once the whole is
        committed. A commit that fails fails every call that had succeeded, and none of them
        wrote anything: a caller learns of its write only once it is on disk, as before.

        Why: at the end of a burst every reply waits for its turn's commit (the answer is stored
        before it is published), one after another on this thread: 320 replies finishing at once
        on 2 cores waited 80 ms (p50) for their commit, 220-300 us each; in one transaction a
        commit cost 140-170 us (docs/performance.md, "The frontend in a process of its own").
        Where the write lock cannot be had (another connection holds it past the busy tries)
        the calls run one by one, each with its own tries."""
        with self._in_use:
            if not self._begin_batch():
                return [outcome(call) for call in calls]
            outcomes: list[tuple[Any, BaseException | None]] = []
            try:
                for call in calls:
                    self._db.execute("SAVEPOINT call")
                    result = outcome(call)
                    if result[1] is not None:
                        self._db.execute("ROLLBACK TO call")
                    self._db.execute("RELEASE call")
                    outcomes.append(result)
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
                self._purge_due = False  # nothing was deleted
                logger.error("Session database error committing {} calls at once: {}", len(calls), exc)
                failed = StoreUnavailable(f"the session store failed: {exc}")
                outcomes += [(None, None)] * (len(calls) - len(outcomes))
                return [(None, error or failed) for _, error in outcomes]
            if self._purge_due:
                self._purge_due = False
                try:
                    self._purge_wal()
                except sqlite3.Error as exc:  # committed: the deleted rows are gone, their old frames stay a while
                    logger.warning("Session database: the WAL was not emptied after a reset or expiry: {}", exc)
            return outcomes

    def _begin_batch(self) -> bool:
        for attempt in range(1, BUSY_TRIES + 1):
            try:
                self._db.execute("BEGIN IMMEDIATE")
                return True
            except sqlite3.Error as exc:
                if is_busy(exc) and attempt < BUSY_TRIES:
                    logger.warning("Session database is locked by another connection; retrying ({})", attempt)
                    continue
                logger.warning("Session database: no transaction for a batch ({}); its calls run one by one", exc)
                return False
        return False

    def close(self) -> None:
        with self._in_use:
            self._db.close()


class _Transaction:
    """A transaction of its own; within one already open (a batch: ``run_batch``) a savepoint,
    whose work the batch's commit makes durable."""

    def __init__(self, db: sqlite3.Connection, begin: str) -> None:
        self._db = db
        self._begin = begin
        self._nested = False

    def __enter__(self) -> None:
        self._nested = self._db.in_transaction
        self._db.execute("SAVEPOINT txn" if self._nested else self._begin)

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if not self._nested:
            self._db.execute("COMMIT" if exc_type is None else "ROLLBACK")
            return
        if exc_type is not None:
            self._db.execute("ROLLBACK TO txn")
        self._db.execute("RELEASE txn")
