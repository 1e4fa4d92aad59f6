"""The engine's child processes never outlive the worker.

vLLM runs its engine core (and, with its multiprocessing executor, the model workers) in
child processes. When the worker is killed with SIGKILL they keep running, holding the GPU's
memory (measured: EngineCore and its Worker still alive 40 s later); a restarted worker then
finds no memory. Under systemd ``KillMode=mixed`` kills them; started any other way
(a shell, a container, a test) nothing would.

So each of those processes asks the kernel for SIGKILL when its parent dies (Linux
``prctl(PR_SET_PDEATHSIG)``). Only the child itself can ask, and vLLM runs none of our code
there, except the logging handler it builds from ``VLLM_LOGGING_CONFIG_PATH`` as it starts
(logs.py points it at ours): the handler calls ``die_with_parent``.

The signal comes when the *thread* that started the child exits, not the process: vLLM
starts the engine core from the thread that creates its AsyncLLM (the worker's main thread,
where the event loop runs: keep it there, never in ``asyncio.to_thread``), and the engine
core starts its workers from its own main thread.

The same hook puts each of those processes in a session of its own (``setsid``). Started from
a shell, the worker and vLLM's processes were one process group, the terminal's foreground
group: Ctrl-C sent SIGINT to every one of them at once. vLLM's engine core and workers take
SIGINT as a request to exit (``run_engine_core`` and ``WorkerProc.worker_main`` install their
own handlers; a signal mask blocked in the parent does not reach a spawned child, whose mask
starts empty), so the engine died under the reply being generated, with some 60 lines of
``EngineDeadError`` tracebacks. Out of the terminal's session only the worker gets Ctrl-C
(and the hangup of a closed terminal), and it stops the engine in order, as for SIGTERM.
Nothing else changes for them: they still die with their parent, and a stop of the whole
group (``kill -- -PGID``) reaches the worker, which stops them.

vLLM applies its logging config (so builds the handler) only in ``run_engine_core``, after the
engine core has imported vLLM and torch: seconds in which it would still take a Ctrl-C, and
die of it with a ``KeyboardInterrupt`` traceback. So the processes multiprocessing spawns
from the worker start with SIGINT ignored (``spawn_ignoring_sigint``: an ignored signal stays
ignored across ``exec``, and Python leaves it so), until the hook has taken the process out
of the terminal's session; vLLM's own handler comes after. The engine core's workers start
in the engine core's session already.

Last, each of those processes ends without the interpreter's teardown
(``skip_teardown_at_exit``), as the worker itself does (``exit_without_teardown``, from
worker/__main__.py). With vLLM and torch loaded, the teardown runs full garbage collections
over some 400,000 objects: after its last line, a process that had imported vLLM took 8.5 s
more to end on 2 busy cores (perf: ``gc_collect_main``; 1.0 s without the collections). An
idle worker's Ctrl-C took 18 s (issue 33; 16-34 s measured here): the model worker's teardown
outlasted vLLM's 5 s grace period ("workers still running after grace period; sending
SIGTERM"), the engine core's took 8 s more, and the worker's own 6-10 s after "Stopped".
``gc.freeze()`` instead (what vLLM's engine core does after a clean stop on ROCm) keeps the
objects alive to the end, and Triton's bindings then print some 600 lines of "nanobind:
leaked ..." at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import multiprocessing
import os
import shlex
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import NoReturn

from loguru import logger

# The pid of the process whose death must end this one, inherited through the environment:
# each guarded process sets it to its own pid for the children it starts in turn.
PARENT_ENV = "MQTT_WORKER_PARENT_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


# Files this process wrote for its children (vLLM's logging config, the spawn script): removed
# at the end of the run, also by a forced exit (os._exit skips every finally).
_files: list[Path] = []


def remove_at_exit(path: Path | None) -> None:
    if path is not None:
        _files.append(path)


def remove_files() -> None:
    while _files:
        _files.pop().unlink(missing_ok=True)


# multiprocessing's resource tracker takes this process's -W options when it starts: its leak
# warnings off (quiet_resource_tracker).
TRACKER_QUIET = "ignore::UserWarning:multiprocessing.resource_tracker"


def quiet_resource_tracker() -> None:
    """Before the first child is spawned: the resource tracker that multiprocessing starts
    then (it outlives the worker by a moment, writing to the worker's terminal) still unlinks
    the semaphores a dead process left, but without its ``There appear to be 1 leaked semaphore
    objects to clean up at shutdown``. That warning came after the second Ctrl-C (``os._exit``
    by design) at times: the engine core is killed with the worker (``die_with_parent``) while
    it holds one, which names nothing an operator can act on; two full test runs of two on
    this repository's machine failed on it (tests/engine/test_ctrl_c.py; the test alone
    passed). The tracker is started here with that one -W option, which spawned children (whose
    command lines name no tracker then) do not get; they reuse it."""
    from multiprocessing import resource_tracker

    sys.warnoptions.append(TRACKER_QUIET)
    try:
        resource_tracker.ensure_running()
    finally:
        sys.warnoptions.remove(TRACKER_QUIET)


def expect_children() -> Path | None:
    """In the worker, before vLLM starts anything: the engine's processes die with this one
    and never take the terminal's Ctrl-C. Returns the file to delete at exit, if any."""
    os.environ[PARENT_ENV] = str(os.getpid())
    quiet_resource_tracker()
    return spawn_ignoring_sigint()


def spawn_ignoring_sigint() -> Path | None:
    """Have multiprocessing start its spawned children (vLLM's engine core) through a shell
    script that ignores SIGINT and execs this interpreter: multiprocessing's documented
    ``set_executable``, the same command line after it. None where there is no /bin/sh."""
    if not Path("/bin/sh").exists():
        return None
    fd, name = tempfile.mkstemp(prefix="worker-spawn-", suffix=".sh")
    with os.fdopen(fd, "w") as fh:
        fh.write(f"#!/bin/sh\ntrap '' INT\nexec {shlex.quote(sys.executable)} \"$@\"\n")
    os.chmod(name, 0o700)
    multiprocessing.set_executable(name)
    return Path(name)


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
    leave_the_terminal()
    skip_teardown_at_exit()


def leave_the_terminal() -> None:
    """A session of this process's own: the terminal's Ctrl-C (SIGINT to its foreground process
    group) and hangup no longer reach it. Fails only for a process that leads its group already
    (not one that multiprocessing spawned): it is left where it is."""
    with contextlib.suppress(OSError):
        os.setsid()


def exit_status(status: object) -> int:
    """The exit status ``sys.exit(status)`` gives a process (a message is printed, as Python does)."""
    if status is None:
        return 0
    if isinstance(status, int):
        return status
    print(status, file=sys.stderr)
    return 1


def exit_without_teardown(code: int) -> NoReturn:
    """End this process as Python's exit does, less the interpreter's teardown (the
    module's docstring says what it costs): stop and wait for the threads that are not
    daemons (``threading._shutdown``, which also ends idle thread pools' workers, as
    multiprocessing's own children call it), run the atexit handlers, flush the standard
    streams, and ``os._exit``."""
    getattr(threading, "_shutdown")()  # noqa: B009 - not in typeshed
    atexit._run_exitfuncs()
    _flush_standard_streams()
    os._exit(code)


def skip_teardown_at_exit() -> None:
    """In an engine process: end it without the interpreter's teardown once its work is done,
    that is when multiprocessing's ``spawn_main`` calls ``sys.exit`` with the process's exit
    status (the target has returned or raised, ``threading._shutdown`` and multiprocessing's
    finalizers have run): every atexit handler runs, then ``os._exit`` with that status
    (``exit_without_teardown``). ``sys.exit`` is wrapped for that one call (Python hands the
    status to no hook); called from anywhere else, it raises SystemExit as always."""
    from multiprocessing import spawn

    system_exit = sys.exit
    end_of_spawned_process = spawn.spawn_main.__code__

    def exit_(status: str | int | None = None, /) -> NoReturn:
        if sys._getframe(1).f_code is end_of_spawned_process:
            exit_without_teardown(exit_status(status))
        system_exit(status)

    sys.exit = exit_


def _flush_standard_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
