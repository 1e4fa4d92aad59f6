"""Fault injection at the service, on the real SQLite store: every request sent gets exactly
one answer on its reply topic, or stays unacknowledged (and is answered once when it comes
again after the fault), and afterwards each session's stored history is exactly its answered
turns. Faults: refusals of every kind, a store locked (at start and while running), a damaged
session row, a full disk and a read-only state directory (a real small tmpfs where this
machine lets the tests mount one, and always a store that fails on demand), publishes refused
or not sent, and an unexpected exception at each stage of handling a request.

The broker's side of the same promises (restarts, freezes, kills, redelivery) is in
test_broker_faults.py and test_reliability.py; retained requests and the logs in
test_delivery_rules.py (on a real mosquitto)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import sqlite3
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import worker.core.service
import worker.store.sqlite
from devtools.fakes import Harness, MemoryTransport
from worker.engine.port import EngineError
from worker.session import SessionHistory
from worker.store.port import StoreUnavailable
from worker.store.sqlite import DATABASE_NAME, SqliteStore
from worker.transport.port import InboundMessage, PublishNotSent, PublishRefused

TOPIC = "chat/u/s1/request"


def request(request_id: str, message: str = "hello there", **fields: Any) -> dict[str, Any]:
    return {"message": message, "requestId": request_id, "maxTokens": 3, **fields}


def replies_by_id(transport: MemoryTransport, session: str = "s1") -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for reply in transport.replies(session):
        out.setdefault(reply.get("requestId", ""), []).append(reply)
    return out


def stored_keys(store: SqliteStore, name: str = "u/s1") -> list[str]:
    history = store.load(name)
    return [turn.key for turn in history.turns] if history else []


def answered_turns(transport: MemoryTransport, session: str = "s1") -> list[str]:
    """The requests answered with a generated reply (not an error, not cancelled), in order."""
    return [
        r["requestId"]
        for r in transport.replies(session)
        if "reply" in r and r.get("finishReason") != "cancelled" and "action" not in r
    ]


def check_promise(h: Harness, store: SqliteStore, sent: list[str], session: str = "s1") -> None:
    """Exactly one answer per request sent, and the stored turns are the answered ones."""
    answers = replies_by_id(h.transport, session)
    assert {key: len(answers.get(key, [])) for key in sent} == dict.fromkeys(sent, 1), answers
    assert stored_keys(store, f"u/{session}") == answered_turns(h.transport, session)


def run(scenario: Callable[[], Any]) -> None:
    asyncio.run(scenario())


# -- every refusal leaves the session as it was ------------------------------------------


def session_bytes(path: Path, name: str = "u/s1") -> tuple[Any, ...]:
    """The session's rows as stored: its state, and its answers."""
    with contextlib.closing(sqlite3.connect(path / DATABASE_NAME)) as db:
        state = db.execute("SELECT state FROM sessions WHERE name = ?", (name,)).fetchall()
        answers = db.execute("SELECT key, payload FROM answers WHERE session = ? ORDER BY key", (name,)).fetchall()
    return tuple(state), tuple(answers)


def memory_state(h: Harness, name: str = "u/s1") -> Any:
    history = h.service.sessions.get(name)
    return copy.deepcopy((history.system_prompt, history.turns, dict(history.answered)))


def expired_copy(h: Harness, payload: dict[str, Any]) -> None:
    """A request whose MQTT Message Expiry has passed by the time its turn comes."""
    h.transport.inbox.put_nowait(
        InboundMessage(TOPIC, json.dumps(payload).encode(), 1, 900, False, None, None, time.monotonic(), 0.0)
    )


REFUSALS: dict[str, tuple[dict[str, Any], Callable[[Harness], None]]] = {
    # The reported case: a prompt that cannot fit, with a new system prompt; the trimming
    # and the system prompt it tried must not be kept.
    "too_long": (
        {"limits": {"max_message_tokens": 8000}},
        lambda h: h.transport.deliver(
            TOPIC, request("refused", " ".join(["word"] * 3500), maxTokens=1000, systemPrompt="X")
        ),
    ),
    "invalid_request": ({}, lambda h: h.transport.deliver(TOPIC, {**request("refused"), "maxTokenz": 3})),
    "bad_json": ({}, lambda h: h.transport.deliver(TOPIC, b"{not json")),
    "too_large": (
        {"limits": {"max_payload_bytes": 200}},
        lambda h: h.transport.deliver(TOPIC, request("refused", "x" * 300)),
    ),
    "busy": (
        {"limits": {"max_queued_per_session": 1}},
        lambda h: [h.transport.deliver(TOPIC, request(f"q{i}", maxTokens=30)) for i in range(3)],
    ),
    "expired": ({}, lambda h: expired_copy(h, request("refused", systemPrompt="Y"))),
    "rate_limited": (
        {"limits": {"max_requests_per_user_per_minute": 3}},
        lambda h: h.transport.deliver(TOPIC, request("refused", systemPrompt="Y")),
    ),
    "engine_error": (
        {},
        lambda h: (
            h.engine.fail.update({"refused": EngineError("boom")}),
            h.transport.deliver(TOPIC, request("refused", systemPrompt="Y")),
        ),
    ),
    "cancelled": (
        {},
        lambda h: (
            h.transport.deliver(TOPIC, request("refused", systemPrompt="Y", maxTokens=30)),
            h.transport.deliver("chat/u/s1/control", {"action": "cancel", "requestId": "refused"}),
        ),
    ),
    "invalid_schema": (
        {},
        lambda h: h.transport.deliver(
            TOPIC,
            request(
                "refused",
                systemPrompt="Y",
                responseFormat={"type": "json_schema", "schema": {"$ref": "https://example.com/s.json"}},
            ),
        ),
    ),
    "store_unavailable": ({}, lambda h: fail_store_writes(h)),
}


def fail_store_writes(h: Harness) -> None:
    store = h.service.sessions.store
    assert isinstance(store, FaultyStore)
    store.fail_saves = sqlite3.OperationalError("database or disk is full")
    h.transport.deliver(TOPIC, request("refused", systemPrompt="Y"))


class FaultyStore(SqliteStore):
    """The real SQLite store whose saves fail on demand with what SQLite raises (for faults a
    test cannot cause for real on every machine)."""

    fail_saves: Exception | None = None
    fail_counts: Exception | None = None

    def _save_or_fail(self, *args: Any) -> Any:
        if self.fail_saves is not None:
            raise self.fail_saves
        return SqliteStore.save.__wrapped__(self, *args)  # type: ignore[attr-defined]

    def _count_or_fail(self, *args: Any) -> Any:
        if self.fail_counts is not None:
            raise self.fail_counts
        return SqliteStore.count_delivery.__wrapped__(self, *args)  # type: ignore[attr-defined]

    save = worker.store.sqlite._guarded(_save_or_fail)  # type: ignore[assignment]
    count_delivery = worker.store.sqlite._guarded(_count_or_fail)  # type: ignore[assignment]


@pytest.mark.parametrize("code", list(REFUSALS))
def test_a_refused_request_leaves_the_session_byte_for_byte_as_it_was(tmp_path: Path, code: str) -> None:
    sections, refuse = REFUSALS[code]

    async def scenario() -> None:
        store = FaultyStore(tmp_path)
        h = Harness(store=store, **sections.get("limits", {}))
        for turn in range(3):
            h.transport.deliver(TOPIC, request(f"t{turn}", f"turn {turn} of the conversation", systemPrompt="S"))
        await h.run_until(lambda: len(h.transport.acked) == 3)
        before, in_memory = session_bytes(tmp_path), memory_state(h)
        refuse(h)
        wanted = "cancelled" if code == "cancelled" else code

        def refused() -> bool:
            return any(
                r.get("error", {}).get("code") == wanted or r.get("finishReason") == wanted
                for r in h.transport.replies("s1")[3:]
            )

        await h.run_until(lambda: refused() and h.service.pending == 0)
        if code == "busy":  # the queued ones that were accepted ran: compare with them removed
            return check_busy(h, store)
        assert session_bytes(tmp_path) == before
        assert memory_state(h) == in_memory
        if code == "rate_limited":
            return
        store.fail_saves = None
        # And the session goes on from there: the next turn sees the three turns.
        h.transport.deliver(TOPIC, request("next"))
        await h.run_until(lambda: "next" in replies_by_id(h.transport))
        assert stored_keys(store) == ["t0", "t1", "t2", "next"]
        assert h.service.sessions.get("u/s1").system_prompt == "S"

    run(scenario)


def check_busy(h: Harness, store: SqliteStore) -> None:
    answers = replies_by_id(h.transport)
    refused = [key for key, replies in answers.items() if replies[0].get("error", {}).get("code") == "busy"]
    assert refused and all(key not in stored_keys(store) for key in refused)
    assert stored_keys(store) == answered_turns(h.transport)


# -- a store locked by another connection -------------------------------------------------


@contextlib.contextmanager
def locked(path: Path, seconds: float | None = None) -> Iterator[threading.Event]:
    """Another connection holding a write transaction on the database (an operator's sqlite3
    shell, a backup), released after ``seconds`` or when the block ends."""
    release = threading.Event()
    held = threading.Event()

    def hold() -> None:
        db = sqlite3.connect(path / DATABASE_NAME, isolation_level=None)
        db.execute("BEGIN EXCLUSIVE")
        held.set()
        release.wait(seconds)
        db.execute("ROLLBACK")
        db.close()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    held.wait(10)
    try:
        yield release
    finally:
        release.set()
        thread.join(10)


def test_a_store_locked_at_start_is_waited_for_and_never_moved_aside(tmp_path: Path) -> None:
    first = SqliteStore(tmp_path)
    first.save("u/s1", SessionHistory(), "k", b"{}")
    first.close()
    with locked(tmp_path, seconds=2.5):
        store = SqliteStore(tmp_path)  # waits (with a log) for the lock, or needs no write
        store.count_delivery("u/s1", "k2")  # a write: waits for the lock's release
    assert store.load("u/s1") is not None and store.load("u/s1").answered == {"k": b"{}"}  # type: ignore[union-attr]
    assert not [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]


def test_a_store_locked_longer_than_its_busy_timeout_answers_store_unavailable_then_recovers(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = SqliteStore(tmp_path)
        h = Harness(store=store)
        h.transport.deliver(TOPIC, request("before"))
        await h.run_until(lambda: h.transport.acked)
        with locked(tmp_path):
            h.transport.deliver(TOPIC, request("during"))
            await h.run_until(lambda: "during" in replies_by_id(h.transport))
        h.transport.deliver(TOPIC, request("after"))
        await h.run_until(lambda: "after" in replies_by_id(h.transport))
        assert replies_by_id(h.transport)["during"][0]["error"]["code"] == "store_unavailable"
        check_promise(h, store, ["before", "during", "after"])
        assert stored_keys(store) == ["before", "after"]

    run(scenario)


# -- one damaged session row --------------------------------------------------------------


def test_a_damaged_session_row_is_answered_and_counted_and_its_reset_works(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = SqliteStore(tmp_path)
        h = Harness(store=store)
        h.transport.deliver(TOPIC, request("a1"))
        h.transport.deliver("chat/u/s2/request", request("b1"))
        await h.run_until(lambda: len(h.transport.acked) == 2)
        with contextlib.closing(sqlite3.connect(tmp_path / DATABASE_NAME)) as db:
            db.execute('UPDATE sessions SET state = \'{"systemPrompt": null, "turns": [{"key"\' WHERE name = \'u/s1\'')
            db.commit()
        # A new worker process on that database.
        h = Harness(store=SqliteStore(tmp_path))
        h.transport.deliver(TOPIC, request("a2"))
        h.transport.deliver("chat/u/s2/request", request("b2"))
        await h.run_until(lambda: len(h.transport.acked) == 2)
        (refused,) = h.transport.replies("s1")
        assert refused["error"]["code"] == "session_unreadable" and refused["requestId"] == "a2"
        assert "reply" in h.transport.replies("s2")[0]  # the other session is unaffected
        assert h.service.stats.errors_by_code["session_unreadable"] == 1
        h.transport.deliver("chat/u/s1/control", {"action": "reset"})
        h.transport.deliver(TOPIC, request("a3"))
        await h.run_until(lambda: len(h.transport.acked) == 4)
        _, reset, fresh = h.transport.replies("s1")
        assert reset["action"] == "reset" and fresh["requestId"] == "a3" and "reply" in fresh

    run(scenario)


# -- a full disk, a read-only state directory ----------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path | None]:
    """A 2 MiB tmpfs of the test's own (None where this machine does not let it mount one)."""
    where = tmp_path / "tmpfs"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        yield None
        return
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(directory: Path) -> Path:
    """Fill the file system until a write fails; the filler file, to delete."""
    filler = directory / "filler"
    with open(filler, "wb") as out, contextlib.suppress(OSError):
        while True:
            out.write(b"\0" * 65536)
            out.flush()
    return filler


@pytest.mark.parametrize(
    ("fault", "how"), [("full disk", "tmpfs"), ("full disk", "on demand"), ("read-only", "on demand")]
)
def test_a_full_or_read_only_store_answers_store_unavailable_and_recovers(
    tmp_path: Path, small_tmpfs: Path | None, fault: str, how: str
) -> None:
    if how == "tmpfs" and small_tmpfs is None:
        pytest.skip("this machine does not let the tests mount a tmpfs; the on-demand case covers it")
    directory = small_tmpfs if how == "tmpfs" else tmp_path
    assert directory is not None

    async def scenario() -> None:
        store = FaultyStore(directory)
        h = Harness(store=store)
        h.transport.deliver(TOPIC, request("before"))
        await h.run_until(lambda: h.transport.acked)
        undo: Callable[[], None]
        if how == "on demand":
            text = "database or disk is full" if fault == "full disk" else "attempt to write a readonly database"
            store.fail_counts = store.fail_saves = sqlite3.OperationalError(text)

            def undo() -> None:
                store.fail_counts = store.fail_saves = None
        else:
            filler = fill(directory)
            undo = filler.unlink

        for i in range(3):
            h.transport.deliver(TOPIC, request(f"during{i}", f"question {i} " * 50))
        await h.run_until(lambda: len(h.transport.acked) == 4)
        undo()
        h.transport.deliver(TOPIC, request("after"))
        await h.run_until(lambda: "after" in replies_by_id(h.transport))
        answers = replies_by_id(h.transport)
        assert {answers[f"during{i}"][0]["error"]["code"] for i in range(3)} == {"store_unavailable"}
        check_promise(h, store, ["before", "during0", "during1", "during2", "after"])
        assert stored_keys(store) == ["before", "after"]
        store.close()

    run(scenario)


# -- publishes the broker did not take ---------------------------------------------------------


class FailingPublishes(MemoryTransport):
    """Publishes fail with ``failure`` while it is set."""

    def __init__(self) -> None:
        super().__init__()
        self.failure: Exception | None = None

    def publish(self, topic: str, payload: bytes, **kwargs: Any) -> asyncio.Future[None]:
        if self.failure is None:
            return super().publish(topic, payload, **kwargs)
        failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        failed.set_exception(self.failure)
        return failed


def test_an_answer_not_sent_leaves_its_request_unacknowledged_and_its_redelivery_is_answered_once(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        store = SqliteStore(tmp_path)
        h = Harness(store=store)
        h.transport = h.service.transport = h.service.turns.publisher = FailingPublishes()  # type: ignore[assignment]
        h.transport.failure = PublishNotSent("no connection")  # type: ignore[attr-defined]
        mid = h.transport.deliver(TOPIC, request("r1"))
        await h.run_until(lambda: stored_keys(store) == ["r1"] and not h.service._tasks)  # and done with it
        assert h.transport.acked == []  # answered and stored, but the broker has not got it
        h.transport.failure = None  # type: ignore[attr-defined]
        h.transport.deliver(TOPIC, request("r1"), mid=mid, dup=True)  # the broker delivers it again
        await h.run_until(lambda: h.transport.acked == [mid])
        assert len(h.engine.started) == 1 and len(h.transport.replies("s1")) == 1
        check_promise(h, store, ["r1"])

    run(scenario)


def test_an_answer_the_broker_refuses_is_final(tmp_path: Path) -> None:
    async def scenario() -> None:
        h = Harness(store=SqliteStore(tmp_path))
        h.transport = h.service.transport = h.service.turns.publisher = FailingPublishes()  # type: ignore[assignment]
        h.transport.failure = PublishRefused("not authorized")  # type: ignore[attr-defined]
        mid = h.transport.deliver(TOPIC, request("r1"))
        await h.run_until(lambda: h.transport.acked == [mid])  # it would be refused again

    run(scenario)


# -- an unexpected exception at each stage ---------------------------------------------------


class Boom(RuntimeError):
    pass


def boom(*args: Any, **kwargs: Any) -> Any:
    raise Boom("injected")


STAGES: dict[str, Callable[[Harness, pytest.MonkeyPatch], None]] = {
    "parsing": lambda h, mp: mp.setattr(worker.core.service, "parse_chat_request", boom),
    "admission": lambda h, mp: mp.setattr(h.service, "_admit", boom),
    "counting the delivery": lambda h, mp: mp.setattr(h.service.sessions.store, "count_delivery", boom),
    "rendering the prompt": lambda h, mp: mp.setattr(h.service.turns.renderer, "render", boom),
    "generating": lambda h, mp: h.engine.fail.update({"r2": Boom("in the engine")}),
    "committing the turn": lambda h, mp: mp.setattr(h.service.sessions.store, "save", boom),
    "building the reply": lambda h, mp: mp.setattr(h.service.turns, "reply", boom),
}


@pytest.mark.parametrize("stage", list(STAGES))
def test_an_exception_at_any_stage_is_answered_or_left_unacknowledged_never_dropped(
    tmp_path: Path, stage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        store = SqliteStore(tmp_path)
        h = Harness(store=store)
        h.transport.deliver(TOPIC, request("r1"))
        await h.run_until(lambda: h.transport.acked)
        with monkeypatch.context() as mp:
            STAGES[stage](h, mp)
            second = h.transport.deliver(TOPIC, request("r2"))
            # Handed in (the inbox empty: dispatched), and everything it started has ended.
            await h.run_until(lambda: h.transport.inbox.empty() and not h.service._tasks)
            for _ in range(20):  # and the callbacks they left: loop turns, not time
                await asyncio.sleep(0)
        answers = replies_by_id(h.transport).get("r2", [])
        if answers:  # answered with an error, then acknowledged
            assert [a["error"]["code"] for a in answers] == ["internal_error"], answers
            assert second in h.transport.acked
        else:  # left for the broker to deliver again
            assert second not in h.transport.acked
        h.transport.deliver(TOPIC, request("r3"))  # the worker goes on
        await h.run_until(lambda: "r3" in replies_by_id(h.transport))
        assert stored_keys(store) == answered_turns(h.transport) == ["r1", "r3"]

    run(scenario)


def test_the_store_errors_are_typed(tmp_path: Path) -> None:
    store = FaultyStore(tmp_path)
    store.fail_saves = sqlite3.OperationalError("database or disk is full")
    with pytest.raises(StoreUnavailable):
        store.save("u/s", SessionHistory(), "k", b"{}")


def test_a_read_only_state_directory_at_start_is_a_clear_error_and_keeps_the_database(
    small_tmpfs: Path | None,
) -> None:
    """Read-only from the start (a mount gone read-only after an error, say): the worker
    cannot serve without its store, so it says why and does not start (its database is
    left as it is). Read-only while running is the on-demand case above (a file system
    with the store's files open for writing cannot be remounted read-only)."""
    if small_tmpfs is None:
        pytest.skip("this machine does not let the tests mount a tmpfs")
    store = SqliteStore(small_tmpfs)
    store.save("u/s1", SessionHistory(), "k", b"{}")
    store.close()
    before = (small_tmpfs / DATABASE_NAME).read_bytes()
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    try:
        with pytest.raises(StoreUnavailable, match="cannot open the session database"):
            SqliteStore(small_tmpfs, open_locked_timeout=0)
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_tmpfs)], check=True)
    assert (small_tmpfs / DATABASE_NAME).read_bytes() == before
    assert SqliteStore(small_tmpfs).load("u/s1") is not None
