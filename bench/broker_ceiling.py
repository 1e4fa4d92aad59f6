"""What one mosquitto routes when its clients cost almost nothing: C clients (mosquitto_pub -l
and mosquitto_sub) on the request topic layout and the workers' shared subscription, QoS 1.

    python -m bench.broker_ceiling --out bench/results/scale --messages 200000

``--publishers`` mosquitto_pub processes each send ``--messages`` requests (a ~200-byte JSON
request, ``--repeat``: one after another, each on its own user/session topic) as fast as the
broker takes them; ``--subscribers`` mosquitto_sub processes share
``$share/sim/chat/+/+/request``. (``mosquitto_pub -l`` would not do: 2.0.11 exits at the end of
its input with most lines unsent.) The rates are the broker's own $SYS counters. The
bench/scale.py load test runs out of Python (workers and generators) long before the broker;
this is the broker's own ceiling on the same machine: messages/s against the broker's CPU.
Writes OUT/broker-ceiling.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from .common import save
from .runs import start_broker
from .scale import SysCounters, cpu_seconds
from .simworkers import GROUP, PREFIX


def measure(mosquitto: str, out: Path, publishers: int, subscribers: int, messages: int) -> dict[str, Any]:
    import psutil

    broker = start_broker(mosquitto, out, "sys_interval 1\n")
    counters = SysCounters(broker.port)
    port = str(broker.port)
    common = ["-h", "127.0.0.1", "-p", port, "-q", "1", "-V", "mqttv5"]
    payload = json.dumps({"message": "hello " * 25, "maxTokens": 64, "stream": True})
    shared = f"$share/{GROUP}/{PREFIX}/+/+/request"
    sub = ["mosquitto_sub", *common, "-t", shared]
    subs = [subprocess.Popen(sub, stdout=subprocess.DEVNULL) for _ in range(subscribers)]
    time.sleep(1.5)
    try:
        cpu_before = cpu_seconds([broker.proc.pid])
        psutil.cpu_percent()
        start = time.perf_counter()
        pubs = []
        for i in range(publishers):
            topic = f"{PREFIX}/u{i}/s{i}/request"
            pub = ["mosquitto_pub", *common, "-t", topic, "-m", payload, "--repeat", str(messages)]
            pubs.append(subprocess.Popen(pub))
        for pub in pubs:
            pub.wait(600)
        elapsed = time.perf_counter() - start
        machine = psutil.cpu_percent() / 100 * (psutil.cpu_count() or 1)
        broker_cpu = (cpu_seconds([broker.proc.pid]) - cpu_before) / elapsed
        time.sleep(2.2)  # the $SYS counters of the last second
        rates = counters.rates(start, time.perf_counter() - 1.0)
    finally:
        counters.close()
        for sub in subs:
            sub.terminate()
            sub.wait(10)
        broker.stop()
    total = publishers * messages
    return {
        "publishers": publishers,
        "subscribers": subscribers,
        "messages": total,
        "payload_bytes": len(payload),
        "elapsed_s": round(elapsed, 2),
        "messages_per_s": round(total / elapsed),
        "broker_per_s": rates,
        "cpu_cores": {"broker": round(broker_cpu, 2), "machine": round(machine, 2)},
    }


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.broker_ceiling", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--publishers", type=int, default=2)
    parser.add_argument("--subscribers", type=int, default=10)
    parser.add_argument("--messages", type=int, default=200_000, help="per publisher")
    parser.add_argument("--mosquitto", default=shutil.which("mosquitto") or "/usr/sbin/mosquitto")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result = measure(args.mosquitto, args.out, args.publishers, args.subscribers, args.messages)
    path = args.out / "broker-ceiling.json"
    runs = json.loads(path.read_text()) if path.exists() else []
    save(path, [*runs, result])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
