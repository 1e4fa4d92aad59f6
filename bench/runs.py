"""What a benchmark phase starts and measures with: the broker, Redis, a worker process (its
start-to-ready time, its memory), and the per-request decode rate."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from devtools.mosquitto import Mosquitto
from devtools.redis_server import RedisServer

from .common import REPO, Record, summarize
from .startbar import StartBar


def start_broker(binary: str, workdir: Path, extra_config: str = "") -> Mosquitto:
    """The benchmarks' mosquitto, started: the tests' broker without persistence or a log
    (nothing written to disk while it is measured)."""
    broker = Mosquitto(workdir, extra_config, binary=binary, persistence=False, log=False)
    broker.start()
    return broker


def start_redis(binary: str | None, workdir: Path) -> RedisServer:
    """The benchmarks' redis-server (``binary``, or Debian's), started: no persistence, no log."""
    server = RedisServer(workdir, binary=binary, appendonly=False, log=False)
    server.start()
    return server


class WorkerRun:
    """``python -m worker`` in its own process group; start-to-ready measured by its status.
    Several start at once (one per GPU) with ``wait=False`` and then ``wait_ready()`` each."""

    def __init__(
        self,
        args: list[str],
        port: int,
        log: Path,
        *,
        worker_id: str = "bench",
        env: dict[str, str] | None = None,
        wait: bool = True,
    ) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        self._online: list[float] = []
        self.log_path = log
        self._watcher = watcher = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        watcher.on_message = lambda c, u, m: m.payload == b"online" and self._online.append(time.perf_counter())
        watcher.connect("127.0.0.1", port)
        watcher.loop_start()
        watcher.subscribe(f"chat/_worker/{worker_id}/status", qos=1)
        time.sleep(0.3)
        self._started = time.perf_counter()
        self.log = open(log, "ab")  # noqa: SIM115 - closed in stop()
        # One user (bench) sends everything: the per-user rate limit is off.
        limit_off = ["--max-requests-per-user-per-minute", "0"]
        cmd = [sys.executable, "-m", "worker", "--mqtt-port", str(port), "--worker-id", worker_id, *limit_off, *args]
        self._log_offset = self.log.tell()  # the log may hold earlier starts
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        progress = StartBar(self.log_path, offset=self._log_offset)
        try:
            while not self._online:
                progress.poll()
                if self.proc.poll() is not None:
                    raise RuntimeError(f"worker exited with {self.proc.returncode}; see {self.log_path}")
                if time.perf_counter() - self._started > 900:
                    raise RuntimeError(f"worker not online after 900 s; see {self.log_path}")
                time.sleep(0.1)
            # "online" comes with the connection, the log's "Serving" with the SUBACK: the bar's end.
            settle = time.perf_counter() + 5
            while not progress.poll() and time.perf_counter() < settle:
                time.sleep(0.05)
        finally:
            progress.close()
        self.start_to_ready_s = round(self._online[0] - self._started, 1)
        self._watcher.disconnect()
        self._watcher.loop_stop()

    def rss_mb(self) -> dict[str, float]:
        import psutil

        main = psutil.Process(self.proc.pid)
        children = main.children(recursive=True)
        total = main.memory_info().rss + sum(c.memory_info().rss for c in children if c.is_running())
        return {"worker_rss_mb": round(main.memory_info().rss / 2**20, 1), "total_rss_mb": round(total / 2**20, 1)}

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(120)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


def timed(run: Callable[[], list[Record]]) -> dict[str, Any]:
    """One run's records and their summary over its wall time."""
    started = time.perf_counter()
    records = run()
    return {"summary": summarize(records, time.perf_counter() - started), "records": records}


def decode_rate(record: Record) -> float | None:
    """Decode tokens/s of one request, by the worker's own clock (first token to reply)."""
    decoding_ms = (record.worker_total_ms or 0) - (record.worker_ttft_ms or 0)
    return round((record.completion_tokens - 1) / (decoding_ms / 1000), 1) if decoding_ms > 0 else None
