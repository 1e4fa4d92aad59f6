"""Start to online of the worker, one start after another on one machine: what a setting costs
at start (the host KV tier and how it is pinned, a cold compile cache).

    python3 bench/starts.py MOSQUITTO '[{"label": "tier off", "args": ["--kv-offload-gib", "0"]},
                                        {"label": "default tier", "args": []},
                                        {"label": "single-thread pinning", "args": [],
                                         "env": {"PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:False"}}]'

Each entry is a worker start on the QwQ-32B geometry with dummy weights (``args``: more worker
flags, ``env``: more environment); it prints the start's KV lines and its seconds from start to
the retained ``online``, and writes $OUT/starts/starts.json (OUT: the device tool's folder).
The first start of a setting whose compile cache is empty compiles (vLLM keys the cache by the
engine's configuration, the tier's size included): run a setting twice to see a warm start.
Results: bench/results/gpu/qwq-32b-kvtier-start/, docs/benchmarks/kv-tier-start.md.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.getcwd())
from bench.runs import STOP_TIMEOUT, start_broker, start_worker
from devtools.tinymodel import generate_geometry_model

KEPT = ("KV offloading", "Engine ready", "Engine:", "pinned by threads")


def main() -> None:
    out = Path(os.environ.get("OUT", "/tmp")) / "starts"
    (out / "broker").mkdir(parents=True, exist_ok=True)
    model = generate_geometry_model(Path(".cache/models/qwq-32b-tools"), "qwq-32b")
    broker = start_broker(sys.argv[1], out / "broker")
    results = []
    try:
        for i, entry in enumerate(json.loads(sys.argv[2])):
            env = {**os.environ, **entry.get("env", {})}
            args = ["--model", str(model), "--engine-extra", '{"load_format": "dummy"}', *entry.get("args", [])]
            log = out / f"worker{i}.log"
            worker = start_worker(args, broker.port, log, env=env)
            result = {"label": entry["label"], "start_to_ready_s": worker.start_to_ready_s}
            for line in log.read_text().splitlines():
                if any(k in line for k in KEPT):
                    print("   ", line[-260:])
            worker.stop(STOP_TIMEOUT)
            print(json.dumps(result), flush=True)
            results.append(result)
    finally:
        (out / "starts.json").write_text(json.dumps(results, indent=1))
        broker.stop()


if __name__ == "__main__":
    main()
