"""The session store runs off the event loop: a store call that waits (SQLite waiting for
another connection's lock, Redis across a network) holds the requests that need the store,
never the other sessions' streams; the store is called on one thread, in order, and the
session's order, redeliveries, the drain and the delivery counts hold while it waits.

The store that waits is devtools' SlowStore (a real lock wait is the busy timeout, up to
3 s; bench/storelock.py measures it against a real SQLite database locked by another
process: docs/performance.md)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from devtools.fakes import Harness, MemoryTransport, SlowStore, WordRenderer, mentions
from devtools.waiting import PATIENCE


class TimedTransport(MemoryTransport):
    """Records when each message was published."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[tuple[float, str]] = []

    def publish(self, topic: str, payload: bytes, **kwargs: Any) -> asyncio.Future[None]:
        self.times.append((time.monotonic(), topic))
        return super().publish(topic, payload, **kwargs)


def harness(store: SlowStore, **kwargs: Any) -> Harness:
    h = Harness(store=store, generation={"stream_interval_ms": 0}, **kwargs)
    h.transport = h.service.transport = h.service.turns.publisher = TimedTransport()  # type: ignore[assignment]
    return h


def request(request_id: str, max_tokens: int = 4, **fields: Any) -> dict[str, Any]:
    return {"message": f"question {request_id}", "requestId": request_id, "maxTokens": max_tokens, **fields}


def test_a_waiting_store_holds_no_other_session_s_stream() -> None:
    """Session b's store calls are held (its history is read, its delivery counted, its turn
    committed) while session a streams a reply of 300 tokens: a's stream goes on while b's
    first call is held. With the store on the event loop, it stopped for each call. The test
    holds the call and releases it once a's stream has moved on, so no speed is assumed; a
    store on the loop would hold the loop itself until the hold's 30 s end, and a's stream
    would move only after the call."""

    async def scenario() -> None:
        store = SlowStore(30.0)
        store.gate = threading.Event()
        h = harness(store)
        transport = h.transport
        assert isinstance(transport, TimedTransport)

        def a_deltas() -> int:
            return sum(t.endswith("/a/stream") for _, t in transport.times)

        async def until(condition: Callable[[], object]) -> None:
            while not condition():
                await asyncio.sleep(0.01)

        # One consumer throughout (a stopped consumer puts back the message whose session
        # it was reading).
        consumer = asyncio.ensure_future(h.service.consume())
        try:
            h.transport.deliver("chat/u/a/request", request("a", 300, stream=True))
            await asyncio.wait_for(until(a_deltas), PATIENCE)
            store.slow.add("u/b")
            h.transport.deliver("chat/u/b/request", request("b"))
            # b's first store call is held (or, on the loop, has held everything and ended).
            await asyncio.wait_for(until(lambda: ("load", "u/b") in store.calls), PATIENCE)
            before = a_deltas()
            await asyncio.wait_for(until(lambda: a_deltas() >= before + 20 or not store.waiting), PATIENCE)
            assert store.waiting and a_deltas() >= before + 20, "a's stream stopped while b's store call waited"
            assert not h.transport.replies("b")
            released = time.monotonic()
            store.gate.set()
            await asyncio.wait_for(until(lambda: h.transport.replies("a") and h.transport.replies("b")), PATIENCE)
        finally:
            consumer.cancel()
        (answer_b,) = h.transport.replies("b")
        assert "reply" in answer_b
        assert next(at for at, topic in transport.times if topic.endswith("/b/reply")) > released
        assert [call for call in store.calls if call[1] == "u/b"][:3] == [
            ("load", "u/b"),
            ("count_delivery", "u/b"),
            ("save", "u/b"),
        ]
        assert a_deltas() == 300  # every one of a's tokens as it was generated

    asyncio.run(scenario())


def test_the_store_is_called_on_one_thread_of_its_own() -> None:
    """Every call the service makes (read, count, commit, uncount, reset, expiry) runs on one
    thread, never the event loop's."""

    async def scenario() -> None:
        store = SlowStore()
        h = harness(store, history={"session_ttl": 3600})
        expiry = asyncio.ensure_future(h.service.expire_sessions_forever())
        h.transport.deliver("chat/u/s/request", request("r1"))
        h.transport.deliver("chat/u/s/request", request("queued", 500))
        h.transport.deliver("chat/u/s/control", {"action": "cancel", "requestId": "queued"})  # uncounted
        h.transport.deliver("chat/u/s/control", {"action": "reset"})
        await h.run_until(lambda: len(h.transport.acked) == 4)
        expiry.cancel()
        methods = {method for method, _ in store.calls}
        assert {"load", "count_delivery", "save", "uncount_delivery", "reset", "expire"} <= methods, methods
        assert len(store.threads) == 1 and threading.get_ident() not in store.threads

    asyncio.run(scenario())


def test_while_the_store_waits_a_session_keeps_its_order_and_its_redeliveries() -> None:
    """Messages of one session that arrive while its first read waits: a redelivery of the
    first joins it (generated once, both copies acknowledged), the turns run in the order the
    messages arrived, the reset between them lands where it was sent, and a cancel finds the
    request it names."""

    async def scenario() -> None:
        store = SlowStore(0.2)
        store.slow.add("u/s")
        h = harness(store)
        first = h.transport.deliver("chat/u/s/request", request("r1"))
        h.transport.deliver("chat/u/s/request", request("r1"), mid=first, dup=True)
        h.transport.deliver("chat/u/s/request", request("r2"))
        h.transport.deliver("chat/u/s/request", request("gone", 500))
        h.transport.deliver("chat/u/s/control", {"action": "cancel", "requestId": "gone"})
        h.transport.deliver("chat/u/s/control", {"action": "reset"})
        h.transport.deliver("chat/u/s/request", request("r3"))
        await h.run_until(lambda: len(h.transport.replies("s")) == 5)
        await h.run_until(lambda: not h.service._tasks and not h.service._runtime)
        r1, r2, gone, reset, r3 = h.transport.replies("s")
        assert [r1["requestId"], r2["requestId"], gone["requestId"], r3["requestId"]] == ["r1", "r2", "gone", "r3"]
        assert gone["finishReason"] == "cancelled" and reset["action"] == "reset"
        assert len([rid for rid in h.engine.started if mentions(rid, "r1")]) == 1  # generated once
        assert h.transport.acked.count(first) == 2  # the redelivered copy too
        prompts = [r1["usage"]["promptTokens"], r2["usage"]["promptTokens"], r3["usage"]["promptTokens"]]
        alone = len(WordRenderer().render([{"role": "user", "content": "question r3"}], add_generation_prompt=True))
        assert prompts[1] > prompts[0] and prompts[2] == alone  # r2 saw r1; r3 came after the reset
        assert h.service.pending == 0 and h.service.in_flight.room() == h.service.in_flight.limit

    asyncio.run(scenario())


def test_a_stop_while_the_store_waits_drains_the_request_it_was_dispatching() -> None:
    """The drain waits for the message whose dispatch is waiting for the store: its turn is
    started and stopped with the others (left unacknowledged for the restart, its delivery not
    counted against it), not left running after the drain."""

    async def scenario() -> None:
        store = SlowStore(0.5)
        store.slow.add("u/s")
        h = harness(store)
        h.transport.deliver("chat/u/s/request", request("r1", 500))
        consumer = asyncio.ensure_future(h.service.consume())
        try:
            while not store.calls:  # its dispatch is reading the session
                await asyncio.sleep(0.01)
            await h.service.drain(0)
            assert not h.service._tasks and not h.service._runtime
        finally:
            consumer.cancel()
        assert h.transport.acked == [] and h.transport.replies("s") == []
        store.slow.clear()
        assert store.count_delivery("u/s", "r1") == 1  # the stop did not count as a try

    asyncio.run(scenario())


def test_the_sessions_of_waiting_requests_are_read_in_one_go_before_any_other_store_work() -> None:
    """Twenty requests of twenty sessions not in memory, all waiting in the inbox: their
    sessions are read together (one call on the store's thread), before any delivery count or
    commit, not one round trip per message (docs/performance.md, "Taking requests in")."""

    async def scenario() -> None:
        store = SlowStore()
        h = harness(store)
        for n in range(20):
            h.transport.deliver(f"chat/u/s{n}/request", request(f"r{n}"))
        await h.run_until(lambda: len(h.transport.acked) == 20)
        assert [method for method, _ in store.calls[:20]] == ["load"] * 20
        assert sorted(session for _, session in store.calls[:20]) == sorted(f"u/s{n}" for n in range(20))

    asyncio.run(scenario())


def test_messages_taken_with_a_batch_go_back_to_the_inbox_when_the_consumer_stops() -> None:
    """The consumer is cancelled while the batch's sessions are read: the messages it took
    are back at the front of the inbox, in order, before one that arrived meanwhile, and the
    next consumer answers each once."""

    async def scenario() -> None:
        store = SlowStore(0.3)
        store.slow.add("u/b")
        h = harness(store)
        mids = [h.transport.deliver(f"chat/u/{s}/request", request(f"r-{s}")) for s in "abc"]
        consumer = asyncio.ensure_future(h.service.consume())
        while ("load", "u/b") not in store.calls:  # reading the batch's sessions
            await asyncio.sleep(0.01)
        late = h.transport.deliver("chat/u/d/request", request("r-d"))
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
        assert [h.transport.inbox.get_nowait().mid for _ in range(4)] == [*mids, late]
        for s in "abcd":
            h.transport.deliver(f"chat/u/{s}/request", request(f"r-{s}"))
        await h.run_until(lambda: len(h.transport.acked) == 4)
        assert sorted(p["requestId"] for _, p in h.transport.published) == ["r-a", "r-b", "r-c", "r-d"]

    asyncio.run(scenario())


def test_store_calls_queued_together_run_in_order_and_answer_their_own_callers() -> None:
    """Calls made while the store's thread is busy run as one batch: in the order they were
    made, each result (or error) to its own caller."""
    from worker.core.session_cache import SessionCache
    from worker.store.port import StoreUnavailable

    class Failing(SlowStore):
        def load(self, session: str) -> Any:
            if session == "u/bad":
                self._enter("load", session)
                raise StoreUnavailable("down")
            return super().load(session)

    async def scenario() -> None:
        store = Failing(0.2)
        store.slow.add("u/first")
        cache = SessionCache(store, 100)
        first = asyncio.ensure_future(cache.aget("u/first"))  # holds the thread 0.2 s
        await asyncio.sleep(0.05)
        results = await asyncio.gather(
            *(cache.aget(name) for name in ("u/a", "u/bad", "u/c")), first, return_exceptions=True
        )
        kinds = [type(r).__name__ for r in results]
        assert kinds == ["SessionHistory", "StoreUnavailable", "SessionHistory", "SessionHistory"]
        assert [session for _, session in store.calls] == ["u/first", "u/a", "u/bad", "u/c"]

    asyncio.run(scenario())


def test_a_call_from_a_new_event_loop_is_answered_while_a_closed_loops_call_still_runs() -> None:
    """One cache, one asyncio.run after another (as tests use it): a call made from the second
    loop while the store's thread still runs the first loop's call is answered on its own
    loop. It was answered on the first one, closed by then, and waited forever (a tool-loop
    test hung so on a loaded machine)."""
    from worker.core.session_cache import SessionCache

    entered, release = threading.Event(), threading.Event()

    class Gated(SlowStore):
        def load(self, session: str) -> Any:
            if session == "u/first":
                entered.set()
                release.wait(PATIENCE)
            return super().load(session)

    cache = SessionCache(Gated(0.0), 100)

    async def first() -> None:
        call = asyncio.ensure_future(cache.aget("u/first"))
        await asyncio.to_thread(entered.wait, PATIENCE)
        call.cancel()  # the caller gives up; the store's call runs on, and this loop closes

    asyncio.run(first())
    assert entered.is_set() and not release.is_set()

    async def second() -> str:
        call = asyncio.ensure_future(cache.aget("u/second"))  # queued behind the running call
        await asyncio.sleep(0)
        release.set()
        history = await asyncio.wait_for(call, PATIENCE)
        return type(history).__name__

    assert asyncio.run(second()) == "SessionHistory"
