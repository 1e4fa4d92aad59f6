"""Waiting for an event in a test: ``eventually`` polls a condition until it holds.

CI runs the tests on a fresh 2-core machine that other jobs keep busy: an engine start there
took 3-4 times as long as on idle cores, a log line the worker writes "at once" came after
more than 30 s, and every wait that had a deadline sized for an idle machine failed sooner or
later. So a test waits for the event itself (a log line, a message, a process exit, a count),
and ``PATIENCE`` only ends a wait that would never end. A test that must show that something
did *not* happen never waits a while to see: it sends a marker after and waits for that to be
handled (what comes before it in order is then known)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# How long a test waits for an event before it gives up: generous for a busy machine (a whole
# engine start took 170 s on 2 shared cores), short of pytest's own limit.
PATIENCE = 300.0


def eventually(
    condition: Callable[[], T | None],
    what: str | Callable[[], str],
    timeout: float = PATIENCE,
    interval: float = 0.05,
    *,
    alive: Callable[[], bool] | None = None,
) -> T:
    """``condition()``'s first true value, polled every ``interval`` seconds. AssertionError
    saying ``what`` (a string, or a callable for a message built late: a log's end) once
    ``timeout`` has passed, or at once when ``alive`` says that what would make it true is
    gone (a worker that exited)."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if alive is not None and not alive():
            value = condition()  # what it did before it went
            if value:
                return value
            raise AssertionError(f"gone before: {what if isinstance(what, str) else what()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what if isinstance(what, str) else what()}")
        time.sleep(interval)
    return value
