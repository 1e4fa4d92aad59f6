"""Requests per user namespace per minute (issue 5, point 5): the limiter on its own (a fake
clock), and through the real broker on an in-process worker."""

from __future__ import annotations

from devtools.inproc import LiveWorker
from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import Client
from worker.config.models import LimitsConfig
from worker.core.ratelimit import RateLimiter
from worker.protocol.messages import log_ref


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_namespace_gets_its_burst_then_is_limited() -> None:
    limiter = RateLimiter(5, clock=Clock())
    assert [limiter.allow("alice") for _ in range(6)] == [True] * 5 + [False]
    assert limiter.allow("bob")  # another namespace is unaffected


def test_tokens_come_back_at_the_per_minute_rate() -> None:
    clock = Clock()
    limiter = RateLimiter(60, clock=clock)  # one a second
    assert all(limiter.allow("alice") for _ in range(60))
    assert not limiter.allow("alice")
    assert 0.9 < limiter.retry_after("alice") <= 1.0
    clock.now += 1.0
    assert limiter.allow("alice")
    assert not limiter.allow("alice")
    clock.now += 120
    assert sum(limiter.allow("alice") for _ in range(100)) == 60  # refills to the burst, no more


def test_refused_requests_do_not_count() -> None:
    clock = Clock()
    limiter = RateLimiter(6, clock=clock)  # one every 10 s
    for _ in range(6):
        limiter.allow("alice")
    for _ in range(50):
        assert not limiter.allow("alice")
    clock.now += 10
    assert limiter.allow("alice")


def test_zero_is_off() -> None:
    limiter = RateLimiter(0, clock=Clock())
    assert all(limiter.allow("alice") for _ in range(10_000))
    assert len(limiter) == 0
    assert limiter.retry_after("alice") == 0


def test_idle_namespaces_are_forgotten() -> None:
    clock = Clock()
    limiter = RateLimiter(10, clock=clock)
    for i in range(1000):
        limiter.allow(f"user{i}")
    assert len(limiter) == 1000
    clock.now += 61  # every bucket has refilled
    limiter.allow("late")
    assert len(limiter) == 1


def test_the_number_of_namespaces_is_bounded() -> None:
    limiter = RateLimiter(10, max_namespaces=100, clock=Clock())
    for i in range(10_000):
        limiter.allow(f"user{i}")
    assert len(limiter) == 100


def test_the_sixth_request_of_a_user_in_a_minute_is_rate_limited(broker: Mosquitto) -> None:
    assert LimitsConfig().max_requests_per_user_per_minute == 600
    live = LiveWorker(broker.port, limits={"max_requests_per_user_per_minute": 5})
    client = Client(broker.port, [f"{live.prefix}/+/+/reply"])
    try:
        # a new session each time: inventing sessions does not get around the limit
        for i in range(7):
            client.publish(live.topic("alice", f"s{i}"), {"message": "x", "maxTokens": 1, "requestId": f"a{i}"})
        answers = {i: client.wait_topic(live.topic("alice", f"s{i}", "reply"), 15).json() for i in range(7)}
        assert [answers[i].get("error", {}).get("code") for i in range(7)] == [None] * 5 + ["rate_limited"] * 2
        assert "5 requests a minute" in answers[5]["error"]["message"]
        assert answers[5]["requestId"] == "a5"
        # another user is unaffected
        client.publish(live.topic("bob", "s0"), {"message": "x", "maxTokens": 1, "requestId": "b0"})
        assert "error" not in client.wait_topic(live.topic("bob", "s0", "reply"), 15).json()
        live.wait_idle()
        assert sorted(started.split("/")[2] for started in live.engine.started) == sorted(
            log_ref(key) for key in [f"a{i}" for i in range(5)] + ["b0"]
        )
        assert live.call(lambda: len(live.service.rate_limiter)) == 2
    finally:
        client.close()
        live.close()
