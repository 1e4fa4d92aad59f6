"""Check a worker's warm-up on a model: no ERROR line in its log and every step done
(``python -m devtools.warmup_check MODEL [worker flags]``; on a GPU: the model and the engine
arguments under test, e.g. a geometry model with ``--engine-extra '{"load_format": "dummy"}'``).

It starts a private mosquitto and ``python -m worker --warmup on`` on MODEL, waits until the
worker is online, stops it, and prints the warm-up's lines and every ERROR line of the log
(the worker's and vLLM's own, which the worker routes through its log). Exit 0 when the log
has no ERROR line and the warm-up did all its steps, 1 otherwise. The engine tier runs the
same check (``warmup_problems``) on its shared worker's log, which warms up on the CPU.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from .mosquitto import Mosquitto
from .worker_process import WorkerProcess

# The worker's log format (worker/system/logs.py): "<date> <time> | LEVEL | <name>: <message>";
# vLLM's engine core process prefixes its lines with "(EngineCore pid=N) " (its grammar errors
# on an H100 came that way).
ERROR_LINE = re.compile(r"^(?:\(\S+ pid=\d+\) )?\S+ \S+ \| (ERROR|CRITICAL) +\|.*$", re.M)
WARMUP_DONE = re.compile(r"Warm-up done in [\d.]+ s: (\d+) of (\d+) steps.*$", re.M)
WARMUP_STEP_FAILED = re.compile(r"Warm-up: step .*$", re.M)


def warmup_problems(log: str) -> list[str]:
    """What is wrong with the warm-up in a worker's log up to its "Serving" line: ERROR lines,
    failed or cut steps, a warm-up that did not report, fewer steps done than planned."""
    serving_at = log.find("worker.server: Serving ")
    start = log[: serving_at if serving_at >= 0 else len(log)]
    problems = [f"ERROR line: {line}" for line in (m.group(0) for m in ERROR_LINE.finditer(start))]
    problems += [f"warm-up step not done: {m.group(0)}" for m in WARMUP_STEP_FAILED.finditer(start)]
    done = WARMUP_DONE.search(start)
    if done is None:
        problems.append("no 'Warm-up done' line before 'Serving'")
    elif done.group(1) != done.group(2):
        problems.append(f"the warm-up did {done.group(1)} of {done.group(2)} steps")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.warmup_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="the model directory")
    parser.add_argument("--mosquitto", help="the mosquitto binary (default: the installed one)")
    parser.add_argument("--log", type=Path, help="keep the worker's log here (default: a temporary file)")
    parser.add_argument("--timeout", type=float, default=480, help="seconds to wait for the worker to be online")
    args, worker_flags = parser.parse_known_args(argv)
    with tempfile.TemporaryDirectory(prefix="warmup-check-") as tmp:
        workdir = Path(tmp)
        broker = Mosquitto(workdir, persistence=False, log=False, binary=args.mosquitto)
        broker.start()
        log_path = args.log or workdir / "worker.log"
        flags = ["--model", args.model, "--warmup", "on", "--store", "memory", "--worker-id", "warmup-check"]
        status = (broker.port, "chat/_worker/warmup-check/status")
        worker = WorkerProcess([*flags, "--mqtt-port", str(broker.port), *worker_flags], log_path, status=status)
        problems: list[str] = []
        try:
            worker.wait_online(args.timeout)
        except RuntimeError as exc:  # it exited, or was not online in time: stopped, its log's end said
            problems.append(str(exc))
        finally:
            code = worker.stop()
            broker.stop()
        log = log_path.read_text(errors="replace")
    for line in log.splitlines():
        if "Warm-up" in line or "Sampling defaults" in line:
            print(line)
    problems += warmup_problems(log)
    if code != 0 and not problems:
        problems.append(f"the worker's stop exited with {code}; the end of its log:\n{log[-4000:]}")
    for problem in problems:
        print(problem)
    print("warm-up check:", "FAILED" if problems else "passed (no ERROR line, every step done)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
