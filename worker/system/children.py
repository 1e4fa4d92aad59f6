"""The engine's child processes never outlive the worker.

vLLM runs its engine core (and, with its multiprocessing executor, the model workers) in
child processes. When the worker is killed with SIGKILL they keep running, holding the GPU's
memory (measured: EngineCore and its Worker still alive 40 s later); a restarted worker then
finds no memory. Under systemd ``KillMode=control-group`` kills them; started any other way
(a shell, a container, a test) nothing would.

So each of those processes asks the kernel for SIGKILL when its parent dies (Linux
``prctl(PR_SET_PDEATHSIG)``). Only the child itself can ask, and vLLM runs none of our code
there, except the logging handler it builds from ``VLLM_LOGGING_CONFIG_PATH`` as it starts
(logs.py points it at ours): the handler calls ``die_with_parent``.

The signal comes when the *thread* that started the child exits, not the process: vLLM
starts the engine core from the thread that creates its AsyncLLM (the worker's main thread,
where the event loop runs: keep it there, never in ``asyncio.to_thread``), and the engine
core starts its workers from its own main thread.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from loguru import logger

# The pid of the process whose death must end this one, inherited through the environment:
# each guarded process sets it to its own pid for the children it starts in turn.
PARENT_ENV = "MQTT_WORKER_PARENT_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def expect_children() -> None:
    """In the worker, before vLLM starts anything: the engine's processes die with this one."""
    os.environ[PARENT_ENV] = str(os.getpid())


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent (thread) exits.
    False where that is not possible (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent() -> None:
    """In a process the worker's engine started: SIGKILL this process when its parent dies.
    A no-op in the worker itself and in processes not started under a worker."""
    expected = os.environ.get(PARENT_ENV)
    if not expected or expected == str(os.getpid()):
        return
    if not set_parent_death_signal(signal.SIGKILL):
        logger.warning("Cannot tie this process's life to its parent's (prctl unavailable)")
        return
    if str(os.getppid()) != expected:
        # The parent died before the kernel was asked: no signal will come.
        logger.error("Parent process {} is gone: exiting", expected)
        os._exit(1)
    os.environ[PARENT_ENV] = str(os.getpid())
