"""The Redis intake of a share group (issue 7, point 2) with in-process workers (the fake
engine) on the real mosquitto and redis-server: a session's turns, handed round robin to both
workers by the broker, all run on its owner, one at a time, each with the turns before it; a member
takes from Redis only as many requests as it has room for; a Redis that goes away holds requests
unacknowledged in the broker, and they are answered once it is back."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from loguru import logger

from devtools.inproc import LiveWorker, settle
from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import Client
from devtools.redis_server import RedisServer
from devtools.waiting import PATIENCE, eventually
from worker.intake.streams import RedisStreams
from worker.session import SessionHistory, Turn
from worker.store.redis import RedisStore

_groups = itertools.count()


def member(port: int, prefix: str, name: str, redis_url: str, **redis: Any) -> LiveWorker:
    return LiveWorker(
        port,
        mqtt={"topic_prefix": prefix, "worker_id": name, "share_group": prefix},
        history={"store": "redis"},
        redis={"url": redis_url, **redis},
    )


@pytest.fixture
def prefix() -> str:
    return f"intake{next(_groups)}"


@pytest.fixture
def frontend(broker: Mosquitto, prefix: str) -> Iterator[Client]:
    client = Client(broker.port, [f"{prefix}/+/+/reply", f"{prefix}/_worker/+/status"])
    yield client
    client.close()


def emptied(redis: RedisServer, prefix: str) -> Callable[[], bool]:
    """Whether every intake stream of the group is empty: each request taken in was answered."""
    return lambda: redis.entries(f"{prefix}:stream:*") == 0


def prompts_by_session(worker: LiveWorker) -> dict[str, list[int]]:
    """Per session, the prompt lengths of the turns this worker generated, in order."""
    out: dict[str, list[int]] = collections.defaultdict(list)
    for request in worker.engine.requests:
        user, session, _key, _ = request.request_id.split("/")
        out[f"{user}/{session}"].append(len(request.prompt_token_ids))
    return out


def test_a_sessions_turns_run_on_its_owner_one_at_a_time(
    broker: Mosquitto, redis_server: RedisServer, frontend: Client, prefix: str
) -> None:
    """Turns sent all at once, handed round robin to both members: each session's turns run
    on one worker, one after the other, each with every turn before it in its prompt. (Their
    order is the order the members routed them, which two messages published back to back
    and handed to two members do not fix: docs/scaling.md.)"""
    workers = [member(broker.port, prefix, f"{prefix}-{n}", redis_server.url) for n in range(2)]
    try:
        sessions, turns = ["ann/one", "bob/two", "cy/three"], 4
        for turn in range(turns):  # no turn waits for the one before
            for session in sessions:
                request = {"message": f"turn {turn} of {session}", "maxTokens": 5, "requestId": f"t{turn}"}
                frontend.publish(f"{prefix}/{session}/request", request)
        replies: dict[str, list[str]] = collections.defaultdict(list)
        for _ in range(turns * len(sessions)):
            reply = frontend.wait_for(lambda m: m.topic.endswith("/reply")).json()
            assert "error" not in reply, reply
            replies[reply["sessionId"]].append(reply["requestId"])
        # Nothing answered twice: once both members have handled everything sent before a
        # marker of their own, every stream is empty and they have stopped, no other reply came.
        more = settle(frontend, workers, lambda s: f"{prefix}/ann/{s}/request", also=emptied(redis_server, prefix))
        assert [m.json()["requestId"] for m in more] == []
        for session in sessions:
            assert sorted(replies[session.split("/")[1]]) == [f"t{t}" for t in range(turns)]
        # The broker handed requests to both (each acknowledged what it received, once in
        # Redis) ...
        assert all(w.call(lambda w=w: len(w.transport.acked)) > 0 for w in workers)
        # ... and each session ran on one worker, every turn on a longer prompt: the turns
        # before it.
        generated = [prompts_by_session(w) for w in workers]
        for session in sessions:
            (lengths,) = [g[session] for g in generated if session in g]
            assert len(lengths) == turns and lengths == sorted(set(lengths)), lengths
    finally:
        for worker in workers:
            worker.close()


def test_a_member_takes_from_redis_only_what_it_has_room_for(
    broker: Mosquitto, redis_server: RedisServer, frontend: Client, prefix: str
) -> None:
    """More requests at once than the member runs (limits.max_pending_requests 2): the rest
    wait in its Redis stream, not in the service, and each is answered once there is room;
    none is refused as busy (an intake that read them all would hand the service more than it
    admits)."""
    worker = LiveWorker(
        broker.port,
        mqtt={"topic_prefix": prefix, "worker_id": f"{prefix}-0", "share_group": prefix},
        history={"store": "redis"},
        redis={"url": redis_server.url},
        limits={"max_pending_requests": 2},
    )
    try:
        for n in range(6):  # six sessions: no session's own queue limit applies
            frontend.publish(f"{prefix}/u{n}/s/request", {"message": "x", "maxTokens": 20, "requestId": "r"})
        replies = [frontend.wait_for(lambda m: m.topic.endswith("/reply")).json() for _ in range(6)]
        assert [reply.get("error") for reply in replies] == [None] * 6, replies
        assert worker.engine.most_running == 2
    finally:
        worker.close()


def test_requests_wait_in_the_broker_while_redis_is_away(
    broker: Mosquitto, frontend: Client, prefix: str, tmp_path: Path
) -> None:
    redis = RedisServer(tmp_path)
    redis.start()
    worker = member(broker.port, prefix, f"{prefix}-solo", redis.url)
    warnings: list[str] = []
    sink = logger.add(lambda m: warnings.append(m.record["message"]), level="WARNING")
    try:
        frontend.publish(f"{prefix}/ann/s/request", {"message": "before", "maxTokens": 3, "requestId": "before"})
        assert frontend.wait_for(lambda m: m.topic.endswith("/reply")).json()["requestId"] == "before"
        redis.stop()  # a clean stop: its append-only file has everything
        frontend.publish(f"{prefix}/ann/s/request", {"message": "during", "maxTokens": 3, "requestId": "during"})
        # The worker has it and found Redis away: from then on it holds it until Redis takes it.
        eventually(lambda: any("cannot queue a message" in line for line in warnings), "no retry of the message")
        # Held there, not handed on: nothing of it runs or waits in the service.
        assert worker.idle()
        assert frontend.received(lambda m: m.topic.endswith("/reply")) == []
        assert worker.call(lambda: len(worker.transport.acked)) == 1  # "during" is not acknowledged
        redis.start()  # same port, same files
        reply = frontend.wait_for(lambda m: m.topic.endswith("/reply"), timeout=PATIENCE).json()
        assert reply["requestId"] == "during" and "error" not in reply, reply
        more = settle(frontend, [worker], lambda s: f"{prefix}/ann/{s}/request", also=emptied(redis, prefix))
        assert [m.json()["requestId"] for m in more] == []  # answered once
        # It ran with the turn from before the outage (in Redis's file).
        assert prompts_by_session(worker)["ann/s"][1] > prompts_by_session(worker)["ann/s"][0]
    finally:
        logger.remove(sink)
        worker.close()
        redis.stop()


def test_a_worker_taken_for_dead_gives_the_first_stored_answer_and_stops(
    broker: Mosquitto, redis_server: RedisServer, frontend: Client, prefix: str
) -> None:
    """A worker whose heartbeat lapsed while it generated (frozen, cut off from Redis): another
    worker took over its stream and answered the request first. When it finishes, its own
    answer is not stored and the first one is published instead (a client never gets two
    different answers), and at its next heartbeat it finds it was taken over and stops."""
    slow = member(broker.port, prefix, f"{prefix}-slow", redis_server.url, worker_lease=1.5)
    heir = RedisStreams(redis_server.url, prefix, "heir", worker_lease=30, owner_lease=60)
    try:
        instance = slow.intake.streams.instance if slow.intake else ""
        frontend.publish(f"{prefix}/ann/s/request", {"message": "long", "maxTokens": 300, "requestId": "r"})
        eventually(lambda: slow.engine.started, "the request was not generated", interval=0.01)
        # What the heir does once the slow worker's heartbeat has expired: it takes over the
        # stream (the request moves to the heir) and answers the request.
        first = b'{"sessionId": "s", "requestId": "r", "reply": "the heir\'s answer"}'

        async def take_over() -> int:
            await heir.register()
            await heir._db.delete(f"{prefix}:alive:{instance}")  # as its expiry would
            return await heir.take_over(instance)

        assert slow.call(take_over()) == 1
        RedisStore(redis_server.url, prefix, 3600).save(
            "ann/s", SessionHistory(None, [Turn.plain("r", "long", "x")]), "r", first
        )
        reply = frontend.wait_for(lambda m: m.topic.endswith("/reply"), timeout=PATIENCE)
        assert reply.payload == first
        eventually(lambda: slow.stop_codes == [1], lambda: str(slow.stop_codes))
        # Nothing else, its own answer least of all: once it has finished its work and
        # stopped, its offline status (the last thing it publishes) came after no other reply.
        slow.wait_idle()
        slow.call(heir.close())  # on the loop it was used on
        status = slow.transport.settings.status_topic
        slow.close()
        frontend.wait_for(lambda m: m.topic == status and m.payload == b"offline")
        assert frontend.received(lambda m: m.topic.endswith("/reply")) == []
    finally:
        if not slow.closed:
            slow.call(heir.close())
        slow.close()
