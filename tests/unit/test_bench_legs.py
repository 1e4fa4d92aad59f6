"""bench/legs.py: each request's legs from the times the client and the worker took."""

from __future__ import annotations

import pytest

from bench.legs import legs


def test_each_leg_is_its_own_difference_of_times() -> None:
    sent = {"a": 10.0, "b": 10.5}
    received = {"a": 10.02, "b": 10.53}  # paho's callback in the worker
    published = {"a": 11.32, "b": 11.90}  # handed to paho, after the commit
    replies = {
        "a": (11.33, {"latency": {"queueMs": 100.0, "totalMs": 1250.0}}),
        "b": (11.95, {"latency": {"queueMs": 40.0, "totalMs": 1300.0}}),
    }
    out = legs(sent, received, published, replies)
    assert out["way in"] == pytest.approx([0.02, 0.03])
    assert out["queue"] == pytest.approx([0.1, 0.04])
    assert out["commit"] == pytest.approx([0.05, 0.07])  # published less received less the worker's total
    assert out["way back"] == pytest.approx([0.01, 0.05])
    assert out["outside"] == pytest.approx([0.08, 0.15])  # the three outside the worker's total
    assert out["at the engine"] == pytest.approx([0.12, 0.57])  # after the first request was sent
