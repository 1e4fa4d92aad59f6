"""A redis-server the caller owns (its PID, its port, its files), for the tests and the
benchmarks."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from .net import free_port
from .waiting import PATIENCE


class RedisServer:
    """Debian's redis-server (or ``binary``) on a free loopback port, its files in workdir;
    its caller owns its PID. No RDB snapshots. ``appendonly=True`` (the tests): append-only
    file on (fsync every second), as docs/scaling.md recommends; the benchmarks turn it off,
    and ``log=False`` leaves out the log file."""

    def __init__(self, workdir: Path, *, binary: str | None = None, appendonly: bool = True, log: bool = True) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.binary = binary
        self.appendonly = appendonly
        self.logging = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = self.binary or shutil.which("redis-server") or "/usr/bin/redis-server"
        if not Path(binary).exists():
            raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir), "--save", ""]
        args += ["--appendonly", "yes" if self.appendonly else "no"]
        if self.logging:
            args += ["--logfile", str(self.workdir / "redis.log")]
        self.proc = subprocess.Popen([binary, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + PATIENCE  # a loaded machine's start, not a fixed 10 s
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server ({binary}) exited at start") from None
                time.sleep(0.05)
        raise RuntimeError(f"redis-server ({binary}) did not start listening")

    def commands(self) -> int:
        """The commands the server has processed so far (its INFO stats)."""
        import redis

        client = redis.Redis(port=self.port)
        try:
            return int(client.info("stats")["total_commands_processed"])
        finally:
            client.close()

    def taken(self, streams: str, group: str = "workers") -> list[bytes]:
        """The payloads of the entries of the streams whose keys match ``streams`` (a glob) that
        a consumer of ``group`` has read and not acknowledged yet: the requests a worker has
        taken. Which ones, not how many: an earlier request whose answer is out stays pending
        until the worker has the broker's acknowledgement of that answer."""
        import redis

        client: Any = redis.Redis(port=self.port)  # redis-py's sync types are a union with its async ones
        try:
            payloads = []
            for key in client.scan_iter(match=streams):
                for pending in client.xpending_range(key, group, min="-", max="+", count=1000):
                    for _, fields in client.xrange(key, pending["message_id"], pending["message_id"]):
                        payloads.append(bytes(fields[b"payload"]))
            return payloads
        finally:
            client.close()

    def entries(self, streams: str) -> int:
        """The entries left in the streams whose keys match ``streams`` (a glob): the intake
        deletes an entry once its request is answered, so 0 is "every request taken in was
        answered"."""
        import redis

        client = redis.Redis(port=self.port)
        try:
            return sum(int(client.xlen(key)) for key in client.scan_iter(match=streams))
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
