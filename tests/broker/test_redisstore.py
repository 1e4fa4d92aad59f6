"""The Redis adapter on the tests' redis-server: what the shared store adds to the store
contract (test_store.py), and the intake's streams: routing to a session's owner, taking over
a dead instance's stream in order, fencing the instance that was taken over."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable
from typing import TypeVar

import pytest

from devtools.redis_server import RedisServer
from devtools.waiting import eventually
from worker.core.session_cache import SessionCache
from worker.intake.streams import RedisStreams
from worker.session import ANSWERED_KEYS_PER_SESSION, SessionHistory, Turn
from worker.store.redis import RedisStore

T = TypeVar("T")
_prefixes = itertools.count()


def run(work: Awaitable[T]) -> T:
    async def wrapped() -> T:
        return await work

    return asyncio.run(wrapped())


@pytest.fixture
def prefix() -> str:
    return f"redis-test-{next(_prefixes)}"


def test_two_workers_see_each_others_turns(redis_server: RedisServer, prefix: str) -> None:
    """A shared store is read again for each request: a session's turn served by one worker is
    in the history the next worker loads, even where that one had it in memory."""
    one = SessionCache(RedisStore(redis_server.url, prefix, 3600), capacity=10)
    two = SessionCache(RedisStore(redis_server.url, prefix, 3600), capacity=10)
    assert two.get("u/s").turns == []  # now in two's memory
    history = one.get("u/s")
    history.turns.append(Turn.plain("k1", "hi", "hello"))
    assert one.save("u/s", history, "k1", b'{"reply": "hello"}') is None
    seen = two.get("u/s")
    assert seen.turns == [Turn.plain("k1", "hi", "hello")] and seen.answered == {"k1": b'{"reply": "hello"}'}


def test_the_first_stored_answer_stands(redis_server: RedisServer, prefix: str) -> None:
    """Two workers that both generated a request (one was taken for dead while it was only
    slow): the second answer is not written, and the first one is returned to give instead."""
    store = RedisStore(redis_server.url, prefix, 3600)
    first = SessionHistory(None, [Turn.plain("k", "hi", "first")])
    second = SessionHistory(None, [Turn.plain("k", "hi", "second")])
    assert store.save("u/s", first, "k", b"first answer") is None
    assert store.save("u/s", second, "k", b"second answer") == b"first answer"
    loaded = store.load("u/s")
    assert loaded is not None and loaded.turns == first.turns and loaded.answered == {"k": b"first answer"}


def test_only_the_newest_answers_are_kept(redis_server: RedisServer, prefix: str) -> None:
    store = RedisStore(redis_server.url, prefix, 3600)
    for i in range(ANSWERED_KEYS_PER_SESSION + 5):
        store.save("u/s", SessionHistory(), f"k{i}", b"{}")
    loaded = store.load("u/s")
    assert loaded is not None and len(loaded.answered) == ANSWERED_KEYS_PER_SESSION
    assert "k0" not in loaded.answered and list(loaded.answered)[-1] == f"k{ANSWERED_KEYS_PER_SESSION + 4}"


def test_an_idle_session_expires_by_itself(redis_server: RedisServer, prefix: str) -> None:
    store = RedisStore(redis_server.url, prefix, session_ttl=0.3)
    store.save("u/s", SessionHistory(None, [Turn.plain("k", "hi", "hello")]), "k", b"{}")
    store.count_delivery("u/s", "k2")
    assert store.load("u/s") is not None
    eventually(lambda: store.load("u/s") is None, "the session's keys never expired", interval=0.1)
    assert store.count_delivery("u/s", "k2") == 1  # its delivery counts went with it


def streams(server: RedisServer, prefix: str, instance: str, worker_lease: float = 30) -> RedisStreams:
    return RedisStreams(server.url, prefix, instance, worker_lease=worker_lease, owner_lease=3600)


def entry(text: str) -> dict[str, bytes]:
    return {"payload": text.encode()}


def test_requests_go_to_their_sessions_owner_in_order(redis_server: RedisServer, prefix: str) -> None:
    async def scenario() -> None:
        a, b = streams(redis_server, prefix, "a"), streams(redis_server, prefix, "b")
        for member in (a, b):
            await member.register()
        assert (await a.route("u/s1", entry("s1 turn 1")))[0] == "a"  # first receiver claims it
        assert (await b.route("u/s2", entry("s2 turn 1")))[0] == "b"
        assert (await b.route("u/s1", entry("s1 turn 2")))[0] == "a"  # received by b, owned by a
        assert (await a.route("u/s2", entry("s2 turn 2")))[0] == "b"
        assert [f["payload"] for _, f in await a.read(10, 100)] == [b"s1 turn 1", b"s1 turn 2"]
        assert [f["payload"] for _, f in await b.read(10, 100)] == [b"s2 turn 1", b"s2 turn 2"]
        for member in (a, b):
            await member.close()

    run(scenario())


def test_a_dead_instances_open_entries_move_in_order_and_its_sessions_follow(
    redis_server: RedisServer, prefix: str
) -> None:
    async def scenario() -> None:
        dead, heir = streams(redis_server, prefix, "dead", worker_lease=1), streams(redis_server, prefix, "heir")
        for member in (dead, heir):
            await member.register()
        await heir.route("u/h", entry("heir's own"))
        for turn in range(3):
            await dead.route("u/s", entry(f"turn {turn}"))
        (running, _), _, _ = await dead.read(10, 100)  # all three read; the first one answered
        await dead.ack(running)
        assert await heir.take_over("dead") == -1  # alive: nothing moves
        assert await heir.dead_instances() == []
        while await heir.dead_instances() != ["dead"]:  # its heartbeat expires (1 s)
            await asyncio.sleep(0.1)
        # Sent to the dead owner before anyone noticed: moved along with the rest.
        await heir.route("u/s", entry("turn 3"))
        assert await heir.take_over("dead") == 3
        assert await heir.take_over("dead") == -2  # only once
        assert (await dead.heartbeat()) is False  # a slow instance finds itself fenced
        # and claims no session for its gone stream: a live member gets it.
        assert (await dead.route("u/new", entry("new session")))[0] == "heir"
        assert (await heir.route("u/s", entry("turn 4")))[0] == "heir"  # the session followed
        read = [f["payload"] for _, f in await heir.read(10, 100)]
        assert read == [b"heir's own", b"turn 1", b"turn 2", b"turn 3", b"new session", b"turn 4"]
        for member in (dead, heir):
            await member.close()

    run(scenario())


def test_a_clean_leave_hands_the_stream_over_at_once(redis_server: RedisServer, prefix: str) -> None:
    async def scenario() -> None:
        leaving, staying = streams(redis_server, prefix, "leaving"), streams(redis_server, prefix, "staying")
        for member in (leaving, staying):
            await member.register()
        await leaving.route("u/s", entry("left for the next start"))
        await leaving.leave()
        assert await staying.dead_instances() == ["leaving"]
        assert await staying.take_over("leaving") == 1
        assert [f["payload"] for _, f in await staying.read(10, 100)] == [b"left for the next start"]
        for member in (leaving, staying):
            await member.close()

    run(scenario())
