"""Free loopback ports for the brokers, servers and workers a test or a benchmark starts, and a
listener that records who connects (a URL nothing may fetch)."""

from __future__ import annotations

import socket
import threading


def free_port() -> int:
    """A TCP port free on 127.0.0.1 at the time of the call (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ConnectionRecorder:
    """A TCP listener on a free loopback port that counts every connection it gets and answers
    none (a fetch would hang, as an attacker's server would make it): ``url()`` is a URL that
    nothing may ever fetch; ``connections`` says whether something tried."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self._sock.settimeout(0.2)
        self.port = int(self._sock.getsockname()[1])
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="connection-recorder", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            conn.close()

    def url(self, path: str = "x.json") -> str:
        return f"http://127.0.0.1:{self.port}/{path}"

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()
