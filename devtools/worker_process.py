"""``python -m worker`` as the tests and the benchmark start it: in its own process group, its
log in a file, online when its retained status says so (and how long its start took);
``serving`` checks its clean stop. And the engine settings every test worker uses."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from . import REPO
from .mqtt_client import Client
from .waiting import PATIENCE, eventually

if TYPE_CHECKING:
    import psutil

BLOCK_SIZE = 32

# The real model's worker (tests/engine/conftest.py's real_worker) answers on its own topic
# prefix: the shared worker, on "chat", would answer these requests too, with the random
# model's reply.
REAL_PREFIX = "real"


def engine_args(model: Path) -> list[str]:
    """The CPU engine settings every test worker uses: small, eager, 32-token blocks, and a
    fixed 256 MiB KV cache (about 500,000 tokens of the tiny model). A share of host memory
    (--gpu-memory-utilization 0.3) gave each worker 6.45 GiB of KV cache, resident at once:
    the shared worker, the real-model worker and the two members of test_failover did not fit
    the 24 GiB machine together (the kernel's OOM killer took an engine)."""
    return [
        "--model",
        str(model),
        "--enforce-eager",
        "--block-size",
        str(BLOCK_SIZE),
        "--gpu-memory-utilization",
        "0.3",
        "--engine-extra",
        '{"kv_cache_memory_bytes": 268435456}',
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "16",
    ]


class WorkerProcess:
    """``python -m worker`` in its own process group (vLLM's engine runs in children that
    could outlive a killed parent: the whole group is killed)."""

    def __init__(
        self,
        args: Sequence[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        *,
        status: tuple[int, str] | None = None,
        wrapper: Sequence[str] = (),
        cwd: Path = REPO,
        append: bool = False,
    ) -> None:
        """``status``: the broker's port and the worker's status topic, watched from before the
        start, for ``wait_online``. ``wrapper``: a command line the worker runs under (a
        sandbox). ``append``: the log keeps what earlier starts wrote (``log_offset`` is where
        this one begins)."""
        self.log_path = log_path
        self._log = open(log_path, "ab" if append else "wb")  # noqa: SIM115 - closed in stop()
        self.log_offset = self._log.tell()
        # Subscribed before the start: the status that arrives is this start's, and when.
        self._status = Client(status[0], [status[1]]) if status is not None else None
        self.start_to_ready_s: float | None = None
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.started_at = time.perf_counter()
        self.proc = subprocess.Popen(
            [*wrapper, sys.executable, "-m", "worker", *args],
            cwd=cwd,
            env=full_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_online(self, timeout: float = 300, *, progress: Callable[[], object] | None = None) -> float:
        """Until the worker's status turns ``online`` (the broker has its connection, and its
        model is loaded and warm); the seconds from the start, also kept as
        ``start_to_ready_s``. ``progress`` is called while it waits (a progress bar). A worker
        that exits first, or is not online within ``timeout``, is stopped: RuntimeError with
        the end of its log."""
        status, self._status = self._status, None
        assert status is not None, "started without status=(port, topic), or waited for already"
        deadline = time.perf_counter() + timeout
        try:
            while True:
                if progress is not None:
                    progress()
                try:
                    # Live, not retained: a retained online is an earlier start's (one killed before its Will).
                    online = status.wait_for(lambda m: m.payload == b"online" and not m.retain, timeout=0.2)
                    break
                except TimeoutError:
                    pass
                if not self.alive() or time.perf_counter() > deadline:
                    code = self.proc.poll()
                    why = f"exited with {code}" if code is not None else f"not online after {timeout:g} s"
                    self.stop(5)
                    raise RuntimeError(f"the worker {why}; the end of its log ({self.log_path}):\n{self.tail(6000)}")
        finally:
            status.close()
        self.start_to_ready_s = round(online.at - self.started_at, 1)
        return self.start_to_ready_s

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, pattern: str, timeout: float = PATIENCE) -> re.Match[str]:
        """Until a line of this start's log matches ``pattern`` (a regular expression; the
        event), while the worker lives: AssertionError with the log's end if it exits first or
        ``timeout`` passes (waits that would never end; generous for a busy machine)."""
        return eventually(
            lambda: re.search(pattern, self.tail(10**8), re.M),
            lambda: f"no {pattern!r} in the log: {self.tail(3000)}",
            timeout,
            alive=self.alive,
        )

    def tail(self, chars: int) -> str:
        """The end of what this start logged."""
        with open(self.log_path, "rb") as fh:
            fh.seek(self.log_offset)
            return fh.read().decode(errors="replace")[-chars:]

    def rss_mb(self) -> dict[str, float]:
        """The resident memory of the worker's own process and of it with its children (the
        engine's), in MiB."""
        import psutil

        main = psutil.Process(self.proc.pid)
        children = main.children(recursive=True)
        total = main.memory_info().rss + sum(c.memory_info().rss for c in children if c.is_running())
        return {"worker_rss_mb": round(main.memory_info().rss / 2**20, 1), "total_rss_mb": round(total / 2**20, 1)}

    def engine_cores(self) -> list[psutil.Process]:
        """The worker's vLLM engine core process(es): what a test freezes (SIGSTOP) or kills."""
        import psutil

        children = psutil.Process(self.proc.pid).children(recursive=True)
        cores = [p for p in children if "EngineCore" in p.name()]
        assert cores, f"the worker has no engine core process: {[p.name() for p in children]}"
        return cores

    @contextlib.contextmanager
    def engine_frozen(self) -> Iterator[None]:
        """The worker's engine core stopped (SIGSTOP) for the block, continued after it
        (SIGCONT, also on an error): a running generation holds still for as long as a test
        needs, while the worker's own process (MQTT, the session queues, cancels) runs on."""
        cores = self.engine_cores()
        for core in cores:
            core.suspend()
        try:
            yield
        finally:
            for core in cores:
                core.resume()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM, wait, then SIGKILL the whole group. The worker's exit code."""
        if self._status is not None:
            self._status.close()  # the status was never waited for
            self._status = None
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        self.signal_group(signal.SIGKILL)
        code = self.proc.wait(10)
        self._log.close()
        return code


def gauge(metrics_port: int, name: str) -> float:
    """A worker's unlabelled ``mqtt_vllm_worker_<name>`` (its Prometheus endpoint on this port)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=PATIENCE) as response:
        text = response.read().decode()
    (line,) = [line for line in text.splitlines() if line.startswith(f"mqtt_vllm_worker_{name} ")]
    return float(line.split()[1])


def pending_requests(metrics_port: int) -> float:
    """The requests the worker has taken and not answered yet."""
    return gauge(metrics_port, "pending_requests")


@contextlib.contextmanager
def serving(worker: WorkerProcess, timeout: float = 300) -> Iterator[WorkerProcess]:
    """The worker once it is online (started with ``status``); stopped after, which must be
    clean."""
    worker.wait_online(timeout)
    yield worker
    code = worker.stop()
    log = worker.log()
    print(log[-3000:])
    assert code == 0, f"worker exited with {code}"
    assert "Traceback" not in log[log.find("Stopping") :], "a clean stop logged a traceback"
