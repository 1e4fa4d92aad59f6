"""A progress bar of a worker's start, read from its log: for the benchmark and the demos.

The worker logs each start phase as it ends (worker/system/progress.py): libraries imported, tokenizer
loaded, engine ready, then "Serving ..." once the broker has acknowledged its subscriptions
(from then on a request is answered). Each moves the bar; the text beside it is the worker's
latest start line ("Still starting the engine: 45 s" while vLLM loads, compiles and captures
CUDA graphs). Without a terminal the lines are printed as they come instead.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tqdm import tqdm

# The lines that end a start phase, in order, each one or more alternatives: each one found
# moves the bar a step. The warm-up ends with the engine's own line: its summary, or that it
# is off (the CPU backend's default).
PHASES_DONE: tuple[tuple[str, ...], ...] = (
    ("worker.system.progress: Imported in ",),
    ("worker.system.progress: Tokenizer loaded in ",),
    ("worker.system.progress: Engine ready in ",),
    ("worker.engine.vllm: Warm-up done in ", "worker.engine.vllm: Warm-up: off "),
    ("worker.server: Serving ",),
)
START_LINE = re.compile(r"\| (?:worker\.system\.progress|worker\.server|worker\.engine\.vllm(?=: Warm)): (.*)$", re.M)


class StartBar:
    """Follows one start in a log file, from ``offset`` (a log may hold earlier starts)."""

    def __init__(self, log: Path, *, offset: int = 0, interactive: bool | None = None) -> None:
        self.log, self.offset = log, offset
        self.interactive = sys.stderr.isatty() if interactive is None else interactive
        self.text = ""
        self.lines: list[str] = []
        self.done = 0  # phases ended
        self.bar = tqdm(
            total=len(PHASES_DONE),
            bar_format="worker start |{bar:20}| {n}/{total} [{elapsed}] {desc}",
            disable=not self.interactive,
        )

    def poll(self) -> bool:
        """Read what the log gained; move the bar. True once the worker serves."""
        if self.log.exists():
            with open(self.log, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
            complete = data.rfind(b"\n") + 1  # whole lines only
            self.offset += complete
            self.text += data[:complete].decode(errors="replace")
        lines = START_LINE.findall(self.text)
        if len(lines) > len(self.lines):
            if not self.interactive:
                for line in lines[len(self.lines) :]:
                    print(f"    {line}", flush=True)
            self.lines = lines
            self.bar.set_description_str(lines[-1][:70], refresh=False)
        done = sum(any(line in self.text for line in phase) for phase in PHASES_DONE)
        self.bar.update(done - self.done)
        self.done = done
        self.bar.refresh()  # the elapsed time moves even when the log does not
        return done == len(PHASES_DONE)

    def close(self) -> None:
        self.bar.close()
