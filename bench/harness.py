"""The benchmark: one command, resumable phases, JSON per phase, then a report.

    python -m bench --profile cpu --out docs/benchmarks/cpu            # here, tiny model
    python -m bench --profile gpu --geometry qwen2.5-7b --out OUT     # on the GPU machine

Phases (each writes OUT/<phase>.json and is skipped when that file exists, so a run that does
not fit one command continues where it stopped):
  worker     the worker through mosquitto: multi-turn growth, concurrency, one-at-a-time,
             batch-1 decode, MQTT hop, start-to-ready, RSS
  inprocess  vLLM in this process on the same prompts: the ceiling, the "before" script, raw decode
  ablation   engine settings, in-process (GPU profile)
  structured the same requests with and without a JSON schema (vLLM structured outputs)
  restart    a second worker start on a warm compile cache
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from .common import REPO, Record, load, make_workload, run_metadata, save, summarize
from .profiles import PROFILES, Profile

# A string that cannot close before 400 characters: every reply runs to maxTokens with and
# without the schema, so the two runs generate the same number of tokens.
SCHEMA = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 400}},
    "required": ["story"],
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Broker:
    def __init__(self, binary: str, workdir: Path) -> None:
        self.port = free_port()
        conf = workdir / "mosquitto.conf"
        # set_tcp_nodelay and max_inflight_messages: see "Broker settings" in docs/protocol.md.
        settings = "allow_anonymous true\nset_tcp_nodelay true\nmax_inflight_messages 0\n"
        conf.write_text(f"listener {self.port} 127.0.0.1\n{settings}")
        env = dict(os.environ)
        lib = Path(binary).resolve().parent.parent / "lib"
        if lib.is_dir():  # a carried bundle (the GPU machine): its own libraries
            env["LD_LIBRARY_PATH"] = f"{lib}:{env.get('LD_LIBRARY_PATH', '')}"
        self.proc = subprocess.Popen(
            [binary, "-c", str(conf)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"mosquitto ({binary}) did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


class WorkerRun:
    """``python -m worker`` in its own process group; start-to-ready measured by its status."""

    def __init__(self, args: list[str], port: int, log: Path) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        online: list[float] = []
        watcher = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        watcher.on_message = lambda c, u, m: online.append(time.perf_counter()) if m.payload == b"online" else None
        watcher.connect("127.0.0.1", port)
        watcher.loop_start()
        watcher.subscribe("chat/_worker/bench/status", qos=1)
        time.sleep(0.3)
        started = time.perf_counter()
        self.log = open(log, "ab")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "worker", "--mqtt-port", str(port), "--worker-id", "bench", *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        while not online:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}; see {log}")
            if time.perf_counter() - started > 900:
                raise RuntimeError(f"worker not online after 900 s; see {log}")
            time.sleep(0.1)
        self.start_to_ready_s = round(online[0] - started, 1)
        watcher.disconnect()
        watcher.loop_stop()

    def rss_mb(self) -> dict[str, float]:
        import psutil

        main = psutil.Process(self.proc.pid)
        children = main.children(recursive=True)
        total = main.memory_info().rss + sum(c.memory_info().rss for c in children if c.is_running())
        return {"worker_rss_mb": round(main.memory_info().rss / 2**20, 1), "total_rss_mb": round(total / 2**20, 1)}

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(120)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


def timed(run: Callable[[], list[Record]]) -> dict[str, Any]:
    """One run's records and their summary over its wall time."""
    started = time.perf_counter()
    records = run()
    return {"summary": summarize(records, time.perf_counter() - started), "records": records}


def decode_rate(record: Record) -> float | None:
    """Decode tokens/s of one request, by the worker's own clock (first token to reply)."""
    decoding_ms = (record.worker_total_ms or 0) - (record.worker_ttft_ms or 0)
    return round((record.completion_tokens - 1) / (decoding_ms / 1000), 1) if decoding_ms > 0 else None


def worker_phase(profile: Profile, model: Path, out: Path, mosquitto: str, think_s: float = 0.0) -> dict[str, Any]:
    from worker.tokenizer import ChatTokenizer

    from .mqtt_driver import MqttDriver

    tokenizer = ChatTokenizer(str(model))
    workload = make_workload(tokenizer.count_text, max_tokens=profile.max_tokens)
    broker = Broker(mosquitto, out)
    cache_empty = not any(Path(os.environ["VLLM_CACHE_ROOT"]).glob("*"))
    worker = WorkerRun(
        ["--model", str(model), "--stats-interval", "2", *profile.worker_args], broker.port, out / "worker.log"
    )
    driver = MqttDriver("127.0.0.1", broker.port)
    result: dict[str, Any] = {"start_to_ready_s": worker.start_to_ready_s, "compile_cache_was_empty": cache_empty}
    total = (
        profile.multi_turns
        + sum(c * profile.turns for c in profile.concurrency)
        + sum(c * profile.turns for c in profile.one_at_a_time)
        + 1
    )
    rss: list[dict[str, float]] = []
    try:
        with tqdm(total=total, desc="worker", unit="req") as bar:
            driver.run_concurrent("warmup", workload, tokenizer.count_text, sessions=max(profile.concurrency), turns=1)
            runs: dict[str, Any] = {}
            runs["multi_turn"] = driver.run_concurrent(
                "multi-turn", workload, tokenizer.count_text, sessions=1, turns=profile.multi_turns, progress=bar.update
            )
            runs["concurrency"] = {}
            for count in profile.concurrency:
                runs["concurrency"][count] = timed(
                    lambda count=count: driver.run_concurrent(
                        "worker",
                        workload,
                        tokenizer.count_text,
                        sessions=count,
                        turns=profile.turns,
                        think_s=think_s,
                        progress=bar.update,
                    )
                )
                rss.append(worker.rss_mb())
            runs["one_at_a_time"] = {}
            for count in profile.one_at_a_time:
                runs["one_at_a_time"][count] = timed(
                    lambda count=count: driver.run_one_at_a_time(
                        "one-at-a-time",
                        workload,
                        tokenizer.count_text,
                        sessions=count,
                        turns=profile.turns,
                        progress=bar.update,
                    )
                )
            decode = driver.run_concurrent(
                "decode",
                workload,
                tokenizer.count_text,
                sessions=1,
                turns=1,
                max_tokens=profile.decode_tokens,
                progress=bar.update,
            )[0]
            runs["decode_batch1"] = {"record": decode, "decode_tok_per_s": decode_rate(decode)}
        runs["ping_ms"] = driver.ping(200)
        runs["rss"] = rss
        runs["worker_stats"] = driver.stats[-1] if driver.stats else None
        runs["kv_cache_usage_max"] = max((s["kvCacheUsage"] for s in driver.stats), default=None)
        result.update(runs)
    finally:
        driver.close()
        worker.stop()
        broker.stop()
    return result


def structured_phase(profile: Profile, model: Path, out: Path, mosquitto: str) -> dict[str, Any]:
    """The same requests with and without a JSON schema, through the worker."""
    from worker.tokenizer import ChatTokenizer

    from .mqtt_driver import MqttDriver

    tokenizer = ChatTokenizer(str(model))
    workload = make_workload(tokenizer.count_text, max_tokens=profile.max_tokens)
    broker = Broker(mosquitto, out)
    worker = WorkerRun(["--model", str(model), *profile.worker_args], broker.port, out / "worker-structured.log")
    driver = MqttDriver("127.0.0.1", broker.port)
    result: dict[str, Any] = {}
    schema = {"responseFormat": {"type": "json_schema", "schema": SCHEMA}}
    try:
        driver.run_concurrent("warmup", workload, tokenizer.count_text, sessions=profile.structured_sessions, turns=1)
        # The first request with a schema waits for xgrammar to compile it (vLLM then caches
        # the grammar): measured on its own, so the runs below show the steady per-token cost.
        # minLength 400 makes this schema slow to compile (1.3 s on the CI CPU; 3 ms for a
        # schema of a few plain fields), which would otherwise be charged to throughput.
        n = profile.structured_sessions
        runs: list[tuple[str, dict[str, Any] | None, int, int]] = [
            ("first_use", schema, 1, 1),
            ("plain", None, n, 2),
            ("json_schema", schema, n, 2),
            ("plain_again", None, n, 2),
        ]
        for name, extra, sessions, turns in runs:
            run = functools.partial(
                driver.run_concurrent,
                f"structured-{name}",
                workload,
                tokenizer.count_text,
                sessions=sessions,
                turns=turns,
                extra=extra,
                max_tokens=profile.max_tokens,
            )
            try:
                result[name] = timed(run)
            except RuntimeError as exc:  # an error reply: a result to report, not a crash
                result[name] = {"error": str(exc)[:1000]}
                driver.drain(5)
    finally:
        driver.close()
        worker.stop()
        broker.stop()
    return result


async def inprocess_phase(profile: Profile, model: Path) -> dict[str, Any]:
    from worker.tokenizer import ChatTokenizer

    from .inprocess import InProcess

    tokenizer = ChatTokenizer(str(model))
    workload = make_workload(tokenizer.count_text, max_tokens=profile.max_tokens)
    engine = InProcess(profile.engine_config(model), tokenizer)
    result: dict[str, Any] = {"engine_start_s": engine.start_s, "block_size": engine.block_size, "ceiling": {}}
    total = profile.multi_turns + sum(c * profile.turns for c in profile.concurrency)
    try:
        with tqdm(total=total, desc="in-process", unit="req") as bar:
            await engine.sessions("warmup", workload, sessions=max(profile.concurrency), turns=1)
            result["before"] = await engine.before(
                workload, turns=profile.multi_turns, max_tokens=profile.before_max_tokens, progress=bar.update
            )
            for count in profile.concurrency:
                started = time.perf_counter()
                records = await engine.sessions(
                    "ceiling", workload, sessions=count, turns=profile.turns, progress=bar.update
                )
                result["ceiling"][count] = {
                    "summary": summarize(records, time.perf_counter() - started),
                    "records": records,
                }
        result["decode_batch1"] = await engine.decode_rate(workload, max_tokens=profile.decode_tokens)
    finally:
        engine.shutdown()
    return result


async def ablation_phase(profile: Profile, model: Path, out: Path) -> None:
    from worker.tokenizer import ChatTokenizer

    from .inprocess import InProcess

    tokenizer = ChatTokenizer(str(model))
    workload = make_workload(tokenizer.count_text, max_tokens=profile.max_tokens)
    for name, overrides in profile.ablation.items():
        path = out / f"ablation-{name}.json"
        if path.exists():
            continue
        config = profile.engine_config(model, **overrides)
        print(f"ablation {name}: {overrides}", flush=True)
        try:
            engine = InProcess(config, tokenizer)
        except Exception as exc:  # a setting this vLLM refuses is a result too
            save(path, {"settings": overrides, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            continue
        try:
            result = {
                "settings": overrides,
                "engine_start_s": engine.start_s,
                "batch1": await engine.decode_rate(workload, max_tokens=profile.decode_tokens),
                "batch64": await engine.decode_rate(workload, max_tokens=256, batch=64),
            }
        finally:
            engine.shutdown()
        save(path, result)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    parser.add_argument("--model", type=Path, help="model directory (default: generated per profile)")
    parser.add_argument("--geometry", help="generate a real geometry (dummy weights), e.g. qwen2.5-7b")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--phases", default="worker,inprocess,structured,restart,ablation")
    parser.add_argument("--mosquitto", default=shutil.which("mosquitto") or "/usr/sbin/mosquitto")
    parser.add_argument(
        "--think-time",
        type=float,
        default=0.0,
        help="seconds a user waits after a reply before the next turn (concurrency runs)",
    )
    args = parser.parse_args(argv)
    profile = PROFILES[args.profile]
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VLLM_CACHE_ROOT", str(REPO / ".cache" / "vllm"))
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    model = args.model or prepare_model(args.geometry, out)
    meta_path = out / "meta.json"
    if not meta_path.exists():
        save(
            meta_path,
            {
                **run_metadata(model, profile.engine_overrides),
                "profile": args.profile,
                "worker_args": profile.worker_args,
            },
        )
    for phase in args.phases.split(","):
        path = out / f"{phase}.json"
        if path.exists() and phase != "ablation":
            print(f"{phase}: done before ({path})")
            continue
        started = time.perf_counter()
        if phase == "worker":
            save(path, worker_phase(profile, model, out, args.mosquitto, think_s=args.think_time))
        elif phase == "structured":
            save(path, structured_phase(profile, model, out, args.mosquitto))
        elif phase == "inprocess":
            save(path, asyncio.run(inprocess_phase(profile, model)))
        elif phase == "restart":
            save(path, restart_phase(profile, model, out, args.mosquitto))
        elif phase == "ablation" and profile.ablation:
            asyncio.run(ablation_phase(profile, model, out))
        print(f"{phase}: {time.perf_counter() - started:.0f} s", flush=True)
    from .report import write_report

    write_report(out)
    return 0


def restart_phase(profile: Profile, model: Path, out: Path, mosquitto: str) -> dict[str, Any]:
    """A second start on the compile cache the first one filled (as systemd's CacheDirectory keeps it)."""
    broker = Broker(mosquitto, out)
    try:
        worker = WorkerRun(["--model", str(model), *profile.worker_args], broker.port, out / "worker-restart.log")
        worker.stop()
    finally:
        broker.stop()
    first = load(out / "worker.json")
    return {"cold_start_to_ready_s": first["start_to_ready_s"], "warm_start_to_ready_s": worker.start_to_ready_s}


def prepare_model(geometry: str | None, out: Path) -> Path:
    from worker.tinymodel import generate_geometry_model, generate_tiny_model

    model = REPO / ".cache" / "models" / (geometry or "tiny")
    if not (model / "config.json").exists():
        if geometry:
            generate_geometry_model(model, geometry)
        else:
            generate_tiny_model(model)
    return model
