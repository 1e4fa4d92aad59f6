"""The worker's start phases, told as they go, with a heartbeat while one runs.

The slow phases (the tokenizer, then vLLM's engine: weight loading, compilation, CUDA-graph
capture, which take from seconds to minutes) are logged when they begin and end, with their
duration, and while one runs a heartbeat line says it is still running and for how long; under
systemd each is also a ``STATUS=`` line (``systemctl status`` shows it). vLLM's own INFO lines
about the load and the capture come in between (logs.py routes them).

Why the heartbeat runs on a thread and not on the event loop: vLLM's engine start holds the
event loop (it waits for its engine process in a blocking poll) and must run on the main
thread (children.py: the engine's processes die with the thread that started them), so a
task on the loop would only run once the start is over. The thread belongs to one phase: it
is stopped and joined before the phase's block returns or raises, and it is a daemon thread,
so it can neither outlive the phase nor hold the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

from loguru import logger

from .notify import Notifier

HEARTBEAT_EVERY = 15.0  # seconds between "still ..." lines while a phase runs


@contextlib.contextmanager
def start_phase(
    notifier: Notifier,
    doing: str,
    done: str,
    *,
    detail: str = "",
    every: float = HEARTBEAT_EVERY,
    announce: bool = True,
) -> Iterator[None]:
    """Log ``doing`` (e.g. "Starting the engine") as the block begins, "Still <doing>: 40 s"
    every ``every`` seconds while it runs, and "<done> in 52.3 s" when it returns (or that it
    failed, when it raises: the caller reports the error; or that it stopped, when a stop
    signal cancelled it). ``detail`` is added to the first line only. Each line is also
    systemd's STATUS. ``announce=False``: the first and the last line are systemd's STATUS
    only, for a block that logs its own (the warm-up: whether it runs at all, and what it did,
    is the engine's to say; "Warming the engine up" followed by "off" and "in 0.0 s" on the CPU
    said nothing)."""
    started = time.monotonic()
    if announce:
        logger.info("{}{}", doing, f": {detail}" if detail else "")
    notifier.status(f"{doing}{f': {detail}' if detail else ''}")
    stop = threading.Event()

    def heartbeat() -> None:
        while not stop.wait(every):
            line = f"Still {doing[:1].lower()}{doing[1:]}: {time.monotonic() - started:.0f} s"
            logger.info(line)
            notifier.status(line)

    thread = threading.Thread(target=heartbeat, name="start-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    except asyncio.CancelledError:  # a stop signal during the start (server.py)
        logger.info("{}: stopped after {:.1f} s", doing, time.monotonic() - started)
        raise
    except BaseException:
        logger.warning("{} failed after {:.1f} s", doing, time.monotonic() - started)
        raise
    finally:
        stop.set()
        thread.join()
    line = f"{done} in {time.monotonic() - started:.1f} s"
    if announce:
        logger.info(line)
    notifier.status(line)
