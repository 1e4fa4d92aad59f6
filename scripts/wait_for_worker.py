"""Wait until a worker serves, with a progress bar of its start (bench/startbar.py), for the
demo scripts.

    .venv/bin/python scripts/wait_for_worker.py WORKER_LOG --pid WORKER_PID [--timeout 300]

Exits 0 once the worker serves (the broker has acknowledged its subscriptions: a request is
answered from then on), 1 with the end of its log if it exits first or the time runs out,
130 on Ctrl-C (without a traceback: the script's clean-up follows).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.startbar import StartBar


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

    deadline = time.monotonic() + args.timeout
    bar = StartBar(args.log)
    try:
        while not bar.poll():
            if not alive(args.pid) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        else:
            return 0
    except KeyboardInterrupt:  # Ctrl-C: the demo script stops what it started
        return 130
    finally:
        bar.close()
    why = "exited" if not alive(args.pid) else f"did not serve within {args.timeout:.0f} s"
    print(f"the worker {why}; the end of its log ({args.log}):", file=sys.stderr)
    print("\n".join(args.log.read_text(errors="replace").splitlines()[-40:]), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
