"""Logging: loguru, configured here and nowhere else.

vLLM, paho and transformers log through the standard ``logging`` module; an intercepting
handler routes their records into loguru so that one sink, one format and one level apply.
"""

from __future__ import annotations

import logging
import sys

from loguru import logger

FORMAT = "{time:YYYY-MM-DD HH:mm:ss.SSS} | {level: <7} | {name}: {message}"


class InterceptHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            level: str | int = logger.level(record.levelname).name
        except ValueError:
            level = record.levelno
        logger.opt(depth=6, exception=record.exc_info).bind(name=record.name).log(level, record.getMessage())


def configure_logging(level: str = "INFO", *, json_logs: bool = False) -> None:
    logger.remove()
    logger.configure(patcher=lambda record: record["extra"].setdefault("name", record["name"]))
    logger.add(
        sys.stderr,
        level=level,
        serialize=json_logs,
        format=FORMAT.replace("{name}", "{extra[name]}"),
        backtrace=False,
        diagnose=False,
    )
    logging.basicConfig(handlers=[InterceptHandler()], level=0, force=True)
    logging.getLogger().setLevel("DEBUG" if level == "TRACE" else level)
    route_library_logging()


def route_library_logging() -> None:
    """vLLM installs its own handler on its logger when imported: remove it so its records
    propagate to ours, once. Call again after importing vLLM."""
    for name in ("vllm", "paho", "transformers"):
        std = logging.getLogger(name)
        std.handlers = []
        std.propagate = True
