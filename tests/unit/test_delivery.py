"""At-least-once delivery with idempotency, at the service: a request is acknowledged only
once the broker has its answer; an answered request is answered again from the store and
never generated twice (also after a restart, also after a reset); a request that keeps
killing the worker gets a final error; idle sessions expire while the worker runs."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from devtools.fakes import Harness, MemoryTransport
from worker.engine.port import EngineDead
from worker.store.memory import MemoryStore
from worker.store.sqlite import SqliteStore

REQUEST = {"message": "hello there", "requestId": "r1", "maxTokens": 3}
TOPIC = "chat/u/s1/request"


class HoldingTransport(MemoryTransport):
    """The broker's PUBACKs arrive only when the test releases them."""

    def __init__(self) -> None:
        super().__init__()
        self.unconfirmed: list[asyncio.Future[None]] = []

    def publish(self, topic: str, payload: bytes, **kwargs: Any) -> asyncio.Future[None]:
        super().publish(topic, payload, **kwargs)
        held: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.unconfirmed.append(held)
        return held

    def confirm_all(self) -> None:
        for held in self.unconfirmed:
            if not held.done():
                held.set_result(None)


def test_a_request_is_acknowledged_only_after_its_answer_is_taken() -> None:
    async def scenario() -> None:
        h = Harness()
        h.transport = h.service.transport = h.service.turns.publisher = HoldingTransport()  # type: ignore[assignment]
        h.transport.deliver(TOPIC, REQUEST)
        await h.run_until(lambda: h.transport.replies("s1"))
        for _ in range(20):  # every step the service could take meanwhile: loop turns, not time
            await asyncio.sleep(0)
        assert h.transport.acked == []  # answered, but the broker has not taken the answer yet
        h.transport.confirm_all()  # type: ignore[attr-defined]
        await h.run_until(lambda: h.transport.acked == [1])

    asyncio.run(scenario())


def test_an_answered_request_is_answered_from_the_store_after_a_restart(tmp_path: Path) -> None:
    async def scenario() -> None:
        first = Harness(store=SqliteStore(tmp_path))
        first.transport.deliver(TOPIC, REQUEST)
        await first.run_until(lambda: first.transport.acked)
        # A new process on the same database: the broker delivers the request again (say the
        # old one crashed between storing the answer and acknowledging the request).
        second = Harness(store=SqliteStore(tmp_path))
        second.transport.deliver(TOPIC, REQUEST)
        await second.run_until(lambda: second.transport.acked)
        assert second.engine.started == []  # not generated twice
        assert second.transport.replies("s1") == first.transport.replies("s1")

    asyncio.run(scenario())


def test_a_request_id_answered_before_a_reset_gets_duplicate_request_and_never_generates() -> None:
    """The reply's text is gone with the reset: a redelivery, or a new message with the old
    requestId, is told so (never dropped in silence, never generated again)."""

    async def scenario() -> None:
        h = Harness()
        first = h.transport.deliver(TOPIC, REQUEST)
        await h.run_until(lambda: h.transport.acked)
        h.transport.deliver("chat/u/s1/control", {"action": "reset"})
        await h.run_until(lambda: len(h.transport.acked) == 2)
        h.transport.deliver(TOPIC, REQUEST, mid=first, dup=True)  # the broker redelivers it
        h.transport.deliver(TOPIC, {**REQUEST, "message": "a new question"})  # a client reusing r1
        await h.run_until(lambda: len(h.transport.acked) == 4)
        assert len(h.engine.started) == 1
        _, reset, *duplicates = h.transport.replies("s1")
        assert reset == {"sessionId": "s1", "action": "reset", "ok": True}
        assert [d["error"]["code"] for d in duplicates] == ["duplicate_request", "duplicate_request"]
        assert all(d["requestId"] == "r1" for d in duplicates)
        history = h.service.sessions.get("u/s1")
        assert history.turns == [] and history.answered == {"r1": None}

    asyncio.run(scenario())


def test_a_request_that_keeps_killing_the_engine_gets_a_final_error() -> None:
    async def scenario() -> None:
        store = MemoryStore()  # what the restarts share (SQLite in a real worker)
        for _ in range(3):  # max_deliveries: three tries, each one kills the engine
            h = Harness(store=store)
            h.engine.fail = {"r1": EngineDead("killed by this request")}
            h.transport.deliver(TOPIC, REQUEST)
            await h.run_until(lambda h=h: h.stop_codes)
            assert h.transport.acked == [] and h.transport.replies("s1") == []
        fourth = Harness(store=store)
        fourth.transport.deliver(TOPIC, REQUEST)
        await fourth.run_until(lambda: fourth.transport.acked)
        assert fourth.engine.started == []
        (error,) = fourth.transport.replies("s1")
        assert error["error"]["code"] == "engine_error" and "3 times" in error["error"]["message"]
        fifth = Harness(store=store)  # the final answer is stored like any other
        fifth.transport.deliver(TOPIC, REQUEST)
        await fifth.run_until(lambda: fifth.transport.acked)
        assert fifth.engine.started == [] and fifth.transport.replies("s1") == [error]

    asyncio.run(scenario())


def test_a_stop_does_not_count_as_a_try() -> None:
    async def scenario() -> None:
        store = MemoryStore()
        for _ in range(4):  # more stops than max_deliveries
            h = Harness(store=store)
            h.transport.deliver(TOPIC, {**REQUEST, "maxTokens": 500})
            await h.run_until(lambda h=h: h.engine.started)
            await h.service.drain(0)  # aborted unanswered, as SIGTERM does after the grace period
            assert h.transport.acked == []
        last = Harness(store=store)
        last.transport.deliver(TOPIC, REQUEST)
        await last.run_until(lambda: last.transport.acked)
        assert "error" not in last.transport.replies("s1")[0]

    asyncio.run(scenario())


def test_idle_sessions_expire_while_the_worker_runs(tmp_path: Path) -> None:
    """session_ttl: the running service deletes a session idle for longer, from memory and
    from the store (checking every tenth of the TTL)."""

    async def scenario() -> None:
        store = SqliteStore(tmp_path)
        # A TTL of 3 s, checked every 0.3 s: room for a busy machine's stalls between the
        # answer and the checks that must not expire it yet.
        h = Harness(store=store, history={"session_ttl": 3})
        sweeps = [0]
        sweep = h.service.sessions.aexpire

        async def counted(ttl: float) -> int:
            expired = await sweep(ttl)
            sweeps[0] += 1  # a sweep done, from the store and from memory
            return expired

        h.service.sessions.aexpire = counted  # type: ignore[method-assign]
        expiry = asyncio.ensure_future(h.service.expire_sessions_forever())
        try:
            h.transport.deliver(TOPIC, REQUEST)
            await h.run_until(lambda: h.transport.acked)
            assert store.load("u/s1") is not None
            after = sweeps[0]
            await h.run_until(lambda: sweeps[0] >= after + 2)
            assert store.load("u/s1") is not None  # checked twice, not idle long enough yet
            await h.run_until(lambda: store.load("u/s1") is None)
            gone = sweeps[0]
            await h.run_until(lambda: sweeps[0] > gone)  # the sweep that deleted it has ended
            assert h.service.sessions.get("u/s1").turns == []  # gone from memory too
        finally:
            expiry.cancel()

    asyncio.run(scenario())
