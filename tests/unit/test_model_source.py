"""A ``--model`` the worker cannot find fails in seconds, with one message that says what was
looked for and what to do, and exit code 2: a path that does not exist, a hub id that is not
in the Hugging Face cache while downloads are off, a hub that cannot be reached or has no such
model. (Before: 57 s of the hub's retries, doubled warnings and an ``OSError`` traceback.)

``python -m worker`` runs as a user runs it, without a broker: the model is checked before the
broker. The hub is a real HTTP server on loopback named by ``HF_ENDPOINT`` (this machine
reaches no hub: a server is the only way to show its answers), or a port nothing listens on."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools import REPO
from devtools.net import free_port
from devtools.waiting import PATIENCE
from worker.config.loader import ConfigError, cached_hub_model, load_config

# Generous: the old failure took 57 s; this one takes about a second (Python's start, the
# config check, a refused connection), more on a busy machine.
FAST = 20.0
HUB_ID = "SomeOrg/Name"


def run_worker(*args: str, env: dict[str, str]) -> tuple[int, str, float]:
    """``python -m worker ARGS`` without any HF_* or WORKER_* of this process: exit code, stderr, seconds."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_", "WORKER_"))}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "worker", *args],
        cwd=REPO,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=PATIENCE,
    )
    return done.returncode, done.stderr, time.monotonic() - started


def assert_one_clear_message(err: str, *, download: bool) -> None:
    assert "Traceback" not in err and "Retrying" not in err, err
    assert err.count("worker: configuration error:") == 1, err
    assert "python -m worker.prepare_model smollm2" in err, err  # the demo model, without the hub
    assert ("hf download SomeOrg/Name --local-dir DIR" in err) is download, err


def snapshot(cache: Path, repo_id: str) -> Path:
    """A model in the Hugging Face cache's layout (models--org--name/snapshots/<rev>)."""
    directory = cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / "0123abcd"
    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    return directory


class FakeHub(http.server.BaseHTTPRequestHandler):
    """The hub's model API: 404 with its RepoNotFound code for every model but "Known/Model"."""

    def do_GET(self) -> None:
        if self.path.startswith("/api/models/Known/Model"):
            body = json.dumps({"id": "Known/Model", "modelId": "Known/Model", "sha": "0" * 40}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
        else:
            body = b'{"error": "Repository not found"}'
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def hub() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_hub_id_offline_and_not_cached_fails_at_once(tmp_path: Path) -> None:
    code, err, seconds = run_worker("--model", HUB_ID, env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)})
    assert code == 2 and seconds < FAST, (code, seconds, err)
    assert_one_clear_message(err, download=True)
    # What was looked for: the directory, the cache, and why the hub was not asked.
    assert f"there is no directory {REPO / HUB_ID}" in err and f"the Hugging Face cache ({tmp_path})" in err, err
    assert "downloads from the hub are off (HF_HUB_OFFLINE)" in err, err


def test_a_hub_that_cannot_be_reached_fails_at_once(tmp_path: Path) -> None:
    nothing_listens = f"http://127.0.0.1:{free_port()}"
    code, err, seconds = run_worker(
        "--model", HUB_ID, env={"HF_ENDPOINT": nothing_listens, "HF_HUB_CACHE": str(tmp_path)}
    )
    assert code == 2 and seconds < FAST, (code, seconds, err)
    assert_one_clear_message(err, download=True)
    assert f"the hub ({nothing_listens}) cannot be reached" in err, err


def test_a_model_the_hub_does_not_have_fails_at_once(tmp_path: Path, hub: str) -> None:
    code, err, seconds = run_worker("--model", HUB_ID, env={"HF_ENDPOINT": hub, "HF_HUB_CACHE": str(tmp_path)})
    assert code == 2 and seconds < FAST, (code, seconds, err)
    assert_one_clear_message(err, download=True)
    assert "the Hugging Face hub has no such model" in err, err
    # A model the hub has passes the check (vLLM downloads it as it loads).
    code, err, _ = run_worker(
        "--model", "Known/Model", "--check-config", env={"HF_ENDPOINT": hub, "HF_HUB_CACHE": str(tmp_path)}
    )
    assert code == 0, err


def test_a_path_that_does_not_exist_fails_at_once() -> None:
    for model in ("./models/missing", "/no/such/model", "models/a/b"):
        code, err, seconds = run_worker("--model", model, env={})
        assert code == 2 and seconds < FAST, (model, code, seconds, err)
        assert_one_clear_message(err, download=False)  # a path is not downloaded
        assert "does not exist" in err, err


def test_a_cached_hub_model_is_used_offline_and_when_the_hub_cannot_be_reached(tmp_path: Path) -> None:
    cached = snapshot(tmp_path, HUB_ID)
    environ = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)}
    assert cached_hub_model(HUB_ID, environ) == cached
    config, _ = load_config(["--model", HUB_ID], environ=environ)
    assert config.engine.model == HUB_ID
    with pytest.raises(ConfigError, match="Other/Model: there is no directory"):
        load_config(["--model", "Other/Model"], environ=environ)
    # Downloads on, no hub: the cached copy, downloads turned off, without a minute of retries.
    nothing_listens = f"http://127.0.0.1:{free_port()}"
    code, err, seconds = run_worker(
        "--model", HUB_ID, "--check-config", env={"HF_ENDPOINT": nothing_listens, "HF_HUB_CACHE": str(tmp_path)}
    )
    assert code == 0 and seconds < FAST, (code, seconds, err)
    assert f"The Hugging Face hub ({nothing_listens}) cannot be reached" in err, err
    assert f"loading {HUB_ID} from the cache, downloads off" in err, err
