"""Ctrl-C in the terminal of a foreground worker (``python -m worker`` in a pseudo-terminal,
pexpect's ``sendintr``: the terminal sends SIGINT to its whole foreground process group, as
for a user), against the session's mosquitto and the vLLM CPU engine on the tiny model.

- While it streams a reply: the same graceful stop as SIGTERM, with a line saying how to stop
  at once; the reply is finished and published, exit 0, and the log has no traceback, no
  ``EngineDeadError``, no ``force killing`` of vLLM's processes and no SIGTERM to its model
  worker after vLLM's grace period; vLLM's processes are gone after. They
  run in sessions of their own (worker/system/children.py): the terminal's SIGINT never
  reached them (it used to, and vLLM's engine died under the reply).
- A second Ctrl-C stops at once (exit 1), and the request it left unanswered is answered once
  by the next start: nothing is lost.
- During the engine start: the start stops (exit 0), not after the model load.

One worker id, state directory and topic prefix (``ctrlc``, so that the shared worker, on
``chat``, answers none of these requests) for the module; two engine starts and one stopped
start."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pexpect
import psutil
import pytest

from devtools.chat_terminal import in_terminal
from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import Client
from devtools.net import free_port
from devtools.waiting import PATIENCE, eventually
from devtools.worker_process import engine_args, pending_requests

pytestmark = pytest.mark.e2e
PREFIX = "ctrlc"
STATUS = f"{PREFIX}/_worker/ctrlc/status"
# What a stop that went wrong prints (before: 60 lines of EngineDeadError tracebacks). "grace
# period" and SIGTERM: vLLM's engine core waited for its model worker's exit past its grace
# period, through the seconds of the interpreter's teardown, which the engine's processes now
# skip (worker/system/children.py); "leaked": what skipping it must not cost (Triton's
# nanobind, or multiprocessing's resource tracker, reporting what was never freed).
NEVER = ("Traceback", "EngineDeadError", "force killing", "ERROR", "grace period", "SIGTERM", "leaked")


class TerminalWorker:
    """``python -m worker`` in a pseudo-terminal of its own, as started from a shell."""

    def __init__(self, model: Path, broker: Mosquitto, state: Path, *extra: str) -> None:
        args = [*engine_args(model), "--mqtt-port", str(broker.port), "--topic-prefix", PREFIX]
        args += ["--worker-id", "ctrlc", "--state-dir", str(state), *extra]
        self.child = in_terminal(
            [sys.executable, "-m", "worker", *args],
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            codec_errors="replace",
            timeout=300,
            dimensions=(50, 250),
        )
        self.output = ""

    def expect(self, text: str, timeout: float = 300) -> None:
        self.child.expect_exact(text, timeout=timeout)
        self.output += str(self.child.before) + str(self.child.after)

    def engine_processes(self) -> list[psutil.Process]:
        """Its children, once vLLM's engine core is among them."""
        found: list[psutil.Process] = []

        def engine_there() -> bool:
            found[:] = psutil.Process(self.child.pid).children(recursive=True)
            return any("EngineCore" in p.name() for p in found)

        eventually(engine_there, lambda: str([p.name() for p in found]), interval=0.2)
        return found

    def exit_code(self, timeout: float) -> int:
        """Wait for the end; its exit code (all it printed is in ``output``)."""
        self.child.expect(pexpect.EOF, timeout=timeout)
        self.output += str(self.child.before)
        self.child.close()
        assert self.child.signalstatus is None, f"killed by signal {self.child.signalstatus}"
        return int(self.child.exitstatus)

    def kill(self) -> None:
        if self.child.isalive():
            self.child.terminate(force=True)


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ctrlc") / "state"


@pytest.fixture
def terminal_workers() -> Iterator[list[TerminalWorker]]:
    started: list[TerminalWorker] = []
    yield started
    for worker in started:
        worker.kill()


def names(worker: TerminalWorker) -> list[str]:
    names = []
    for child in psutil.Process(worker.child.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            names.append(child.name())
    return names


def sigint_ignored(pid: int) -> bool:
    """Whether the process ignores SIGINT (its SigIgn mask in /proc)."""
    (line,) = [line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigIgn:")]
    return bool(int(line.split()[1], 16) & (1 << (signal.SIGINT - 1)))


def request(sender: Client, session: str, request_id: str, max_tokens: int) -> None:
    sender.publish(
        f"{PREFIX}/u/{session}/request",
        {"message": "tell me everything", "maxTokens": max_tokens, "stream": True, "requestId": request_id},
    )


def test_a_second_ctrl_c_stops_at_once_and_the_request_is_answered_after_a_restart(
    tiny_model: Path, broker: Mosquitto, state: Path, terminal_workers: list[TerminalWorker]
) -> None:
    watch = Client(broker.port, [f"{PREFIX}/u/+/reply", f"{PREFIX}/u/+/stream", STATUS])
    metrics = free_port()
    first = TerminalWorker(tiny_model, broker, state, "--metrics-port", str(metrics))
    terminal_workers.append(first)
    first.expect("Serving ")
    processes = first.engine_processes()
    # The engine core holds still (SIGSTOP), so that the reply cannot finish before both Ctrl-C.
    cores = [p for p in processes if "EngineCore" in p.name()]
    for core in cores:
        core.suspend()
    request(watch, "forced", "forced-0", 64)
    # Taken by the worker (its pending gauge says so) before the first Ctrl-C.
    eventually(lambda: pending_requests(metrics) >= 1, "the worker did not take the request", interval=0.1)
    first.child.sendintr()
    first.expect("Stopping on Ctrl-C (SIGINT); Ctrl-C again stops at once")
    first.expect("Draining 1 pending request(s)")
    first.child.sendintr()
    assert first.exit_code(timeout=PATIENCE) == 1, first.output[-3000:]  # a drained stop is 0
    assert "Second stop signal: exiting now (1 unanswered request(s) left for the next start)" in first.output
    assert not [word for word in NEVER if word in first.output], first.output[-3000:]
    _, left = psutil.wait_procs(processes, timeout=PATIENCE)
    assert not left, f"outlived the worker: {[(p.pid, p.name()) for p in left]}"
    # Unanswered: offline is the last thing of the worker's the broker forwards.
    watch.wait_for(lambda m: m.topic == STATUS and m.payload == b"offline" and not m.retain, timeout=PATIENCE)
    assert not watch.received(lambda m: m.topic.endswith("/forced/reply"))

    # The next start answers it, once; then Ctrl-C while it streams another reply.
    second = TerminalWorker(tiny_model, broker, state)
    terminal_workers.append(second)
    second.expect("Serving ")
    answer = watch.wait_for(lambda m: m.topic.endswith("/forced/reply"), timeout=PATIENCE).json()
    assert answer["requestId"] == "forced-0" and "error" not in answer, answer
    processes = second.engine_processes()
    # Out of the terminal's reach: vLLM's engine core (and the model workers of a multiprocessing
    # executor: none here, the CPU engine runs its model in the engine core) leads a session of
    # its own (multiprocessing's resource tracker, also a child, ignores SIGINT itself).
    vllm = [p for p in processes if p.name().startswith("VLLM::")]
    assert vllm and all(os.getsid(p.pid) == p.pid for p in vllm), [
        (p.pid, p.name(), os.getsid(p.pid)) for p in processes
    ]
    request(watch, "graceful", "graceful-0", 1000)
    watch.wait_for(lambda m: m.topic.endswith("/graceful/stream"), timeout=PATIENCE)  # streaming now
    second.child.sendintr()
    assert second.exit_code(timeout=PATIENCE) == 0, second.output[-3000:]
    log = second.output[second.output.find("Stopping on Ctrl-C (SIGINT); Ctrl-C again stops at once") :]
    assert log.startswith("Stopping"), second.output[-3000:]
    assert not [word for word in NEVER if word in log], log
    assert "Engine stopped in" in log and "Stopped (exit code 0)" in log, log
    reply = watch.wait_for(lambda m: m.topic.endswith("/graceful/reply"), timeout=PATIENCE).json()
    assert reply["finishReason"] == "length" and reply["usage"]["completionTokens"] == 1000, reply
    _, left = psutil.wait_procs(processes, timeout=PATIENCE)
    assert not left, f"outlived the worker: {[(p.pid, p.name()) for p in left]}"
    # Answered once: no second reply before the worker's offline, the last it published.
    watch.wait_for(lambda m: m.topic == STATUS and m.payload == b"offline" and not m.retain, timeout=PATIENCE)
    assert not watch.received(lambda m: m.topic.endswith("/forced/reply"))
    watch.close()


@pytest.mark.parametrize("frontend", ["off", "on"])
def test_ctrl_c_during_the_engine_start_stops_the_start(
    tiny_model: Path, broker: Mosquitto, state: Path, terminal_workers: list[TerminalWorker], frontend: str
) -> None:
    """The engine start holds the event loop for as long as the model load takes (minutes for a
    large model): a Ctrl-C meanwhile stops it then, not once the model is loaded. With vLLM's
    frontend in a process of its own (on a GPU by default) the start only waits for that
    process: the loop's own handler stops it, and the process goes too."""
    worker = TerminalWorker(tiny_model, broker, state, "--frontend-process", frontend)
    terminal_workers.append(worker)
    worker.expect("Starting the engine")
    # From its first moment, each process multiprocessing spawns (the engine core, before it is
    # named so) is out of the terminal's reach: SIGINT ignored until it is in a session of its
    # own, which it takes seconds later, once vLLM has loaded in it.
    checked: set[int] = set()
    deadline = time.monotonic() + PATIENCE
    while not any("EngineCore" in name for name in names(worker)):
        for child in psutil.Process(worker.child.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "--multiprocessing-fork" in child.cmdline() and "resource_tracker" not in str(child.cmdline()):
                    assert os.getsid(child.pid) == child.pid or sigint_ignored(child.pid), child.cmdline()
                    checked.add(child.pid)
        assert time.monotonic() < deadline, names(worker)
        time.sleep(0.02)
    assert checked, "no engine process was seen before it was named"
    processes = worker.engine_processes()
    worker.child.sendintr()
    # Stopped then, not once the model is loaded: "Engine ready" below (not how long it took).
    assert worker.exit_code(timeout=PATIENCE) == 0, worker.output[-3000:]
    assert "Starting the engine: stopped after" in worker.output and "Stopped during the start (exit code 0)" in (
        worker.output
    ), worker.output[-3000:]
    assert "Engine ready" not in worker.output and "Traceback" not in worker.output, worker.output[-3000:]
    _, left = psutil.wait_procs(processes, timeout=PATIENCE)
    assert not left, f"outlived the worker: {[(p.pid, p.name()) for p in left]}"
