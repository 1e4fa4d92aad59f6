#!/usr/bin/env bash
# The vision phase (bench/vision.py) on the GPU machine, vLLM 0.26 installed there as
# ../shared/device/README.md shows and mosquitto carried to /root/mosq: the qwen3-vl-2b geometry
# (dummy weights, real processor files), the worker over mosquitto and then raw AsyncLLM, in one
# call. Results land in /root/bench/qwen3-vl-2b-images and come back as a tarball in $OUT, with
# the phase's output in $OUT/vision.log.
# Usage: bash scripts/gpu_vision.sh [GEOMETRY] [PROFILE]   e.g. qwen3-vl-2b gpu
# VISION_SESSIONS=1,64: only these session counts (default: the profile's); VISION_TIMEOUT_S: the
# phase's limit in seconds (default 540).
set -euo pipefail
cd "$(dirname "$0")/.."
geometry=${1:-qwen3-vl-2b} profile=${2:-gpu}
export PYTHONPATH="/root/site:$PWD" VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  PYTHONUNBUFFERED=1 VLLM_CACHE_ROOT=/root/vllm-cache
name=$geometry-images${profile#gpu}
out=/root/bench/$name
model=/root/models/$geometry
mkdir -p "$out"
[ -f "$model/config.json" ] || python3 -m devtools.tinyvision "$model" --geometry "$geometry"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt" || true
status=0
timeout "${VISION_TIMEOUT_S:-540}" python3 -m bench --profile "$profile" --model "$model" --out "$out" \
  --phases vision ${VISION_SESSIONS:+--vision-sessions "$VISION_SESSIONS"} --mosquitto /root/mosq/bin/mosquitto 2>&1 | tee -a "$out/bench.log" | grep -v "it/s\]$" \
  | tee "${OUT:-/tmp}/vision.log" || status=$?
tar czf "${OUT:-/tmp}/gpu-$name.tgz" -C /root/bench "$name"
exit $status
