"""worker/system/children.py: the engine's processes (and the worker) end without the
interpreter's teardown, which took seconds with vLLM and torch loaded, and with the exit status
and atexit handlers of a normal exit. Real spawned processes (multiprocessing's spawn, as vLLM
starts its engine core and model workers), in a script of their own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from devtools import REPO

SCRIPT = """
import atexit, multiprocessing, sys
from pathlib import Path

OUT = Path(sys.argv[1])


class Witness:
    # Freed by the interpreter's teardown (a module global in a reference cycle), never before.
    def __init__(self):
        self.me = self

    def __del__(self):
        (OUT / f"teardown-{multiprocessing.current_process().name}").write_text("ran")


def child(how):
    from worker.system.children import skip_teardown_at_exit

    skip_teardown_at_exit()  # what the worker's logging handler does in vLLM's processes
    atexit.register(lambda: (OUT / f"atexit-{how}").write_text("ran"))
    global witness
    witness = Witness()
    if how == "raise":
        raise RuntimeError("failed")
    sys.exit({"exit3": 3, "exit0": None}[how])


if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    for how in ("exit3", "exit0", "raise"):
        process = context.Process(target=child, args=(how,), name=how)
        process.start()
        process.join(120)
        print(how, process.exitcode)
    witness = Witness()
    from worker.system.children import exit_without_teardown

    atexit.register(lambda: (OUT / "atexit-main").write_text("ran"))
    exit_without_teardown(5)
"""


def test_spawned_processes_end_with_their_status_and_atexit_handlers_but_no_teardown(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},  # this checkout's worker package
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 5, done.stderr
    assert done.stdout.split("\n")[:3] == ["exit3 3", "exit0 0", "raise 1"], (done.stdout, done.stderr)
    assert "RuntimeError: failed" in done.stderr  # the failed child's traceback, as multiprocessing prints it
    ran = sorted(path.name for path in tmp_path.iterdir() if path.name != "script.py")
    assert ran == ["atexit-exit0", "atexit-exit3", "atexit-main", "atexit-raise"], ran  # and no teardown-*


LOCKS = """
import multiprocessing, os, sys

if sys.argv[1] == "quiet":
    from worker.system.children import quiet_resource_tracker

    quiet_resource_tracker()  # what the worker does before vLLM spawns anything
lock = multiprocessing.get_context("spawn").Lock()  # starts the tracker; a named semaphore it knows
os._exit(1)  # as the second stop signal ends the worker, the semaphore left behind
"""


def test_an_exit_at_once_leaves_the_tracker_quiet(tmp_path: Path) -> None:
    """Without quiet_resource_tracker multiprocessing's resource tracker, which outlives the
    process, reports the semaphore left behind on the process's terminal; with it, nothing,
    and the semaphore is unlinked all the same."""
    script = tmp_path / "locks.py"
    script.write_text(LOCKS)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    said = {
        how: subprocess.run(
            [sys.executable, str(script), how], capture_output=True, text=True, timeout=120, env=env, check=False
        )
        for how in ("keep", "quiet")
    }
    assert said["keep"].returncode == said["quiet"].returncode == 1
    assert "leaked semaphore" in said["keep"].stderr  # what the test would miss if it could not fail
    assert "leaked" not in said["quiet"].stderr, said["quiet"].stderr
