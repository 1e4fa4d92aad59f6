"""The engine tier's workers: the session's shared worker on the tiny model (one engine start,
~50 s, for every test that can share it) and the real small model's worker, each started the
first time a test asks for it and stopped at the end of the session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools.mosquitto import Mosquitto
from devtools.net import free_port
from devtools.worker_process import BLOCK_SIZE, REAL_PREFIX, WorkerProcess, engine_args, serving


@pytest.fixture(scope="session")
def shared_metrics_port() -> int:
    """The shared worker's Prometheus endpoint (tests/engine/test_metrics.py scrapes it)."""
    return free_port()


@pytest.fixture(scope="session")
def shared_worker(
    tiny_model: Path, broker: Mosquitto, tmp_path_factory: pytest.TempPathFactory, shared_metrics_port: int
) -> Iterator[WorkerProcess]:
    """One worker for every end-to-end test that can share it (an engine start costs ~50 s)."""
    workdir = tmp_path_factory.mktemp("worker")
    log = workdir / "worker.log"
    worker = WorkerProcess(
        [
            *engine_args(tiny_model),
            "--mqtt-port",
            str(broker.port),
            "--worker-id",
            "shared",
            "--stats-interval",
            "1",
            "--metrics-port",
            str(shared_metrics_port),
            "--max-history-turns",
            "6",
            "--state-dir",
            str(workdir / "state"),
            # vLLM's own INFO lines (off by default): test_e2e.py checks they are routed.
            "--vllm-log-level",
            "INFO",
            # The warm-up's code path in CI (auto is off on the CPU backend), small: batches 1-4.
            "--warmup",
            "on",
            "--warmup-max-batch",
            "4",
            # vLLM's frontend in a process of its own (auto is off on the CPU backend): every
            # test on this worker runs through engine/remote.py; the other workers run it in
            # their own process, the CPU default.
            "--frontend-process",
            "on",
        ],
        log,
        status=(broker.port, "chat/_worker/shared/status"),
    )
    with serving(worker):
        yield worker


@pytest.fixture(scope="session")
def real_worker(
    real_model: Path, broker: Mosquitto, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    """One worker on the real model for every test that needs replies that mean something,
    started the first time one runs, on the topic prefix REAL_PREFIX."""
    workdir = tmp_path_factory.mktemp("real-worker")
    worker = WorkerProcess(
        [
            "--model",
            str(real_model),
            # This model goes astray in vLLM's bfloat16 on the CPU (worker/prepare_model.py).
            "--dtype",
            "float32",
            "--enforce-eager",
            "--block-size",
            str(BLOCK_SIZE),
            "--max-model-len",
            "2048",
            "--max-num-seqs",
            "8",
            # A fixed 256 MiB KV cache (5,800 float32 tokens of this model) instead of a share
            # of memory: vLLM's CPU backend refuses to start when that share, less what its
            # process already holds, is not free on the NUMA node, which other test workers
            # alive in the same session make likely.
            "--engine-extra",
            '{"kv_cache_memory_bytes": 268435456}',
            "--mqtt-port",
            str(broker.port),
            "--worker-id",
            "real",
            "--topic-prefix",
            REAL_PREFIX,
            "--state-dir",
            str(workdir / "state"),
        ],
        workdir / "worker.log",
        status=(broker.port, f"{REAL_PREFIX}/_worker/real/status"),
    )
    with serving(worker):
        yield worker


@pytest.fixture(scope="module")
def workers() -> Iterator[list[WorkerProcess]]:
    """The workers a module starts (tests that kill and restart them); whatever a failing test
    leaves running is stopped at the module's end."""
    started: list[WorkerProcess] = []
    yield started
    for worker in started:
        worker.stop(timeout=10)
