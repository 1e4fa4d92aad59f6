"""What a benchmark phase starts and measures with: the broker, Redis, a worker process (the
tests' launcher, devtools/worker_process.py, with a progress bar of its start), and the
per-request decode rate."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from devtools.mosquitto import Mosquitto
from devtools.redis_server import RedisServer
from devtools.worker_process import WorkerProcess

from .common import Record, summarize
from .startbar import StartBar

# How long a benchmark worker may take to come online (a 32B model's first start on a GPU:
# load, compile, CUDA graphs, warm-up, takes minutes) and to stop (its drain, the engine's
# shutdown).
START_TIMEOUT = 900
STOP_TIMEOUT = 120


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


def start_worker(
    args: list[str],
    port: int,
    log: Path,
    *,
    worker_id: str = "bench",
    env: dict[str, str] | None = None,
    wait: bool = True,
) -> WorkerProcess:
    """``python -m worker`` on the benchmark's broker, its log appended to ``log``; with
    ``wait``, once it is online (``start_to_ready_s``: from its start to its online status).
    Several start at once (one per GPU) with ``wait=False`` and then ``wait_ready`` each."""
    # One user (bench) sends everything: the per-user rate limit is off.
    limit_off = ["--max-requests-per-user-per-minute", "0"]
    cmd = ["--mqtt-port", str(port), "--worker-id", worker_id, *limit_off, *args]
    worker = WorkerProcess(cmd, log, env, status=(port, f"chat/_worker/{worker_id}/status"), append=True)
    if wait:
        wait_ready(worker)
    return worker


def wait_ready(worker: WorkerProcess) -> float:
    """Until the worker is online, with a progress bar of its start from its log; the seconds
    from its start to its online status."""
    progress = StartBar(worker.log_path, offset=worker.log_offset)
    try:
        seconds = worker.wait_online(START_TIMEOUT, progress=progress.poll)
        # "online" comes with the connection, the log's "Serving" with the SUBACK: the bar's end.
        settle = time.perf_counter() + 5
        while not progress.poll() and time.perf_counter() < settle:
            time.sleep(0.05)
    finally:
        progress.close()
    return seconds


def timed(run: Callable[[], list[Record]]) -> dict[str, Any]:
    """One run's records and their summary over its wall time."""
    started = time.perf_counter()
    records = run()
    return {"summary": summarize(records, time.perf_counter() - started), "records": records}


def decode_rate(record: Record) -> float | None:
    """Decode tokens/s of one request, by the worker's own clock (first token to reply)."""
    decoding_ms = (record.worker_total_ms or 0) - (record.worker_ttft_ms or 0)
    return round((record.completion_tokens - 1) / (decoding_ms / 1000), 1) if decoding_ms > 0 else None
