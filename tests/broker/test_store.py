"""The session stores: SQLite (the default), memory and Redis, one contract; the in-memory
cache of live sessions over them."""

from __future__ import annotations

import itertools
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from worker.core.session_cache import SessionCache
from worker.session import ANSWERED_KEYS_PER_SESSION, ImageRef, SessionHistory, StoredImage, Turn, UserMessage
from worker.store import memory, sqlite
from worker.store.memory import MemoryStore
from worker.store.port import HistoryStore, StoreUnavailable
from worker.store.sqlite import DATABASE_NAME, SqliteStore

Factory = Callable[[Path], HistoryStore]
STORES: dict[str, Factory] = {"sqlite": SqliteStore, "memory": lambda _: MemoryStore()}


@pytest.fixture(params=[*sorted(STORES), "redis"])
def make_store(request: pytest.FixtureRequest) -> Factory:
    """Each store; Redis's (shared by a group's workers) on the tests' redis-server, under a
    key prefix of its own per test."""
    if request.param == "redis":
        from worker.store.redis import RedisStore

        server = request.getfixturevalue("redis_server")
        prefix = f"store-test-{next(_prefixes)}"
        return lambda _: RedisStore(server.url, prefix, session_ttl=3600)
    return STORES[request.param]


_prefixes = itertools.count()


def two_turns() -> SessionHistory:
    return SessionHistory("be brief", [Turn.plain("k1", "hi", "hello"), Turn.plain("k2", "and?", "that's all")])


def test_a_session_round_trips_with_its_answers(make_store: Factory, tmp_path: Path) -> None:
    store = make_store(tmp_path)
    assert store.load("u/s") is None
    cache = SessionCache(store, capacity=10)
    history = cache.get("u/s")
    history.system_prompt = "be brief"
    history.turns.extend(two_turns().turns)
    cache.save("u/s", history, "k2", b'{"reply": "that\'s all"}')
    loaded = store.load("u/s")
    assert loaded is not None
    assert loaded.system_prompt == "be brief" and loaded.turns == two_turns().turns
    assert loaded.answered == {"k2": b'{"reply": "that\'s all"}'}


def with_images() -> SessionHistory:
    """Two turns showing one image twice and another once: each image's bytes once."""
    history = two_turns()
    door, yard = ImageRef("d" * 64, "image/jpeg"), ImageRef("y" * 64, "image/png", 5)
    history.turns.append(Turn("k3", [UserMessage("door? yard?", (door, yard))]))
    history.turns[-1].messages.append(two_turns().turns[0].messages[1])
    history.turns.append(Turn.plain("k4", "and now?", "same"))
    history.turns[-1].messages[0] = UserMessage("and now?", (door,))
    history.images = {
        door.sha256: StoredImage(b"\xff\xd8\xffjpeg", "image/jpeg"),
        yard.sha256: StoredImage(b"png", "image/png"),
    }
    return history


def test_images_are_stored_with_their_turns_once_each_and_a_reset_deletes_them(
    make_store: Factory, tmp_path: Path
) -> None:
    store = make_store(tmp_path)
    cache = SessionCache(store, capacity=10)
    history = cache.get("u/s")
    saved = with_images()
    history.turns, history.images = saved.turns, saved.images
    cache.save("u/s", history, "k4", b"{}")
    loaded = make_store(tmp_path).load("u/s") if isinstance(store, SqliteStore) else store.load("u/s")
    assert loaded is not None and loaded.turns == saved.turns
    assert [ref.sha256 for ref in loaded.image_refs()] == ["d" * 64, "y" * 64, "d" * 64]
    assert {sha: image.data for sha, image in loaded.images.items()} == {
        "d" * 64: b"\xff\xd8\xffjpeg",
        "y" * 64: b"png",
    }
    cache.reset("u/s")
    for after in (cache.get("u/s"), store.load("u/s")):
        assert after is not None and after.images == {} and after.turns == []


def test_sqlite_keeps_what_was_committed_across_a_reopen(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path)
    store.save("u/s", two_turns(), "k2", b"{}")
    # No close(): a crashed worker never closes; a committed transaction is in the WAL.
    reopened = SqliteStore(tmp_path)
    loaded = reopened.load("u/s")
    assert loaded is not None and loaded.turns == two_turns().turns and "k2" in loaded.answered
    assert (tmp_path / f"{DATABASE_NAME}-wal").exists()  # WAL mode


def test_reset_deletes_the_text_and_keeps_the_keys(make_store: Factory, tmp_path: Path) -> None:
    store = make_store(tmp_path)
    cache = SessionCache(store, capacity=10)
    history = cache.get("u/s")
    history.turns.extend(two_turns().turns)
    cache.save("u/s", history, "k2", b'{"reply": "secret"}')
    cache.reset("u/s")
    for loaded in (cache.get("u/s"), store.load("u/s")):
        assert loaded is not None and loaded.turns == [] and loaded.system_prompt is None
        assert loaded.answered == {"k2": None}  # a tombstone: recognised, nothing to resend


def test_only_the_newest_answers_are_kept(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path)
    history = SessionHistory()
    for i in range(ANSWERED_KEYS_PER_SESSION + 5):
        store.save("u/s", history, f"k{i}", b"{}")
    loaded = store.load("u/s")
    assert loaded is not None and len(loaded.answered) == ANSWERED_KEYS_PER_SESSION
    assert "k0" not in loaded.answered and f"k{ANSWERED_KEYS_PER_SESSION + 4}" in loaded.answered


def test_deliveries_are_counted_until_answered(make_store: Factory, tmp_path: Path) -> None:
    store = make_store(tmp_path)
    assert [store.count_delivery("u/s", "k") for _ in range(3)] == [1, 2, 3]
    store.uncount_delivery("u/s", "k")  # a graceful stop is not the request's fault
    assert store.count_delivery("u/s", "k") == 3
    assert store.count_delivery("u/other", "k") == 1  # per session
    store.save("u/s", SessionHistory(), "k", b"{}")  # answered: the count starts over
    assert store.count_delivery("u/s", "k") == 1


class Clock:
    """The wall clock of the SQLite and memory stores (their ``time`` module), moved by the
    test: an idle time that no load on the machine stretches or shortens."""

    def __init__(self) -> None:
        self.now = time.time()

    def time(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    for module in (memory, sqlite):
        monkeypatch.setattr(module, "time", clock)
    return clock


@pytest.mark.parametrize("kind", sorted(STORES))  # Redis expires keys itself: test_redisstore.py
def test_idle_sessions_expire(kind: str, tmp_path: Path, clock: Clock) -> None:
    store = STORES[kind](tmp_path)
    cache = SessionCache(store, capacity=10)
    cache.save("u/old", two_turns(), "k1", b"{}")
    clock.now += 0.3
    cache.save("u/new", two_turns(), "k1", b"{}")
    clock.now += 0.1  # idle 0.4 s and 0.1 s
    assert cache.expire(0.2) == 1
    assert store.load("u/old") is None and store.load("u/new") is not None
    assert cache.get("u/old").turns == []  # gone from memory too


def file_bytes(directory: Path) -> bytes:
    """Everything in the store's files (database, WAL, shared memory), as bytes."""
    return b"".join(path.read_bytes() for path in sorted(directory.iterdir()) if path.is_file())


@pytest.mark.parametrize("deletion", ["reset", "expiry"])
def test_deleted_text_is_gone_from_the_files(tmp_path: Path, deletion: str, clock: Clock) -> None:
    """Not only from the tables: SQLite leaves deleted rows in free pages and the WAL keeps
    the pages as they were, so a copy of the files would still hold the conversation."""
    store = SqliteStore(tmp_path)
    cache = SessionCache(store, capacity=10)
    markers = [b"system-marker", b"user-marker", b"assistant-marker", b"answer-marker"]
    history = SessionHistory("system-marker", [Turn.plain("k1", "user-marker", "assistant-marker")])
    cache.save("u/s", history, "k1", b'{"reply": "answer-marker"}')
    history.turns.append(Turn.plain("k2", "user-marker 2", "assistant-marker 2"))  # an older state to delete too
    cache.save("u/s", history, "k2", b'{"reply": "answer-marker 2"}')
    assert all(marker in file_bytes(tmp_path) for marker in markers)
    if deletion == "reset":
        cache.reset("u/s")
    else:
        clock.now += 0.3
    cache.save("u/other", SessionHistory(None, [Turn.plain("k", "kept-marker", "x")]), "k", b"{}")
    clock.now += 0.1
    if deletion == "expiry":
        assert cache.expire(0.2) == 1
    data = file_bytes(tmp_path)
    assert [marker for marker in markers if marker in data] == []
    assert b"kept-marker" in data  # the other session is untouched


def test_the_cache_drops_the_least_recently_used_and_reloads_it_from_the_store(tmp_path: Path) -> None:
    cache = SessionCache(SqliteStore(tmp_path), capacity=2)
    a = cache.get("a")
    a.turns.append(Turn.plain("k", "hi", "hello"))
    cache.save("a", a, "k", b"{}")
    cache.get("b")
    cache.get("c")  # a is dropped from memory
    assert len(cache) == 2
    again = cache.get("a")
    assert again is not a and again.turns == a.turns


def test_a_turn_finished_after_its_session_left_memory_is_not_lost(tmp_path: Path) -> None:
    cache = SessionCache(SqliteStore(tmp_path), capacity=1)
    history = cache.get("a")
    cache.get("b")  # "a" is dropped from memory while its turn runs
    history.turns.append(Turn.plain("k", "hi", "hello"))
    cache.save("a", history, "k", b"{}")
    assert len(cache) == 1  # back in memory, "b" out: never more than capacity
    assert cache.get("a").turns == [Turn.plain("k", "hi", "hello")]


def test_a_newer_workers_database_is_refused_and_kept(tmp_path: Path) -> None:
    path = tmp_path / DATABASE_NAME
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version=99")
    db.close()
    before = path.read_bytes()
    with pytest.raises(StoreUnavailable, match="schema version 99"):
        SqliteStore(tmp_path)
    assert path.read_bytes() == before and not [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]


def test_a_corrupt_database_is_moved_aside(tmp_path: Path) -> None:
    (tmp_path / DATABASE_NAME).write_bytes(b"this is not a database" * 100)
    store = SqliteStore(tmp_path)  # no exception: a worker that cannot start would loop
    store.save("u/s", two_turns(), "k", b"{}")
    assert store.load("u/s") is not None
    aside = [p.name for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert aside and aside[0].startswith(f"{DATABASE_NAME}.corrupt-")


# -- several calls in one transaction (SqliteStore.run_batch) ----------------------------


def test_a_batch_commits_every_call_and_undoes_a_failed_one_alone(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path)

    def half_written() -> None:  # writes, then fails: its write must not stay
        store.count_delivery("u/broken", "k")
        raise RuntimeError("a call that fails after writing")

    history = SessionHistory(None, [Turn.plain("k1", "hi", "hello")])
    outcomes = store.run_batch(
        [
            lambda: store.count_delivery("u/a", "k1"),
            lambda: store.save("u/a", history, "k1", b'{"reply": "hello"}'),
            half_written,
            lambda: store.count_delivery("u/b", "k2"),
            lambda: store.load("u/a"),  # sees what the batch wrote before it
        ]
    )
    assert [error is None for _, error in outcomes] == [True, True, False, True, True]
    assert isinstance(outcomes[2][1], RuntimeError)
    assert outcomes[0][0] == 1 and outcomes[3][0] == 1
    loaded = outcomes[4][0]
    assert loaded is not None and loaded.turns == history.turns
    store.close()
    again = SqliteStore(tmp_path)  # what is on disk
    assert again.count_delivery("u/broken", "k") == 1  # the failed call's count was undone
    assert again.count_delivery("u/a", "k1") == 1  # the save deleted its delivery count
    assert again.count_delivery("u/b", "k2") == 2
    stored = again.load("u/a")
    assert stored is not None and stored.turns == history.turns
    again.close()


def test_a_batch_that_the_disk_refuses_fails_its_calls_and_writes_nothing_half(tmp_path: Path) -> None:
    """Whatever SQLite does on a full database (the statement or the whole transaction rolled
    back), every call either succeeded and is on disk, or failed with StoreUnavailable and
    left nothing."""
    store = SqliteStore(tmp_path)
    store.count_delivery("u/x", "warm-up")
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    store._db.execute(f"PRAGMA max_page_count = {pages}")
    big = SessionHistory(None, [Turn.plain("k", "x" * 200_000, "y")])
    names = ["u/a", "u/b", "u/c"]
    outcomes = store.run_batch(
        [
            lambda: store.count_delivery("u/a", "k"),
            lambda: store.save("u/b", big, "k", b"{}"),  # does not fit
            lambda: store.count_delivery("u/c", "k"),
        ]
    )
    assert isinstance(outcomes[1][1], StoreUnavailable)
    store._db.execute("PRAGMA max_page_count = 1073741823")
    for name, (_, error) in zip(names, outcomes, strict=True):
        if error is None:
            assert store.count_delivery(name, "k") == 2, name  # counted once by the batch
        else:
            assert isinstance(error, StoreUnavailable)
            assert store.count_delivery(name, "k") == 1, name  # nothing of the failed call
    assert store.load("u/b") is None
    store.close()


def test_a_reset_in_a_batch_still_empties_the_wal(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path)
    cache = SessionCache(store, capacity=10)
    cache.save("u/s", SessionHistory("system-marker", [Turn.plain("k1", "user-marker", "a")]), "k1", b"{}")
    outcomes = store.run_batch([lambda: store.reset("u/s"), lambda: store.count_delivery("u/t", "k")])
    assert [error for _, error in outcomes] == [None, None]
    data = file_bytes(tmp_path)
    assert b"user-marker" not in data and b"system-marker" not in data
    store.close()


def test_a_batch_waits_for_another_connections_lock(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path)
    other = sqlite3.connect(tmp_path / DATABASE_NAME, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")  # holds the write lock, as a backup or a shell might
    released = threading.Timer(1.3, lambda: other.execute("COMMIT"))
    released.start()
    try:
        outcomes = store.run_batch([lambda: store.count_delivery("u/a", "k"), lambda: store.count_delivery("u/a", "k")])
    finally:
        released.join()
        other.close()
    assert outcomes == [(1, None), (2, None)]
    store.close()
