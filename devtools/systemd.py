"""The systemd side of the worker: a ``NOTIFY_SOCKET`` listener (``Type=notify``), and the
settings of the units in systemd/."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import REPO
from .waiting import PATIENCE, eventually

SYSTEMD = REPO / "systemd"
UNIT = SYSTEMD / "mqtt-vllm-worker.service"
TEMPLATE = SYSTEMD / "mqtt-vllm-worker@.service"  # one instance per GPU: %i is the GPU index


def unit_settings(unit: Path = UNIT) -> dict[str, list[str]]:
    """A unit file's ``Key=value`` lines: each key's values in order."""
    settings: dict[str, list[str]] = {}
    for line in unit.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            settings.setdefault(key, []).append(value)
    return settings


class NotifyListener:
    """The systemd side of ``Type=notify``: a datagram socket for ``NOTIFY_SOCKET`` that
    records each message (its ``KEY=value`` lines) with the time it arrived."""

    def __init__(self, path: str) -> None:
        self.address = path  # for NOTIFY_SOCKET: a file path, or "@name" (abstract namespace)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind("\0" + path[1:] if path.startswith("@") else path)
        self._sock.settimeout(0.1)
        self.received: list[tuple[float, list[str]]] = []
        # line -> a callable run on this thread the moment a message carrying it arrives, and
        # what it returned (or raised).
        self.on_arrival: dict[str, Callable[[], Any]] = {}
        self.at_arrival: dict[str, Any] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._closed:
            try:
                data = self._sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            lines = data.decode().split("\n")
            for line in lines:
                if line in self.on_arrival and line not in self.at_arrival:
                    try:
                        self.at_arrival[line] = self.on_arrival[line]()
                    except Exception as exc:  # the test sees it; the recording goes on
                        self.at_arrival[line] = exc
            self.received.append((time.monotonic(), lines))

    def lines(self) -> list[str]:
        return [line for _, message in list(self.received) for line in message]

    def times(self, line: str) -> list[float]:
        """When each message carrying ``line`` (or, for a key ending in "=", any value) arrived."""
        return [t for t, message in list(self.received) if any(m == line or m.startswith(line) for m in message)]

    def wait_for(self, line: str, timeout: float = PATIENCE, *, count: int = 1, after: float = 0.0) -> float:
        """The time the ``count``-th message carrying ``line`` arrived after ``after`` (a
        ``time.monotonic()``), waiting up to ``timeout``."""
        times = eventually(
            lambda: [t for t in self.times(line) if t > after][count - 1 :],
            lambda: f"{count} x {line!r}; received {self.lines()[-20:]}",
            timeout,
            interval=0.02,
        )
        return times[0]

    def close(self) -> None:
        self._closed = True
        self._thread.join(1)
        self._sock.close()
