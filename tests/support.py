"""Real parts for the tests: a mosquitto broker the test owns, a worker process group, and a
plain paho client that records what it receives."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from worker.transport.mqtt import set_tcp_nodelay

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def mosquitto_binary() -> str:
    found = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None)
    if not found:
        raise RuntimeError("mosquitto is not installed (apt-get install -y mosquitto mosquitto-clients)")
    return found


def password_file(path: Path, passwords: dict[str, str]) -> Path:
    """A mosquitto password file (salted hashes, made by mosquitto_passwd) for these users."""
    for i, (user, password) in enumerate(passwords.items()):
        create = ["-c"] if i == 0 else []
        subprocess.run(["mosquitto_passwd", "-b", *create, str(path), user, password], check=True, capture_output=True)
    return path


class Mosquitto:
    """A broker on a free loopback port with a generated config; the test owns its PID.

    Started as root, mosquitto drops to the user ``mosquitto``, which cannot write into
    pytest's 0700 temporary directories: its log and its persistence file are then never
    written (it keeps running). ``keep_root=True`` adds ``user root`` so that both are (no
    effect when not run as root). Only brokers that restart need it: a broker that saves its
    database after every change doubles the time of the flood test.
    ``autosave``: "changes" saves after every change (``autosave_on_changes true``,
    ``autosave_interval 1``), "default" leaves mosquitto's default (every 1800 s, and on a
    clean exit).
    ``websockets=True`` adds a MQTT-over-WebSockets listener on loopback (``ws_port``), as
    docs/frontend.md configures it: ``listener PORT lo`` (mosquitto 2.0.11's WebSockets
    listener takes an interface name; an IP address there is ignored and it binds to every
    interface) beside the plain listener (a broker with only a WebSockets listener exits with
    "Unable to start any listening sockets")."""

    def __init__(
        self,
        workdir: Path,
        extra_config: str = "",
        *,
        keep_root: bool = False,
        autosave: Literal["changes", "default"] = "changes",
        websockets: bool = False,
    ) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.ws_port = free_port() if websockets else None
        self.extra_config = extra_config
        self.keep_root = keep_root
        self.autosave = autosave
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = workdir / "mosquitto.log"

    def config_text(self) -> str:
        autosave = "autosave_on_changes true\nautosave_interval 1\n" if self.autosave == "changes" else ""
        websockets = f"listener {self.ws_port} lo\nprotocol websockets\n" if self.ws_port else ""
        return (
            f"listener {self.port} 127.0.0.1\n{websockets}allow_anonymous true\npersistence true\n"
            f"persistence_location {self.workdir}/\n{autosave}"
            "set_tcp_nodelay true\nmax_inflight_messages 0\n"  # docs/protocol.md, "Broker settings"
            "max_queued_messages 100000\n"  # the default 1000 drops the rest of a flood of requests
            f"log_dest file {self.log}\nlog_type all\n" + ("user root\n" if self.keep_root else "") + self.extra_config
        )

    def start(self) -> None:
        conf = self.workdir / "mosquitto.conf"
        conf.write_text(self.config_text())
        self.proc = subprocess.Popen(
            [mosquitto_binary(), "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    log = self.log.read_text() if self.log.exists() else ""
                    raise RuntimeError(f"mosquitto exited: {log}") from None
                time.sleep(0.05)
        raise RuntimeError("mosquitto did not start listening")

    def stop(self) -> None:
        """SIGTERM (a paused broker is resumed first): mosquitto saves its database and exits."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            self.proc.wait(10)

    def kill(self) -> None:
        """SIGKILL: whatever it had not saved yet is lost."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self) -> None:
        """Start again on the same port with the same config and persistence file (after
        stop() or kill())."""
        assert self.proc is None or self.proc.poll() is not None, "the broker is still running"
        self.start()

    def pause(self) -> None:
        """SIGSTOP: the broker freezes; its sockets stay open, so clients notice only by
        their keepalive."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)


class RedisServer:
    """Debian's redis-server on a free loopback port, its files in workdir; the test owns its
    PID. Append-only file on (fsync every second), as docs/scaling.md recommends."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        if not Path(binary).exists():
            raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir), "--save", ""]
        args += ["--appendonly", "yes", "--logfile", str(self.workdir / "redis.log")]
        self.proc = subprocess.Popen([binary, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError("redis-server exited at start") from None
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start listening")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@dataclass
class Received:
    topic: str
    payload: bytes
    retain: bool
    properties: Any

    def json(self) -> Any:
        return json.loads(self.payload)


class Client:
    """A chat frontend: publishes requests, records everything it receives."""

    def __init__(
        self,
        port: int,
        subscriptions: Sequence[str] = ("chat/#",),
        client_id: str = "",
        login: tuple[str, str] | None = None,
    ) -> None:
        self.messages: queue.Queue[Received] = queue.Queue()
        self.seen: list[Received] = []
        self._client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        if login is not None:
            self._client.username_pw_set(*login)
        self._client.on_message = lambda c, u, m: self.messages.put(
            Received(m.topic, bytes(m.payload), bool(m.retain), m.properties)
        )
        self._client.connect("127.0.0.1", port, keepalive=30)
        set_tcp_nodelay(self._client)
        self._client.loop_start()
        for topic in subscriptions:
            result, _ = self._client.subscribe(topic, qos=1)
            assert result == mqtt.MQTT_ERR_SUCCESS
        time.sleep(0.2)  # let the SUBACKs arrive before the first publish

    def publish(self, topic: str, payload: Any, *, qos: int = 1, properties: Any = None) -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        info = self._client.publish(topic, data, qos=qos, properties=properties)
        info.wait_for_publish(5)

    def wait_for(self, predicate: Callable[[Received], bool], timeout: float = 120) -> Received:
        """The first message (already seen or arriving) that satisfies predicate."""
        for message in self.seen:
            if predicate(message):
                self.seen.remove(message)
                return message
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"no matching message within {timeout}s; unmatched: "
                    f"{[(m.topic, m.payload[:200]) for m in self.seen][-10:]}"
                )
            try:
                message = self.messages.get(timeout=remaining)
            except queue.Empty:
                continue
            if predicate(message):
                return message
            self.seen.append(message)

    def wait_topic(self, topic: str, timeout: float = 120) -> Received:
        return self.wait_for(lambda m: m.topic == topic, timeout)

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()


class WorkerProcess:
    """``python -m worker`` in its own process group (vLLM's engine runs in children that
    could outlive a killed parent: the whole group is killed)."""

    def __init__(
        self,
        args: Sequence[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        *,
        wrapper: Sequence[str] = (),
        cwd: Path = REPO,
    ) -> None:
        """``wrapper``: a command line the worker runs under (a sandbox)."""
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(
            [*wrapper, sys.executable, "-m", "worker", *args],
            cwd=cwd,
            env=full_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM, wait, then SIGKILL the whole group. The worker's exit code."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        self.signal_group(signal.SIGKILL)
        code = self.proc.wait(10)
        self._log.close()
        return code


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

    def wait_for(self, line: str, timeout: float) -> float:
        """The time the first message carrying ``line`` arrived (waiting up to ``timeout``)."""
        deadline = time.monotonic() + timeout
        while not self.times(line):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {line!r} within {timeout}s; received {self.lines()[-20:]}")
            time.sleep(0.02)
        return self.times(line)[0]

    def close(self) -> None:
        self._closed = True
        self._thread.join(1)
        self._sock.close()


@contextlib.contextmanager
def serving(worker: WorkerProcess, port: int, status_topic: str) -> Iterator[WorkerProcess]:
    """The worker once its retained status is online; stopped after, which must be clean."""
    watcher = Client(port, [status_topic])
    try:
        watcher.wait_for(lambda m: m.payload == b"online", timeout=300)
    except TimeoutError:
        worker.stop(5)
        raise RuntimeError(f"worker did not come online; its log:\n{worker.log()[-6000:]}") from None
    finally:
        watcher.close()
    yield worker
    code = worker.stop()
    log = worker.log()
    print(log[-3000:])
    assert code == 0, f"worker exited with {code}"
    assert "Traceback" not in log[log.find("Stopping") :], "a clean stop logged a traceback"
