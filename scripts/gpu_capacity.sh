#!/usr/bin/env bash
# The capacity phases (bench/capacity.py) and the FP8 phase on the GPU machine, one phase per
# call (each fits the machine's 10 minutes a command), vLLM 0.26 installed there as
# ../shared/device/README.md shows and mosquitto carried to /root/mosq. Results accumulate in
# /root/bench/GEOMETRY-capacity, outside the repo copy (a later call's copy of the tree does
# not remove them while the machine stays warm), and come back as one tarball in $OUT.
# Usage: BENCH_GIT_COMMIT=SHA bash scripts/gpu_capacity.sh PHASE [GEOMETRY] [PROFILE]
#   PHASE: capacity (first: it measures the first burst on empty compile caches),
#   capacity_offload, fp8; or capacity with PROFILE gpu-firstburst (on a fresh machine) and
#   then gpu-firstburst-nowarmup: the first bursts only, with and without the warm-up; the
#   full-scale runs (profiles gpu-fullscale, -mid, -fp8, -fp8-mid; PHASE returning[_offload] with
#   gpu-returning, -40, -fp8), as docs/benchmarks/capacity-fullscale.md lists them.
set -euo pipefail
cd "$(dirname "$0")/.."
phase=$1 geometry=${2:-qwq-32b} profile=${3:-gpu}
export PYTHONPATH="/root/site:$PWD" VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  PYTHONUNBUFFERED=1 VLLM_CACHE_ROOT=/root/vllm-cache
name=$geometry-capacity${profile#gpu}
# Each profile its own Triton cache: empty at its first start.
export TRITON_CACHE_DIR=/root/triton/$profile
out=/root/bench/$name
model=/root/models/$geometry
mkdir -p "$out"
[ -f "$model/config.json" ] || python3 -m devtools.tinymodel "$model" --geometry "$geometry"
status=0
python3 -m bench --profile "$profile" --model "$model" --out "$out" --phases "$phase" \
  --mosquitto /root/mosq/bin/mosquitto 2>&1 | tee -a "$out/bench.log" | grep -v "it/s\]$" || status=$?
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt" || true
free -g > "$out/host-memory.txt" || true
tar czf "${OUT:-/tmp}/gpu-$name.tgz" -C /root/bench "$name"
exit $status
