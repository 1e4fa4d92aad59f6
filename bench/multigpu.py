"""Several GPUs on one host, against one worker on one GPU, same geometry, same runs.

    python -m bench.multigpu --profile gpu --geometry qwen2.5-7b --out OUT --phases single,dp
    python -m bench.multigpu --profile gpu --geometry qwq-32b --out OUT --phases single,tp
    python -m bench.multigpu --profile smoke --out /tmp/multi     # CPU: two workers, tiny model

Phases (each writes OUT/<phase>.json and is skipped when that file exists, like the bench):
  single  one worker, --visible-devices of the profile's first GPU
  dp      data parallel: one worker per GPU of the profile, each with its own --visible-devices,
          worker id and compile cache, all in one --share-group: the broker hands each request
          to one of them
  tp      tensor parallel: one worker with --tensor-parallel-size over the profile's GPUs
Each runs the worker phase's concurrency runs (sessions that send their next turn when the
previous reply arrives) at the profile's multi_concurrency, then OUT/multi.json and
OUT/multi.md compare aggregate tokens/s and p50/p95 latency with the single worker.

The workers of a share group must see each session's whole history whichever of them serves a
turn: give them a shared store with --worker-args (``{redis_port}`` is replaced by the port of
the redis-server that --redis-server starts). Each run counts the later turns whose prompt was
shorter than the turn before's prompt and reply (served without their history; a lower
bound): 0 with one worker.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shlex
import shutil
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from tqdm import tqdm

from devtools.worker_process import WorkerProcess

from .common import REPO, Record, load, phase_list, run_metadata, save
from .harness import prepare_model, stamped
from .profiles import PROFILES, Profile
from .runs import STOP_TIMEOUT, start_broker, start_redis, start_worker, timed, wait_ready

PHASES = ("single", "dp", "tp")
SHARE_GROUP = "bench"


def worker_commands(
    phase: str, profile: Profile, common: list[str], state: Path
) -> list[tuple[str, list[str], dict[str, str]]]:
    """(worker id, flags, environment) of each worker a phase starts. Each has its own store
    (state_dir) as each instance of the systemd template has: what the workers of a group
    share is only what --worker-args makes them share."""
    if phase == "single":
        args = ["--visible-devices", profile.gpus[0], "--state-dir", str(state / "single")]
        return [("bench", [*common, *args], {})]
    if phase == "tp":
        devices = ",".join(profile.gpus[: max(profile.tensor_parallel_size, 1)])
        size = str(profile.tensor_parallel_size)
        args = ["--visible-devices", devices, "--tensor-parallel-size", size, "--state-dir", str(state / "tp")]
        return [("bench", [*common, *args], {})]
    if phase == "dp":
        # Each its own compile cache too: two engines compiling the same graphs at once never
        # write the same files.
        root = os.environ["VLLM_CACHE_ROOT"]
        return [
            (
                f"bench-gpu{gpu}",
                [
                    *common,
                    *["--visible-devices", gpu, "--share-group", SHARE_GROUP],
                    *["--state-dir", str(state / f"dp-gpu{gpu}")],
                ],
                {"VLLM_CACHE_ROOT": f"{root}/dp-gpu{gpu}"},
            )
            for gpu in profile.gpus
        ]
    raise ValueError(f"unknown phase {phase!r}, expected one of {', '.join(PHASES)}")


def turns_without_history(records: list[Record]) -> int:
    """Later turns whose prompt is shorter than the turn before's prompt and reply: served by a
    worker that did not have the session's latest history. A lower bound: a turn served with
    an older history that is still longer than the turn before's (after a turn that lacked
    its own) is not recognised."""
    by_session: dict[int, list[Record]] = defaultdict(list)
    for record in records:
        by_session[record.session].append(record)
    lost = 0
    for turns in by_session.values():
        turns.sort(key=lambda r: r.turn)
        for before, after in itertools.pairwise(turns):
            lost += after.prompt_tokens < before.prompt_tokens + before.completion_tokens
    return lost


def run_phase(phase: str, profile: Profile, model: Path, out: Path, mosquitto: str, extra: list[str]) -> dict[str, Any]:
    from worker.engine.tokenizer import ChatTokenizer

    from .common import make_workload
    from .mqtt_driver import MqttDriver

    tokenizer = ChatTokenizer(str(model))
    workload = make_workload(tokenizer.count_text, max_tokens=profile.max_tokens)
    broker = start_broker(mosquitto, out)
    common = ["--model", str(model), "--stats-interval", "2", *profile.worker_args, *extra]
    workers: dict[str, WorkerProcess] = {}
    result: dict[str, Any] = {"phase": phase, "workers": {}}
    driver: MqttDriver | None = None
    try:
        for worker_id, args, env in worker_commands(phase, profile, common, out / "state"):
            log = out / f"worker-{phase}-{worker_id}.log"
            workers[worker_id] = start_worker(args, broker.port, log, worker_id=worker_id, env=env, wait=False)
            result["workers"][worker_id] = {"args": args[len(common) :] + extra}
        for worker_id, worker in workers.items():
            wait_ready(worker)  # they load at the same time, each on its GPU
            result["workers"][worker_id]["start_to_ready_s"] = worker.start_to_ready_s
        driver = active = MqttDriver("127.0.0.1", broker.port)
        total = sum(c * profile.turns for c in profile.multi_concurrency)
        runs: dict[int, Any] = {}
        with tqdm(total=total, desc=phase, unit="req") as bar:
            warm = max(profile.multi_concurrency)
            # Two turns, as in the worker phase: a second turn's shapes compile kernels on first
            # use (at df75700 one GPU's first 50 second turns decoded 3x slower, at C = 100).
            active.run_concurrent("warmup", workload, tokenizer.count_text, sessions=warm, turns=2)
            for count in profile.multi_concurrency:
                client_cpu = time.process_time()
                run = timed(
                    lambda count=count: active.run_concurrent(
                        f"multi-{phase}",
                        workload,
                        tokenizer.count_text,
                        sessions=count,
                        turns=profile.turns,
                        progress=bar.update,
                    )
                )
                run["summary"]["turns_without_history"] = turns_without_history(run["records"])
                # This process receives every session's stream: near 1.0 it limits the run.
                used = (time.process_time() - client_cpu) / run["summary"]["wall_s"]
                run["summary"]["client_cpu_cores"] = round(used, 2)
                runs[count] = run
        time.sleep(2.5)  # one more stats message from each worker (--stats-interval 2)
        latest: dict[str, dict[str, Any]] = {s["workerId"]: s for s in active.stats}
        for worker_id, info in result["workers"].items():
            stats = latest.get(worker_id)
            info["processed"] = stats["processed"] if stats else None
        result["concurrency"] = runs
    finally:
        if driver is not None:
            driver.close()
        for worker in workers.values():
            worker.stop(STOP_TIMEOUT)
        broker.stop()
    return result


def compare(out: Path) -> dict[str, Any]:
    """Each phase's runs beside the single worker's at the same concurrency."""
    phases = {p: load(out / f"{p}.json") for p in PHASES if (out / f"{p}.json").exists()}
    single = phases.get("single", {}).get("concurrency", {})
    table: dict[str, Any] = {}
    for phase, data in phases.items():
        rows = {}
        for count, run in data["concurrency"].items():
            summary = dict(run["summary"])
            base = single.get(count, {}).get("summary")
            if base and phase != "single":
                summary["tokens_per_s_vs_single"] = _ratio(summary["tokens_per_s"], base["tokens_per_s"])
                summary["p50_vs_single"] = _ratio(summary["p50_ms"], base["p50_ms"])
                summary["p95_vs_single"] = _ratio(summary["p95_ms"], base["p95_ms"])
            rows[count] = summary
        table[phase] = {"workers": data["workers"], "commit": data.get("commit"), "runs": rows}
    meta = load(out / "meta.json") if (out / "meta.json").exists() else {}
    return {"meta": meta, "phases": table}


def _ratio(value: float | None, base: float | None) -> float | None:
    return round(value / base, 2) if value and base else None


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    lines = [
        "# Several GPUs on one host",
        "",
        f"{meta.get('gpu', '?')}; vLLM {meta.get('vllm', '?')}; model {Path(meta.get('model', '?')).name}; "
        f"commit {meta.get('git_commit', '?')}. Concurrency runs: sessions that send their next turn "
        "when the previous reply arrives; tokens/s over each run's wall time; latency per request "
        "(client: publish to reply). Ratios against the single worker at the same concurrency. "
        "Client CPU: cores the benchmark's one client process used (it receives every stream "
        "delta); near 1.0 the client, not the workers, limits the run.",
        "",
    ]
    for phase, data in result["phases"].items():
        workers = ", ".join(
            f"{wid} ({' '.join(info['args'])}; ready in {info.get('start_to_ready_s')} s; "
            f"{info.get('processed')} requests served)"
            for wid, info in data["workers"].items()
        )
        lines += [f"## {phase}", "", f"Workers: {workers}.", ""]
        lines += [
            "| sessions | requests | tokens/s | p50 ms | p95 ms | tokens/s vs single | p50 vs single | "
            "p95 vs single | turns without history | client CPU |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for count, s in data["runs"].items():
            cells = [
                count,
                s["requests"],
                s["tokens_per_s"],
                s["p50_ms"],
                s["p95_ms"],
                s.get("tokens_per_s_vs_single", ""),
                s.get("p50_vs_single", ""),
                s.get("p95_vs_single", ""),
                s.get("turns_without_history", ""),
                s.get("client_cpu_cores", ""),
            ]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def write_report(out: Path) -> dict[str, Any]:
    result = compare(out)
    save(out / "multi.json", result)
    (out / "multi.md").write_text(markdown(result))
    print((out / "multi.md").read_text())
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.multigpu", description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="smoke")
    parser.add_argument("--model", type=Path, help="model directory (default: generated per profile)")
    parser.add_argument("--geometry", help="generate a real geometry (dummy weights), e.g. qwen2.5-7b")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--phases", type=phase_list(PHASES), default="single,dp", help=f"comma separated, of {', '.join(PHASES)}"
    )
    parser.add_argument("--mosquitto", default=shutil.which("mosquitto") or "/usr/sbin/mosquitto")
    parser.add_argument("--worker-args", default="", help="more worker flags for every phase, e.g. a shared store")
    parser.add_argument("--redis-server", help="start this redis-server per phase; {redis_port} in --worker-args")
    parser.add_argument("--report", action="store_true", help="only rewrite multi.json and multi.md")
    args = parser.parse_args(argv)
    out: Path = args.out
    if args.report:
        write_report(out)
        return 0
    profile = PROFILES[args.profile]
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VLLM_CACHE_ROOT", str(REPO / ".cache" / "vllm"))
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    model = args.model or prepare_model(args.geometry, out)
    if not (out / "meta.json").exists():
        meta = run_metadata(model, profile.engine_overrides)
        save(out / "meta.json", {**meta, "profile": args.profile, "worker_args": profile.worker_args})
    for phase in args.phases:
        path = out / f"{phase}.json"
        if path.exists():
            print(f"{phase}: done before ({path})")
            continue
        redis = start_redis(args.redis_server, out) if args.redis_server else None
        extra = shlex.split(args.worker_args.replace("{redis_port}", str(redis.port) if redis else "{redis_port}"))
        started = time.perf_counter()
        try:
            save(path, stamped(run_phase(phase, profile, model, out, args.mosquitto, extra)))
        finally:
            if redis is not None:
                redis.stop()
        print(f"{phase}: {time.perf_counter() - started:.0f} s", flush=True)
    write_report(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
