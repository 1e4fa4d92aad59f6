"""systemd's notify protocol (``Type=notify``), spoken directly: no dependency.

A message is one datagram of ``KEY=value`` lines sent to the AF_UNIX socket named by
``$NOTIFY_SOCKET`` (a leading ``@`` names Linux's abstract namespace). Without the variable
(not under systemd) every call is a no-op. What the worker sends and when:

- ``EXTEND_TIMEOUT_USEC`` every few seconds while the model loads, from a thread: vLLM's
  engine start blocks the event loop for as long as the load takes (minutes for a large model
  on a cold cache), longer than a start timeout that should catch a hung start.
- ``READY=1`` once the engine is loaded and the broker has acknowledged the subscriptions:
  from then on a published request is delivered.
- ``WATCHDOG=1`` every half ``$WATCHDOG_USEC``, from the event loop, only while a health check
  passes; a stuck loop or a failed check stops the pings and systemd restarts the worker.
- ``STATUS=...`` lines along the way, and ``STOPPING=1`` when the stop begins.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, MutableMapping

from loguru import logger

# While the model loads: an extension of EXTEND s sent every EVERY s, so one lost or late
# message does not end the start. A load still running after LIMIT s is taken as hung: the
# extensions stop and systemd's start timeout ends it.
EXTEND_EVERY = 10.0
EXTEND_BY = 30.0
EXTEND_LIMIT = 1800.0


class Notifier:
    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        if address and address.startswith("@"):
            address = "\0" + address[1:]  # the abstract namespace
        elif address and not address.startswith("/"):
            # systemd also knows vsock:... addresses (virtual machines); not used here.
            logger.warning("NOTIFY_SOCKET {!r} is not a path or an abstract socket: not notifying", address)
            address = None
        self.address = address or None
        # systemd expects a ping within WATCHDOG_USEC; pinging at half leaves a margin.
        self.watchdog_interval = watchdog_usec / 2e6 if self.address and watchdog_usec else None
        self._socket: socket.socket | None = None
        self._failed = False
        self._lock = threading.Lock()  # the extension thread and the event loop both send

    @classmethod
    def from_environment(cls, environ: MutableMapping[str, str] | None = None) -> Notifier:
        """The notifier systemd asked for. The variables are removed, so the engine's child
        processes do not inherit them: a library there could otherwise notify in our name."""
        env = os.environ if environ is None else environ
        address = env.pop("NOTIFY_SOCKET", None)
        usec_text = env.pop("WATCHDOG_USEC", None)
        pid_text = env.pop("WATCHDOG_PID", None)
        usec: int | None = None
        if usec_text and (not pid_text or pid_text == str(os.getpid())):  # else meant for another process
            try:
                usec = int(usec_text)
            except ValueError:
                logger.warning("WATCHDOG_USEC={!r} is not a number: no watchdog pings", usec_text)
        return cls(address, usec if usec and usec > 0 else None)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *assignments: str) -> bool:
        """Send ``KEY=value`` assignments in one datagram; False if not sent. A failure is
        logged once and never raised: notifying must not stop the worker."""
        if self.address is None:
            return False
        data = "\n".join(assignments).encode()
        with self._lock:
            try:
                if self._socket is None:
                    self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._socket.sendto(data, self.address)
            except OSError as exc:
                if not self._failed:
                    logger.warning("systemd notification failed ({}): {}", exc, data.decode(errors="replace"))
                self._failed = True
                return False
        return True

    def status(self, text: str) -> None:
        self.send(f"STATUS={text}")

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}")

    def stopping(self, status: str) -> None:
        self.send("STOPPING=1", f"STATUS={status}")

    def extend_timeout(self, seconds: float) -> None:
        self.send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    @contextlib.contextmanager
    def extending_timeout(
        self, every: float = EXTEND_EVERY, extension: float = EXTEND_BY, limit: float = EXTEND_LIMIT
    ) -> Iterator[None]:
        """Keep extending systemd's start timeout while the block runs. A thread sends: the
        block may hold the event loop (vLLM's engine start does)."""
        if not self.enabled:
            yield
            return
        done = threading.Event()

        def extend() -> None:
            deadline = time.monotonic() + limit
            while time.monotonic() < deadline:
                self.extend_timeout(extension)
                if done.wait(every):
                    return
            logger.warning("Still loading after {:.0f} s: no longer extending systemd's start timeout", limit)

        thread = threading.Thread(target=extend, name="systemd-extend-timeout", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    async def watchdog_forever(self, health: Callable[[], str | None]) -> None:
        """Ping systemd's watchdog while ``health()`` returns None (healthy); it returns what
        is wrong otherwise, and the pings stop so that systemd restarts the worker. Runs on
        the event loop, so a blocked loop stops the pings too."""
        if self.watchdog_interval is None:
            return
        reported: str | None = None
        while True:
            problem = health()
            if problem is None:
                self.send("WATCHDOG=1")
            elif problem != reported:
                logger.error("Unhealthy, withholding systemd's watchdog ping: {}", problem)
                self.status(f"Unhealthy: {problem}")
            reported = problem
            await asyncio.sleep(self.watchdog_interval)
