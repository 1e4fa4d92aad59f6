"""Wait until a worker serves, with a progress bar of its start (for the demo scripts).

The worker logs each start phase as it ends (worker/startup.py): vLLM imported, tokenizer
loaded, engine ready, then "Serving ..." once the broker has acknowledged its subscriptions
(from then on a request is answered). Each moves the bar; the text beside it is the worker's
latest start line ("Still starting the engine: 45 s" while the engine starts). Without a
terminal, the lines are printed as they come instead.

    .venv/bin/python scripts/wait_for_worker.py WORKER_LOG --pid WORKER_PID [--timeout 300]

Exits 0 once the worker serves, 1 (with the end of its log) if it exits first or the time
runs out.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

from tqdm import tqdm

# The lines that end a start phase, in order: each one found moves the bar a step.
PHASES_DONE = (
    r"worker\.startup: Imported in ",
    r"worker\.startup: Tokenizer loaded in ",
    r"worker\.startup: Engine ready in ",
    r"worker\.main: Serving ",
)
START_LINE = re.compile(r"\| (?:worker\.startup|worker\.main): (.*)$", re.M)


def alive(pid: int) -> bool:
    """Running (an exited child its parent has not reaped yet is a zombie: not alive)."""
    try:
        os.kill(pid, 0)
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (ProcessLookupError, FileNotFoundError):
        return False
    except OSError:  # no /proc: trust the signal
        return True
    return state != "Z"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", type=Path, help="the worker's log file")
    parser.add_argument("--pid", type=int, required=True, help="the worker's process id")
    parser.add_argument("--timeout", type=float, default=300, help="seconds to wait (300)")
    args = parser.parse_args()

    interactive = sys.stderr.isatty()
    deadline = time.monotonic() + args.timeout
    shown: list[str] = []
    bar = tqdm(
        total=len(PHASES_DONE),
        bar_format="worker start |{bar:20}| {n}/{total} [{elapsed}] {desc}",
        disable=not interactive,
    )
    with bar:
        while True:
            log = args.log.read_text(errors="replace") if args.log.exists() else ""
            done = sum(bool(re.search(pattern, log)) for pattern in PHASES_DONE)
            lines = START_LINE.findall(log)
            if lines and lines[-1] != (shown[-1] if shown else None):
                if not interactive:
                    for line in lines[len(shown) :]:
                        print(f"    {line}", flush=True)
                shown = lines
                bar.set_description_str(lines[-1][:70], refresh=False)
            bar.update(done - bar.n)
            if done == len(PHASES_DONE):
                return 0
            if not alive(args.pid) or time.monotonic() > deadline:
                break
            bar.refresh()  # the elapsed time moves even when the log does not
            time.sleep(0.5)
    why = "exited" if not alive(args.pid) else f"did not serve within {args.timeout:.0f} s"
    print(f"the worker {why}; the end of its log ({args.log}):", file=sys.stderr)
    print("\n".join(log.splitlines()[-40:]), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
