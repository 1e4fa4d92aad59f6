"""A mosquitto broker the caller owns (its PID, its port, its config), for the tests and the
benchmarks, and mosquitto's password files."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Literal

from .net import free_port
from .waiting import PATIENCE


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
    """A broker on a free loopback port with a generated config; its caller owns its PID.

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
    "Unable to start any listening sockets").

    The benchmarks' broker (bench/harness.py ``start_broker``) is this one with
    ``persistence=False`` and ``log=False``: nothing written to disk while it is measured,
    and ``binary``, a mosquitto the run names (on the GPU machine a carried bundle, whose own
    libraries beside it are put on ``LD_LIBRARY_PATH``)."""

    def __init__(
        self,
        workdir: Path,
        extra_config: str = "",
        *,
        keep_root: bool = False,
        autosave: Literal["changes", "default"] = "changes",
        websockets: bool = False,
        persistence: bool = True,
        log: bool = True,
        binary: str | None = None,
    ) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.ws_port = free_port() if websockets else None
        self.extra_config = extra_config
        self.keep_root = keep_root
        self.autosave = autosave
        self.persistence = persistence
        self.logging = log
        self.binary = binary
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = workdir / "mosquitto.log"

    def config_text(self) -> str:
        autosave = "autosave_on_changes true\nautosave_interval 1\n" if self.autosave == "changes" else ""
        websockets = f"listener {self.ws_port} lo\nprotocol websockets\n" if self.ws_port else ""
        persistence = f"persistence true\npersistence_location {self.workdir}/\n{autosave}" if self.persistence else ""
        log = f"log_dest file {self.log}\nlog_type all\n" if self.logging else ""
        return (
            f"listener {self.port} 127.0.0.1\n{websockets}allow_anonymous true\n{persistence}"
            "set_tcp_nodelay true\nmax_inflight_messages 0\n"  # docs/protocol.md, "Broker settings"
            "max_queued_messages 100000\n"  # the default 1000 drops the rest of a flood of requests
            f"{log}" + ("user root\n" if self.keep_root else "") + self.extra_config
        )

    def start(self) -> None:
        conf = self.workdir / "mosquitto.conf"
        conf.write_text(self.config_text())
        env = None
        if self.binary is not None:
            lib = Path(self.binary).resolve().parent.parent / "lib"
            if lib.is_dir():  # a carried bundle (the GPU machine): its own libraries
                env = {**os.environ, "LD_LIBRARY_PATH": f"{lib}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
        self.proc = subprocess.Popen(
            [self.binary or mosquitto_binary(), "-c", str(conf)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + PATIENCE  # a loaded machine's start, not a fixed 10 s
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
