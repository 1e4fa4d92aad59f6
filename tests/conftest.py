from __future__ import annotations

import os
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
    from worker.tinymodel import generate_tiny_model

    return generate_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tokenizer(tiny_model: Path):  # type: ignore[no-untyped-def]
    from worker.tokenizer import ChatTokenizer

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
    """The CPU engine settings every test worker uses: small, eager, 32-token blocks."""
    return [
        "--model",
        str(model),
        "--enforce-eager",
        "--block-size",
        str(BLOCK_SIZE),
        "--gpu-memory-utilization",
        "0.3",
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
        ],
        log,
    )
    with serving(worker, broker.port, "chat/_worker/shared/status"):
        yield worker


@pytest.fixture
def client(broker: Mosquitto) -> Iterator[Client]:
    chat_client = Client(broker.port, ["chat/+/+/reply", "chat/+/+/stream", "chat/_worker/+/stats"])
    yield chat_client
    chat_client.close()
