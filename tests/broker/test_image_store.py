"""A session's images in every store (SQLite, Redis, memory): kept apart from the state by
(session, sha256), each written once by the save whose turns first refer to it, dropped with
the last turn that shows it and by a reset or an expiry, kept across a restart; states that
hold their images inline (an older worker's) still read. What each store holds is read past
the store (the SQLite file, the Redis keys), so a store that says it did is not taken at its
word."""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import sqlite3
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
import redis

from devtools.redis_server import RedisServer
from devtools.waiting import eventually
from worker.core.session_cache import SessionCache
from worker.session import (
    ImageRef,
    Progress,
    SessionHistory,
    StoredImage,
    ToolCall,
    ToolResultMessage,
    Turn,
    UserMessage,
    WorkerCallRecord,
    assistant_message,
)
from worker.store.memory import MemoryStore
from worker.store.port import HistoryStore, decode_progress, encode_progress
from worker.store.sqlite import DATABASE_NAME, SqliteStore

_prefixes = itertools.count()
MB = 1 << 20


# The tables of a schema-1 database (before tool calling), as an older worker made them.
SCHEMA_1_TABLES = (
    "CREATE TABLE sessions (name TEXT PRIMARY KEY, state TEXT NOT NULL, updated REAL NOT NULL);"
    "CREATE TABLE answers (session TEXT NOT NULL, key TEXT NOT NULL, payload BLOB, created REAL NOT NULL,"
    " PRIMARY KEY (session, key));"
    "CREATE TABLE deliveries (session TEXT NOT NULL, key TEXT NOT NULL, count INTEGER NOT NULL,"
    " updated REAL NOT NULL, PRIMARY KEY (session, key));"
)


def image(n: int, size: int = 64) -> tuple[ImageRef, StoredImage]:
    """An image's ref and bytes (not a decodable image: the stores keep bytes, never look)."""
    data = bytes([n]) * size
    return ImageRef(hashlib.sha256(data).hexdigest(), "image/png"), StoredImage(data, "image/png")


@dataclass
class Kind:
    """One store kind: a way to open it (again: a restart), and what it holds, read past it."""

    name: str
    open: Callable[[], HistoryStore]
    state_size: Callable[[str], int]  # bytes of the session's stored state (-1: none)
    images: Callable[[str], dict[str, bytes]]  # the session's stored images' bytes by hash
    restarts: bool = True  # a new store object finds what the last one stored
    redis_url: str = ""  # Redis's: its server and the test's key prefix
    prefix: str = ""


@pytest.fixture(params=["sqlite", "redis", "memory"])
def kind(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Kind]:
    if request.param == "sqlite":
        path = tmp_path / DATABASE_NAME

        def rows(sql: str, *args: object) -> list[Any]:
            with sqlite3.connect(path) as db:
                return db.execute(sql, args).fetchall()

        def sqlite_state(session: str) -> int:
            found = rows("SELECT length(CAST(state AS BLOB)) FROM sessions WHERE name = ?", session)
            return int(found[0][0]) if found else -1

        def sqlite_images(session: str) -> dict[str, bytes]:
            return {
                sha: bytes(data) for sha, data in rows("SELECT sha256, data FROM images WHERE session = ?", session)
            }

        yield Kind("sqlite", lambda: SqliteStore(tmp_path), sqlite_state, sqlite_images)
    elif request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        prefix = f"image-test-{next(_prefixes)}"
        raw = redis.Redis.from_url(server.url)

        def redis_state(session: str) -> int:
            return (
                int(raw.strlen(f"{prefix}:{{{session}}}:state")) if raw.exists(f"{prefix}:{{{session}}}:state") else -1
            )

        def redis_images(session: str) -> dict[str, bytes]:
            stored = cast(dict[bytes, bytes], raw.hgetall(f"{prefix}:{{{session}}}:images"))
            return {sha.decode(): value.partition(b"\n")[2] for sha, value in stored.items()}

        from worker.store.redis import RedisStore

        yield Kind(
            "redis",
            lambda: RedisStore(server.url, prefix, session_ttl=3600),
            redis_state,
            redis_images,
            redis_url=server.url,
            prefix=prefix,
        )
        raw.close()
    else:
        store = MemoryStore()

        def memory_images(session: str) -> dict[str, bytes]:
            return {sha: i.data for sha, i in store._images.get(session, {}).items()}

        yield Kind("memory", lambda: store, lambda s: 0 if s in store._sessions else -1, memory_images, False)


def turn(key: str, *refs: ImageRef) -> Turn:
    return Turn(key, [UserMessage(f"look {key}", refs), assistant_message(f"seen {key}")])


def history_of(turns: list[Turn], *images: tuple[ImageRef, StoredImage]) -> SessionHistory:
    return SessionHistory("be brief", turns, images={ref.sha256: stored for ref, stored in images})


def test_an_image_is_written_once_and_the_state_stays_small(kind: Kind) -> None:
    """Ten turns after one of 1 MB: the image is stored once, the state holds its hash, not
    its bytes (each save used to write the image again, inside the state)."""
    store = kind.open()
    cache = SessionCache(store, capacity=10)
    door = image(1, MB)
    history = cache.get("u/s")
    history.turns.append(turn("k0", door[0]))
    history.images[door[0].sha256] = door[1]
    cache.save("u/s", history, "k0", b"{}")
    if kind.name == "sqlite":  # every write of an image row from now on is counted
        with sqlite3.connect(Path(store.path)) as db:  # type: ignore[attr-defined]
            db.executescript(
                "CREATE TABLE writes (n INTEGER); INSERT INTO writes VALUES (0);"
                "CREATE TRIGGER w1 AFTER INSERT ON images BEGIN UPDATE writes SET n = n + 1; END;"
                "CREATE TRIGGER w2 AFTER UPDATE ON images BEGIN UPDATE writes SET n = n + 1; END;"
            )
    hsetnx = lambda: 0  # noqa: E731
    if kind.name == "redis":  # Redis counts the HSETNX calls its scripts make
        raw = redis.Redis.from_url(kind.redis_url)
        hsetnx = lambda: int(raw.info("commandstats").get("cmdstat_hsetnx", {}).get("calls", 0))  # noqa: E731
    before = hsetnx()
    assert kind.name != "redis" or before > 0  # the first save wrote it
    for k in range(1, 10):
        history = cache.get("u/s").draft()
        history.turns.append(turn(f"k{k}"))
        cache.save("u/s", history, f"k{k}", b"{}")
        assert 0 <= kind.state_size("u/s") < 10_000
    assert kind.images("u/s") == {door[0].sha256: door[1].data}
    assert hsetnx() == before
    if kind.name == "sqlite":
        with sqlite3.connect(Path(store.path)) as db:  # type: ignore[attr-defined]
            assert db.execute("SELECT n FROM writes").fetchone() == (0,)
    loaded = kind.open().load("u/s")
    assert loaded is not None and loaded.images == {door[0].sha256: door[1]} and len(loaded.turns) == 10


def test_trimming_drops_an_image_only_with_the_last_turn_that_shows_it(kind: Kind) -> None:
    store = kind.open()
    a, b = image(1), image(2)
    history = history_of([turn("k1", a[0]), turn("k2", a[0], b[0]), turn("k3")], a, b)
    store.save("u/s", history, "k3", b"{}")
    assert set(kind.images("u/s")) == {a[0].sha256, b[0].sha256}
    trimmed = history.draft()
    del trimmed.turns[0]  # k2 still shows a
    store.save("u/s", trimmed, "k4", b"{}")
    assert set(kind.images("u/s")) == {a[0].sha256, b[0].sha256}
    trimmed = trimmed.draft()
    del trimmed.turns[0]  # no kept turn shows a or b
    store.save("u/s", trimmed, "k5", b"{}")
    assert kind.images("u/s") == {}
    loaded = kind.open().load("u/s")
    assert loaded is not None and loaded.images == {} and [t.key for t in loaded.turns] == ["k3"]


def test_a_restart_keeps_the_images(kind: Kind) -> None:
    if not kind.restarts:
        pytest.skip("the memory store is gone with its process")
    a, b = image(1), image(2, 1000)
    kind.open().save("u/s", history_of([turn("k1", a[0], b[0]), turn("k2", a[0])], a, b), "k2", b"{}")
    loaded = kind.open().load("u/s")  # no close: a crashed worker never closes
    assert loaded is not None and loaded.images == {a[0].sha256: a[1], b[0].sha256: b[1]}
    assert kind.images("u/s") == {a[0].sha256: a[1].data, b[0].sha256: b[1].data} and kind.state_size("u/s") < 1000
    assert [ref.sha256 for ref in loaded.image_refs()] == [a[0].sha256, b[0].sha256, a[0].sha256]


def test_a_reset_drops_the_sessions_images_and_no_other_sessions(kind: Kind) -> None:
    """The same image in two sessions: each has its own; resetting one leaves the other's."""
    store = kind.open()
    cache = SessionCache(store, capacity=10)
    a = image(1)
    for name in ("u/one", "u/two"):
        cache.save(name, history_of([turn("k", a[0])], a), "k", b"{}")
    cache.reset("u/one")
    assert kind.images("u/one") == {} and kind.images("u/two") == {a[0].sha256: a[1].data}
    assert cache.get("u/one").images == {}
    other = kind.open().load("u/two")
    assert other is not None and other.images == {a[0].sha256: a[1]}
    # The reset session stores the image again when a turn shows it again.
    cache.save("u/one", history_of([turn("k2", a[0])], a), "k2", b"{}")
    assert kind.images("u/one") == {a[0].sha256: a[1].data}


def test_an_expired_session_takes_its_images(kind: Kind) -> None:
    if kind.name == "redis":
        pytest.skip("Redis expires a session's keys itself: test_redis_expires_the_images_with_the_session")
    store = kind.open()
    a = image(1)
    store.save("u/old", history_of([turn("k", a[0])], a), "k", b"{}")
    time.sleep(0.3)
    store.save("u/new", history_of([turn("k", a[0])], a), "k", b"{}")
    assert store.expire(0.2) == ["u/old"]
    assert kind.images("u/old") == {} and kind.images("u/new") == {a[0].sha256: a[1].data}


def test_redis_expires_the_images_with_the_session(redis_server: RedisServer) -> None:
    from worker.store.redis import RedisStore

    prefix = f"image-expiry-{next(_prefixes)}"
    store = RedisStore(redis_server.url, prefix, session_ttl=0.3)
    a = image(1)
    store.save("u/s", history_of([turn("k", a[0])], a), "k", b"{}")
    raw = redis.Redis.from_url(redis_server.url)
    assert raw.exists(f"{prefix}:{{u/s}}:images") and 0 < int(raw.pttl(f"{prefix}:{{u/s}}:images")) <= 300
    eventually(lambda: not raw.keys(f"{prefix}:*"), "the session's keys never expired", interval=0.1)
    raw.close()


def inline_state(history: SessionHistory) -> str:
    """A state as the worker stored it before images were kept apart: the images in it."""
    turns = [{"key": t.key, "messages": t.template_forms()} for t in history.turns]
    images = {
        sha: {"mediaType": i.media_type, "data": base64.b64encode(i.data).decode()} for sha, i in history.images.items()
    }
    return json.dumps({"systemPrompt": history.system_prompt, "turns": turns, "images": images})


def test_a_state_with_its_images_inline_still_loads_and_moves_them_out(kind: Kind, tmp_path: Path) -> None:
    if kind.name == "memory":
        pytest.skip("the memory store keeps objects, never a stored state")
    a, b = image(1), image(2)
    old = history_of([turn("k1", a[0]), turn("k2", b[0])], a, b)
    if kind.name == "sqlite":
        # A database of schema 2 (tool-loop progress, no images table) holding the old state.
        db = sqlite3.connect(tmp_path / DATABASE_NAME)
        db.executescript(
            SCHEMA_1_TABLES + "CREATE TABLE progress (session TEXT NOT NULL, key TEXT NOT NULL, progress TEXT NOT NULL,"
            " updated REAL NOT NULL, PRIMARY KEY (session, key));"
            "PRAGMA user_version=2;"
        )
        db.execute("INSERT INTO sessions VALUES (?, ?, ?)", ("u/s", inline_state(old), time.time()))
        db.execute("INSERT INTO answers VALUES (?, ?, ?, ?)", ("u/s", "k2", b'{"reply": "seen"}', time.time()))
        db.commit()
        db.close()
    else:
        raw = redis.Redis.from_url(kind.redis_url)
        raw.set(f"{kind.prefix}:{{u/s}}:state", inline_state(old))
        raw.close()
    store = kind.open()
    loaded = store.load("u/s")
    assert loaded is not None and loaded.turns == old.turns and loaded.images == old.images
    size = kind.state_size("u/s")
    loaded.turns.append(turn("k3"))
    store.save("u/s", loaded, "k3", b"{}")
    assert kind.state_size("u/s") < size  # the images left the state...
    assert kind.images("u/s") == {a[0].sha256: a[1].data, b[0].sha256: b[1].data}  # ...for the store's own
    again = kind.open().load("u/s")
    assert again is not None and again.images == old.images and len(again.turns) == 3


def test_an_older_database_is_migrated_in_place(tmp_path: Path) -> None:
    """A schema-1 database (before tool calling: turns of user and assistant text) opens as
    the current schema with its sessions, which take images from then on."""
    db = sqlite3.connect(tmp_path / DATABASE_NAME)
    db.executescript(SCHEMA_1_TABLES + "PRAGMA user_version=1;")
    state = {"systemPrompt": None, "turns": [{"key": "k1", "user": "hi", "assistant": "hello"}]}
    db.execute("INSERT INTO sessions VALUES (?, ?, ?)", ("u/s", json.dumps(state), time.time()))
    db.commit()
    db.close()
    store = SqliteStore(tmp_path)
    loaded = store.load("u/s")
    assert loaded is not None and loaded.turns == [Turn.plain("k1", "hi", "hello")] and loaded.images == {}
    a = image(1)
    loaded.turns.append(turn("k2", a[0]))
    loaded.images[a[0].sha256] = a[1]
    store.save("u/s", loaded, "k2", b"{}")
    with sqlite3.connect(tmp_path / DATABASE_NAME) as db:
        assert db.execute("PRAGMA user_version").fetchone() == (3,)
        assert db.execute("SELECT sha256 FROM images").fetchall() == [(a[0].sha256,)]
    again = SqliteStore(tmp_path).load("u/s")
    assert again is not None and again.images == {a[0].sha256: a[1]}


def test_the_first_stored_answer_stands_and_its_images_with_it(redis_server: RedisServer) -> None:
    """Two workers answered one request (one was taken for dead): the second's state and
    images are not written. And a worker whose session lost an image meanwhile (another
    worker's reset) sends its bytes again: the save never leaves a state naming an image the
    store does not hold."""
    from worker.store.redis import RedisStore

    prefix = f"image-first-{next(_prefixes)}"
    one, two = (RedisStore(redis_server.url, prefix, 3600) for _ in range(2))
    a, b = image(1), image(2)
    assert one.save("u/s", history_of([turn("k", a[0])], a), "k", b"first") is None
    assert two.save("u/s", history_of([turn("k", b[0])], b), "k", b"second") == b"first"
    loaded = two.load("u/s")
    assert loaded is not None and loaded.images == {a[0].sha256: a[1]}
    raw = redis.Redis.from_url(redis_server.url)
    images = f"{prefix}:{{u/s}}:images"
    assert raw.hkeys(images) == [a[0].sha256.encode()]
    one.reset("u/s")  # two still holds the session with a in memory
    assert not raw.exists(images)
    assert two.save("u/s", loaded, "k2", b"{}") is None
    assert raw.hkeys(images) == [a[0].sha256.encode()]
    again = one.load("u/s")
    assert again is not None and again.images == {a[0].sha256: a[1]}
    raw.close()


# -- a request's tool-loop progress (never actuate twice) --------------------------------


def progress_with_images() -> Progress:
    door, snap = image(1), image(2)
    call = assistant_message("", [ToolCall("call_1", "door_camera", {})])
    t = Turn(
        "k",
        [UserMessage("who is there?", (door[0],)), call, ToolResultMessage("call_1", "door_camera", "", (snap[0],))],
    )
    return Progress(t, {"call_1": WorkerCallRecord("ok", 12.5, 0)}, {door[0].sha256: door[1], snap[0].sha256: snap[1]})


def test_a_progress_with_images_round_trips_through_every_store(kind: Kind) -> None:
    store = kind.open()
    progress = progress_with_images()
    store.save_progress("u/s", "k", encode_progress(progress))
    text = kind.open().load_progress("u/s", "k")
    assert text is not None
    read = decode_progress("u/s", text)
    assert read.turn == progress.turn and read.images == progress.images and read.calls == progress.calls


@pytest.mark.parametrize("deletion", ["reset", "trim", "expiry"])
def test_a_deleted_images_bytes_are_gone_from_the_files(tmp_path: Path, deletion: str) -> None:
    """Not only from the table: SQLite's secure_delete zeroes the freed pages and a reset or an
    expiry empties the WAL, so a copy of the files holds no image a session no longer shows."""
    marker = b"image-marker-" * 400  # spans pages, as images do (overflow pages)
    ref = ImageRef(hashlib.sha256(marker).hexdigest(), "image/png")
    store = SqliteStore(tmp_path)
    store.save("u/s", history_of([turn("k1", ref), turn("k2")], (ref, StoredImage(marker, "image/png"))), "k2", b"{}")
    assert marker[:200] in b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.is_file())
    if deletion == "reset":
        store.reset("u/s")
    elif deletion == "trim":
        store.save("u/s", history_of([turn("k2")]), "k3", b"{}")
        store.save("u/other", history_of([turn("k")]), "k", b"{}")
        store.reset("u/other")  # a reset's checkpoint empties the WAL, which held the pages as they were
    else:
        time.sleep(0.3)
        assert store.expire(0.2) == ["u/s"]
    assert marker[:200] not in b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.is_file())
