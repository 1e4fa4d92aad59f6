"""The start phases' progress lines (worker/system/progress.py): in the log and as systemd's STATUS, with a
heartbeat while a phase holds its thread, as vLLM's engine start does. The lines of a real
worker's start are checked in test_e2e.py (log) and test_reliability.py (STATUS)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from loguru import logger

from devtools.systemd import NotifyListener
from devtools.waiting import eventually
from worker.system.notify import Notifier
from worker.system.progress import start_phase


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[NotifyListener]:
    sock = NotifyListener(str(tmp_path / "notify.sock"))
    yield sock
    sock.close()


@pytest.fixture
def log_lines() -> Iterator[list[str]]:
    lines: list[str] = []
    sink = logger.add(lambda message: lines.append(message.record["message"]), level="INFO")
    yield lines
    logger.remove(sink)


def hold_until(condition: Callable[[], bool]) -> None:
    """Block this thread (no event loop runs) until condition() holds."""
    eventually(condition, "timed out", interval=0.005)


def heartbeat_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "start-heartbeat"]


def test_a_phase_logs_its_start_heartbeats_and_duration(listener: NotifyListener, log_lines: list[str]) -> None:
    notifier = Notifier(listener.address)
    with start_phase(notifier, "Starting the engine", "Engine ready", detail="vLLM is loading m", every=0.01):
        hold_until(lambda: sum(line.startswith("Still starting the engine: ") for line in log_lines) >= 2)
    assert not heartbeat_threads()  # joined before the block returned: no line after it
    assert log_lines[0] == "Starting the engine: vLLM is loading m"
    assert log_lines[-1].startswith("Engine ready in ") and log_lines[-1].endswith(" s")
    assert all(line.startswith("Still starting the engine: ") for line in log_lines[1:-1])
    listener.wait_for("STATUS=Engine ready in ")
    statuses = [line for line in listener.lines() if line.startswith("STATUS=")]
    assert statuses[0] == "STATUS=Starting the engine: vLLM is loading m"
    assert any(line.startswith("STATUS=Still starting the engine: ") for line in statuses)


def test_a_failed_phase_says_so_and_stops_its_heartbeat(log_lines: list[str]) -> None:
    notifier = Notifier(None)  # not under systemd: the log only
    with (
        pytest.raises(RuntimeError, match="no model"),
        start_phase(notifier, "Loading the tokenizer", "Tokenizer loaded", every=0.01),
    ):
        hold_until(lambda: any(line.startswith("Still loading the tokenizer: ") for line in log_lines))
        raise RuntimeError("no model")
    assert not heartbeat_threads()
    assert log_lines[0] == "Loading the tokenizer"
    assert log_lines[-1].startswith("Loading the tokenizer failed after ")
    assert not any(line.startswith("Tokenizer loaded") for line in log_lines)


def test_a_quick_phase_has_no_heartbeat(log_lines: list[str]) -> None:
    with start_phase(Notifier(None), "Importing vLLM", "Imported", every=3600):
        pass
    assert log_lines[0] == "Importing vLLM" and log_lines[1].startswith("Imported in ") and len(log_lines) == 2


def test_the_start_bar_follows_one_start_in_a_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The demos' and the benchmark's bar (bench/startbar.py), from the lines worker/system/progress.py logs."""
    from bench.startbar import StartBar

    def line(text: str) -> str:
        return f"2026-01-01 00:00:00.000 | INFO    | {text}\n"

    log = tmp_path / "worker.log"
    earlier = "".join(
        line(f"worker.{t}") for t in ("system.progress: Imported in 1.0 s", "server: Serving m as w via h:1 (x)")
    )
    log.write_text(earlier)  # a finished start from before: not this one's
    bar = StartBar(log, offset=log.stat().st_size, interactive=False)
    assert bar.poll() is False
    with log.open("a") as fh:
        fh.write(line("worker.system.progress: Importing vLLM, torch and transformers"))
        fh.write(line("worker.system.progress: Imported in 7.5 s") + line("vllm.config: not a start line"))
        fh.write(
            line("worker.system.progress: Tokenizer loaded in 0.3 s")
            + line("worker.system.progress: Engine ready in 20.8 s")
        )
        fh.write(line("worker.engine.vllm: Warm-up: off (auto: off on the CPU backend)"))
        fh.write("2026-01-01 00:00:00.000 | INFO    | worker.server: Serv")  # a line being written
    assert bar.poll() is False and bar.done == 4
    with log.open("a") as fh:
        fh.write("ing m as w via h:1 (ready 28.7 s after start)\n")
    assert bar.poll() is True and bar.done == 5
    bar.close()
    printed = capsys.readouterr().out.splitlines()  # without a terminal: the lines, once each
    assert printed == [
        "    Importing vLLM, torch and transformers",
        "    Imported in 7.5 s",
        "    Tokenizer loaded in 0.3 s",
        "    Engine ready in 20.8 s",
        "    Warm-up: off (auto: off on the CPU backend)",
        "    Serving m as w via h:1 (ready 28.7 s after start)",
    ]
