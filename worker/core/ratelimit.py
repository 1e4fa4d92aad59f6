"""Requests per user namespace per minute: a token bucket per namespace, in memory, no I/O.

A namespace's bucket holds up to ``per_minute`` tokens and refills at ``per_minute / 60``
a second; a request takes one. Counting per namespace (not per session) means inventing
new sessions does not get around it. A bucket that has refilled completely carries no
information, so it is forgotten: memory is bounded by the namespaces active in the last
minute, and ``max_namespaces`` bounds even that (the least recently used is dropped first,
which can only err in the client's favour)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class RateLimiter:
    def __init__(
        self, per_minute: int, *, max_namespaces: int = 100_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.per_minute = per_minute
        self.max_namespaces = max_namespaces
        self._clock = clock
        self._rate = per_minute / 60.0  # tokens a second
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # namespace: (tokens, at)

    def __len__(self) -> int:
        return len(self._buckets)

    def allow(self, namespace: str) -> bool:
        """Take one token of the namespace's bucket: False when it has none (rate limited).
        Always True when the limit is off (0)."""
        if self.per_minute <= 0:
            return True
        now = self._clock()
        self._forget_full(now)
        tokens, at = self._buckets.pop(namespace, (float(self.per_minute), now))
        tokens = min(float(self.per_minute), tokens + (now - at) * self._rate)
        allowed = tokens >= 1.0
        if allowed:
            tokens -= 1.0
        self._buckets[namespace] = (tokens, now)  # most recently used last
        while len(self._buckets) > self.max_namespaces:
            self._buckets.popitem(last=False)
        return allowed

    def retry_after(self, namespace: str) -> float:
        """Seconds until the namespace has a token again (0 when it has one)."""
        if self.per_minute <= 0 or namespace not in self._buckets:
            return 0.0
        tokens, at = self._buckets[namespace]
        tokens = min(float(self.per_minute), tokens + (self._clock() - at) * self._rate)
        return max(0.0, (1.0 - tokens) / self._rate)

    def _forget_full(self, now: float) -> None:
        """Drop the least recently used buckets that have refilled completely: a full bucket
        is the same as none. Buckets are in order of last use, so the scan stops at the first
        one still refilling."""
        full_after = self.per_minute / self._rate  # a bucket refills from empty in this long
        while self._buckets:
            namespace, (_tokens, at) = next(iter(self._buckets.items()))
            if now - at < full_after:
                break
            del self._buckets[namespace]
