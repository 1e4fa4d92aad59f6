"""``python -m worker`` as a test or a script starts it: in its own process group, its log in
a file; ``serving`` waits for it to be online and checks its clean stop. And the engine
settings every test worker uses."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from . import REPO
from .mqtt_client import Client

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
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        self.signal_group(signal.SIGKILL)
        code = self.proc.wait(10)
        self._log.close()
        return code


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
