#!/usr/bin/env bash
# The burst phases (bench/burst.py) on the GPU machine, one phase per call (each fits the
# machine's 10 minutes a command), vLLM 0.26 installed there as ../shared/device/README.md shows
# and mosquitto carried to /root/mosq. Results accumulate in /root/bench/GEOMETRY-burst, outside
# the repo copy (a later call's copy of the tree does not remove them while the machine stays
# warm), and come back as one tarball in $OUT, with the phase's output in $OUT/PHASE.log.
# Usage: bash scripts/gpu_burst.sh PHASE [GEOMETRY] [PROFILE]   e.g. burst_new qwen3-1.7b
set -euo pipefail
cd "$(dirname "$0")/.."
phase=$1 geometry=${2:-qwen3-1.7b} profile=${3:-gpu}
export PYTHONPATH="/root/site:$PWD" VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  PYTHONUNBUFFERED=1 VLLM_CACHE_ROOT=/root/vllm-cache
name=$geometry-burst${profile#gpu}
out=/root/bench/$name
model=/root/models/$geometry
mkdir -p "$out"
[ -f "$model/config.json" ] || python3 -m devtools.tinymodel "$model" --geometry "$geometry"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt" || true
status=0
python3 -m bench --profile "$profile" --model "$model" --out "$out" --phases "$phase" \
  --mosquitto /root/mosq/bin/mosquitto 2>&1 | tee -a "$out/bench.log" | grep -v "it/s\]$" \
  | tee "${OUT:-/tmp}/$phase.log" || status=$?
tar czf "${OUT:-/tmp}/gpu-$name.tgz" -C /root/bench "$name"
exit $status
