#!/usr/bin/env bash
# On the GPU machine (see ../shared/device/README.md for installing vLLM 0.26 there): a
# real-geometry model with dummy weights, a local mosquitto, the worker, and bench/smoke.py.
# Usage: bash scripts/gpu_smoke.sh GEOMETRY OUT_DIR [worker flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
geometry=$1 out=$2; shift 2
mkdir -p "$out"
export PYTHONPATH="/root/site:$PWD" VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  PYTHONUNBUFFERED=1
model=/tmp/model-$geometry
[ -f "$model/config.json" ] || python3 -m worker.tinymodel "$model" --geometry "$geometry"
printf 'listener 1883 127.0.0.1\nallow_anonymous true\nset_tcp_nodelay true\n' > /tmp/mosquitto.conf
LD_LIBRARY_PATH=/root/mosq/lib /root/mosq/bin/mosquitto -c /tmp/mosquitto.conf >/dev/null 2>&1 &
broker=$!
setsid python3 -m worker --model "$model" --engine-extra '{"load_format": "dummy"}' --worker-id gpu \
  --stats-interval 5 "$@" >"$out/worker-$geometry.log" 2>&1 &
worker=$!
python3 bench/smoke.py --worker-id gpu --wait-online 600 --json "$out/smoke-$geometry.json" \
  --turns 6 --sessions 1 8 32 64 || { tail -50 "$out/worker-$geometry.log"; exit 1; }
grep -E "Engine ready|Starting vLLM|Stats:" "$out/worker-$geometry.log" | tail -4
kill -TERM "$worker"; timeout 60 tail --pid="$worker" -f /dev/null || true
kill -KILL -- "-$worker" 2>/dev/null || true
kill "$broker" || true
grep -E "Stopped" "$out/worker-$geometry.log"
