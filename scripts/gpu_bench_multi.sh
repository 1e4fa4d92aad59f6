#!/usr/bin/env bash
# Several GPUs of one host (bench/multigpu.py) on the 2-GPU machine (two H200; vLLM 0.26
# installed there as for scripts/gpu_bench.sh, mosquitto carried to /root/mosq). Results
# accumulate in bench/results/gpu-2x/GEOMETRY of the repo copy (phases already there are
# skipped: a run that does not fit one command continues where it stopped) and come back as
# one tarball in $OUT.
# Usage: bash scripts/gpu_bench_multi.sh GEOMETRY PHASES [PROFILE]
#   bash scripts/gpu_bench_multi.sh qwen2.5-7b single,dp     # data parallel: two workers, one share group
#   bash scripts/gpu_bench_multi.sh qwq-32b single,tp        # tensor parallel 2 against one GPU
# The workers of a share group need the shared store to see each session's whole history
# (multi.md counts the turns served without it): BENCH_REDIS_SERVER=/path/to/redis-server
# starts one per phase and gives every phase's workers the Redis store and intake (the same
# store for the single worker, so the comparison is like for like); BENCH_WORKER_ARGS replaces
# those worker flags ({redis_port}: the port of that redis-server). The worker needs the redis
# Python package. (Not WORKER_*: the worker refuses unknown WORKER_ environment variables.)
set -euo pipefail
cd "$(dirname "$0")/.."
geometry=$1 phases=$2 profile=${3:-gpu}
export PYTHONPATH="/root/site:$PWD" VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  PYTHONUNBUFFERED=1 VLLM_CACHE_ROOT=/root/vllm-cache
name=$geometry${profile#gpu}
out=bench/results/gpu-2x/$name
mkdir -p "$out"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee -a "$out/bench.log"
if [ -n "${BENCH_REDIS_SERVER:-}" ] && [ -z "${BENCH_WORKER_ARGS:-}" ]; then
  BENCH_WORKER_ARGS="--store redis --redis-url redis://127.0.0.1:{redis_port}/0 --mqtt-session-expiry 0"
fi
extra=()
[ -n "${BENCH_WORKER_ARGS:-}" ] && extra+=(--worker-args "$BENCH_WORKER_ARGS")
[ -n "${BENCH_REDIS_SERVER:-}" ] && extra+=(--redis-server "$BENCH_REDIS_SERVER")
status=0
python3 -m bench.multigpu --profile "$profile" --geometry "$geometry" --out "$out" --phases "$phases" \
  --mosquitto /root/mosq/bin/mosquitto "${extra[@]}" 2>&1 | tee -a "$out/bench.log" | grep -v "it/s\]$" || status=$?
tar czf "${OUT:-/tmp}/gpu2x-$name.tgz" --exclude=state -C bench/results/gpu-2x "$name"
exit $status
