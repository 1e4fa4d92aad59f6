"""Many workers, one broker: a load test of the MQTT side with an engine that costs nothing.

    python -m bench.scale --out bench/results/scale --workers 10,50,100 --rates 250,500,1000,2000

N simulated workers (the real Service and MqttTransport, each its own MQTT client, client id and
status topic, all in one share group: ``$share/<group>/<prefix>/+/+/request``) run in a few
processes on one real mosquitto; their engine answers at once (``--reply-tokens`` tokens in
``--deltas`` steps, or over ``--gen-ms``). Load generators open sessions at a fixed rate (open
loop: each request a new session, sent on schedule whatever the replies do, as 1,000 users
arriving per second would) and time each reply. Each rate runs ``--duration`` seconds; per
step: replies received and their latency percentiles, the broker's message rates (its $SYS
counters), and the CPU the broker, the workers and the generators used (in cores). A worker
count whose file OUT/scale-w<N>.json exists is skipped (resumable); OUT/scale.md sums up.
Everything shares this machine's cores: the numbers say where one machine saturates and which
part saturates first, not what a broker on its own host would do.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from devtools.redis_server import RedisServer

from .common import REPO, percentile, save
from .simworkers import PREFIX, host_workers


def generate_load(
    port: int, user: str, rate: float, duration: float, reply_tokens: int, gen_s: float, grace: float
) -> dict[str, Any]:
    """Open loop: one request on a new session every 1/rate s; the reply time of each. Prints
    ``start`` when it begins sending (the orchestrator's measuring window opens). Replies count
    as in the window until ``gen_s`` (a reply's generation time) after it closes."""
    from devtools.mqtt_client import connect

    received: list[tuple[float, str]] = []  # list.append is atomic: paho's thread only appends
    streamed = [0]

    errors: list[str] = []

    def on_message(message: Any) -> None:
        if message.topic.endswith("/reply"):
            if b'"error":' in message.payload:  # an answer, but not a generated one
                errors.append(message.payload.decode()[:300])
            received.append((time.perf_counter(), message.topic))
        else:
            streamed[0] += 1

    # Streams at QoS 0, as chat frontends take them: the broker sends them. No limit on the
    # messages in flight: paho's default of 20 would pace the sends, not the rate.
    subscriptions = [(f"{PREFIX}/{user}/+/reply", 1), (f"{PREFIX}/{user}/+/stream", 0)]
    client = connect(port, subscriptions, on_message=on_message, client_id=f"load-{user}", max_inflight=0)
    total = int(rate * duration)
    sent: dict[str, float] = {}
    payload = json.dumps({"message": "hello " * 20, "maxTokens": reply_tokens, "stream": True})
    print("start", flush=True)
    cpu_started = time.process_time()
    started = time.perf_counter()
    for k in range(total):
        due = started + k / rate
        ahead = due - time.perf_counter()
        if ahead > 0.001:
            time.sleep(ahead)
        session = f"s{k}"
        sent[session] = time.perf_counter()
        client.publish(f"{PREFIX}/{user}/{session}/request", payload, qos=1)
    send_s = time.perf_counter() - started
    send_cpu_s = time.process_time() - cpu_started  # this process, all its threads
    deadline = time.perf_counter() + grace
    while len(received) < total and time.perf_counter() < deadline:
        time.sleep(0.05)
    client.disconnect()
    client.loop_stop()
    latencies = [(at - sent[topic.split("/")[2]]) * 1000 for at, topic in received if topic.split("/")[2] in sent]
    replied_in_window = sum(1 for at, _ in received if at <= started + duration + gen_s)
    return {
        "sent": total,
        "send_s": round(send_s, 3),
        "replies": len(latencies),
        "replies_per_s_in_window": round(replied_in_window / duration, 1),
        "send_cpu_s": round(send_cpu_s, 3),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "stream_messages": streamed[0],
        "latencies_ms": latencies,
    }


def cpu_seconds(pids: list[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system + times.children_user + times.children_system
        except psutil.NoSuchProcess:
            pass
    return total


class SysCounters:
    """The broker's $SYS counters, published every second (sys_interval 1), with the time
    each update arrived: a rate over a window is the change between the first and the last
    update inside it, over the time between them."""

    TOPICS = ("publish/messages/received", "publish/messages/sent", "messages/received", "messages/sent")

    def __init__(self, port: int) -> None:
        from devtools.mqtt_client import connect

        self.updates: list[tuple[float, str, int]] = []
        self.client = connect(
            port,
            [(f"$SYS/broker/{topic}", 0) for topic in self.TOPICS],
            on_message=lambda m: self.updates.append(
                (time.perf_counter(), m.topic[len("$SYS/broker/") :], int(m.payload))
            ),
        )

    def rates(self, start: float, end: float) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for topic in self.TOPICS:
            inside = [(t, v) for t, name, v in list(self.updates) if name == topic and start <= t <= end]
            span = inside[-1][0] - inside[0][0] if len(inside) > 1 else 0
            out[topic] = round((inside[-1][1] - inside[0][1]) / span, 1) if span > 0 else None
        return out

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def run_workers(args: argparse.Namespace, workers: int, out: Path) -> dict[str, Any]:
    from .runs import start_broker, start_redis

    sys_settings = "sys_interval 1\n"
    broker = start_broker(args.mosquitto, out, sys_settings)
    processes = min(args.processes, workers)
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
    hosts: list[subprocess.Popen[str]] = []
    options = {"reply_tokens": args.reply_tokens, "deltas": args.deltas, "gen_s": args.gen_ms / 1000}
    result: dict[str, Any] = {"workers": workers, "worker_processes": processes, "steps": []}
    counters = SysCounters(broker.port)
    redis = start_redis(args.redis_server, out) if args.redis_server else None
    if redis is not None:
        options["redis_url"] = f"redis://127.0.0.1:{redis.port}/0"
        result["store"] = "redis"
    engine = json.dumps(options)
    try:
        for p in range(processes):
            first, count = p * workers // processes, (p + 1) * workers // processes - p * workers // processes
            cmd = [sys.executable, "-m", "bench.scale", "host", str(broker.port), str(first), str(count), engine]
            hosts.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True))
        for host in hosts:
            assert host.stdout is not None
            if host.stdout.readline().strip() != "ready":
                raise RuntimeError("a worker host did not start")
        for rate in args.rates:
            step = run_step(args, broker, hosts, counters, rate, redis)
            step["workers"] = workers
            result["steps"].append(step)
            print(json.dumps({k: v for k, v in step.items() if k != "latencies_ms"}), flush=True)
            slow = step["p95_ms"] > args.gen_ms + args.saturated_p95_ms
            if step["error_replies"]:
                raise RuntimeError(f"error replies: {step['first_error']}")
            if step["replies_per_s_in_window"] < 0.95 * step["send_rate"] or slow:
                break  # saturated: higher rates only queue more
    finally:
        counters.close()
        for host in hosts:
            host.send_signal(signal.SIGTERM)
        for host in hosts:
            try:
                host.wait(20)
            except subprocess.TimeoutExpired:
                host.kill()
        broker.stop()
        if redis is not None:
            redis.stop()
    return result


def run_step(
    args: argparse.Namespace,
    broker: Any,
    hosts: list[subprocess.Popen[str]],
    counters: SysCounters,
    rate: float,
    redis: RedisServer | None,
) -> dict[str, Any]:
    import psutil

    gens = args.generators
    cmd = [sys.executable, "-m", "bench.scale", "load", str(broker.port)]
    worker_pids = [h.pid for h in hosts]
    loads = [
        subprocess.Popen(
            [*cmd, f"u{g}", str(rate / gens), str(args.duration), str(args.reply_tokens), str(args.gen_ms / 1000)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        for g in range(gens)
    ]
    for load in loads:
        assert load.stdout is not None
        if load.stdout.readline().strip() != "start":
            raise RuntimeError("a load generator did not start")
    # The window: while the generators send (they start within a few ms of each other).
    start = time.perf_counter()
    before = {"broker": cpu_seconds([broker.proc.pid]), "workers": cpu_seconds(worker_pids)}
    if redis is not None:
        before |= {"redis": cpu_seconds([redis.proc.pid]), "commands": redis.commands()}
    psutil.cpu_percent()
    time.sleep(args.duration)
    window = time.perf_counter() - start
    machine_cpu = psutil.cpu_percent() / 100 * (os.cpu_count() or 1)
    after = {"broker": cpu_seconds([broker.proc.pid]), "workers": cpu_seconds(worker_pids)}
    if redis is not None:
        after |= {"redis": cpu_seconds([redis.proc.pid]), "commands": redis.commands()}
    end = time.perf_counter()
    outputs = [json.loads(load.communicate()[0].splitlines()[-1]) for load in loads]
    load_cpu = sum(o["send_cpu_s"] / o["send_s"] for o in outputs)
    latencies = [lat for o in outputs for lat in o["latencies_ms"]]
    sent = sum(o["sent"] for o in outputs)
    store: dict[str, Any] = {}
    if redis is not None:
        store = {
            "redis_cpu_cores": round((after["redis"] - before["redis"]) / window, 2),
            "redis_commands_per_s": round((after["commands"] - before["commands"]) / window),
        }
    return {
        **store,
        "rate": rate,
        "sent": sent,
        "send_rate": round(sent / max(o["send_s"] for o in outputs), 1),
        "replies": len(latencies),
        "error_replies": sum(o["errors"] for o in outputs),
        "first_error": next((o["first_error"] for o in outputs if o["first_error"]), None),
        "stream_messages_per_reply": round(sum(o["stream_messages"] for o in outputs) / max(len(latencies), 1), 2),
        "replies_per_s_in_window": round(sum(o["replies_per_s_in_window"] for o in outputs), 1),
        "p50_ms": round(percentile(latencies, 50), 1),
        "p95_ms": round(percentile(latencies, 95), 1),
        "p99_ms": round(percentile(latencies, 99), 1),
        "max_ms": round(max(latencies, default=float("nan")), 1),
        "cpu_cores": {
            "broker": round((after["broker"] - before["broker"]) / window, 2),
            "workers": round((after["workers"] - before["workers"]) / window, 2),
            "generators": round(load_cpu, 2),
            "machine": round(machine_cpu, 2),
        },
        "broker_per_s": counters.rates(start, end),
        "loadavg_1min": round(os.getloadavg()[0], 2),
    }


def markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# Many workers, one mosquitto (simulation)",
        "",
        f"{meta['machine']}; mosquitto {meta['mosquitto']}; zero-cost engine "
        f"({meta['reply_tokens']} tokens in {meta['deltas']} stream steps, {meta['gen_ms']} ms); "
        f"{meta['duration']} s per rate; commit {meta['commit']}.",
        "",
        "| workers | rate sent/s | replies/s | replied | p50 ms | p95 ms | p99 ms | broker PUBLISH in/s | "
        "out/s | broker CPU | workers CPU | generators CPU | machine CPU | Redis CPU | Redis commands/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        for s in result["steps"]:
            cpu, sysr = s["cpu_cores"], s["broker_per_s"]
            cells = [
                s["workers"],
                s["send_rate"],
                s["replies_per_s_in_window"],
                f"{s['replies'] / s['sent']:.3f}",
                s["p50_ms"],
                s["p95_ms"],
                s["p99_ms"],
                sysr.get("publish/messages/received"),
                sysr.get("publish/messages/sent"),
                cpu["broker"],
                cpu["workers"],
                cpu["generators"],
                cpu["machine"],
                s.get("redis_cpu_cores", ""),
                s.get("redis_commands_per_s", ""),
            ]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += ["", "CPU in cores (1.0 = one core busy) over the step; the machine has "]
    lines[-1] += f"{os.cpu_count()} cores shared with whatever else ran (load average in the JSON)."
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "host":
        port, first, count, engine = argv[1:5]
        asyncio.run(host_workers(int(port), int(first), int(count), json.loads(engine)))
        return 0
    if argv and argv[0] == "load":
        port, user, rate, duration, reply_tokens, gen_s = argv[1:7]
        result = generate_load(int(port), user, float(rate), float(duration), int(reply_tokens), float(gen_s), grace=10)
        print(json.dumps(result))
        return 0
    import shutil

    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workers", default="10,50", help="comma separated worker counts")
    parser.add_argument("--processes", type=int, default=5, help="processes the workers are spread over")
    parser.add_argument("--generators", type=int, default=1, help="load generator processes")
    parser.add_argument("--rates", type=lambda s: [float(r) for r in s.split(",")], default=[250, 500, 1000, 2000])
    parser.add_argument("--duration", type=float, default=10)
    parser.add_argument("--reply-tokens", type=int, default=64)
    parser.add_argument("--deltas", type=int, default=4, help="engine updates per reply")
    parser.add_argument("--gen-ms", type=float, default=0, help="time each reply takes to generate")
    parser.add_argument("--saturated-p95-ms", type=float, default=1000)
    parser.add_argument("--redis-server", help="the workers share a Redis store and intake (this redis-server)")
    parser.add_argument("--mosquitto", default=shutil.which("mosquitto") or "/usr/sbin/mosquitto")
    args = parser.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    from .common import current_commit, run_metadata

    version = subprocess.run([args.mosquitto, "-h"], capture_output=True, text=True).stdout.split("\n")[0]
    meta = {
        "machine": run_metadata(REPO, {})["machine"],
        "mosquitto": version.replace("mosquitto version ", ""),
        "commit": current_commit(),
        **{k: getattr(args, k) for k in ("reply_tokens", "deltas", "gen_ms", "duration", "processes", "generators")},
    }
    results = []
    for workers in (int(w) for w in args.workers.split(",")):
        path = out / f"scale-w{workers}.json"
        if not path.exists():
            result = run_workers(args, workers, out)
            save(path, {**result, "meta": meta})
        results.append(json.loads(path.read_text()))
    (out / "scale.md").write_text(markdown(results, meta))
    print((out / "scale.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
