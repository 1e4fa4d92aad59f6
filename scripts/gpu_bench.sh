#!/usr/bin/env bash
# The benchmark on the GPU machine (vLLM 0.26 installed there as ../shared/device/README.md
# shows; mosquitto carried to /root/mosq). Results accumulate in bench/results/gpu/GEOMETRY
# of the repo copy (phases already there are skipped: a long run continues where it stopped)
# and come back as one tarball in $OUT.
# Usage: bash scripts/gpu_bench.sh GEOMETRY PHASES [PROFILE]   e.g. qwen2.5-7b worker,inprocess gpu
# BENCH_THINK_TIME=S: users think S seconds on average between turns; results go to
# bench/results/gpu/GEOMETRY[-PROFILE]-think-S instead.
set -euo pipefail
cd "$(dirname "$0")/.."
geometry=$1 phases=$2 profile=${3:-gpu}
export PYTHONPATH="/root/site:$PWD" VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  PYTHONUNBUFFERED=1 VLLM_CACHE_ROOT=/root/vllm-cache
think=${BENCH_THINK_TIME:-0}
name=$geometry${profile#gpu}
[ "$think" = 0 ] || name=$name-think-$think
out=bench/results/gpu/$name
mkdir -p "$out"
status=0
python3 -m bench --profile "$profile" --geometry "$geometry" --out "$out" --phases "$phases" \
  --think-time "$think" --mosquitto /root/mosq/bin/mosquitto 2>&1 | tee -a "$out/bench.log" | grep -v "it/s\]$" || status=$?
tar czf "${OUT:-/tmp}/gpu-$name.tgz" -C bench/results/gpu "$name"
exit $status
