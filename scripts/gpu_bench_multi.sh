#!/usr/bin/env bash
# Several GPUs of one host (bench/multigpu.py) on a GPU machine with two or four GPUs (vLLM 0.26
# installed there as for scripts/gpu_bench.sh, mosquitto carried to /root/mosq). Every visible
# GPU is used (--gpus: one data-parallel worker each; tensor parallel over all of them). Results
# accumulate in $BENCH_RESULTS/gpu-<N>x/GEOMETRY (default /root/bench, outside the repo copy, which
# a later call's copy of the tree may replace), N the GPUs `nvidia-smi -L` lists: phases already
# there are skipped, so a run that does not fit one command continues in the next while the
# machine stays warm. They come back as one tarball in $OUT, gpu<N>x-GEOMETRY.tgz: unpack it here
# with `tar xzf gpu4x-qwen3-1.7b.tgz -C bench/results/gpu-4x`.
# Usage: bash scripts/gpu_bench_multi.sh [GEOMETRY] [PHASES] [PROFILE]
#   bash scripts/gpu_bench_multi.sh qwen3-1.7b burst_single,burst_dp   # bursts: one worker, one per GPU
#   bash scripts/gpu_bench_multi.sh qwen2.5-7b single,dp     # concurrency runs, data parallel
#   bash scripts/gpu_bench_multi.sh qwq-32b single,tp        # tensor parallel over the GPUs against one
# GEOMETRY defaults to qwen3-1.7b, PHASES to burst_single,burst_dp, PROFILE to gpu.
# The workers of a share group need the shared store to see each session's whole history
# (multi.md counts the turns served without it): BENCH_REDIS_SERVER=/path/to/redis-server
# starts one per phase and gives every phase's workers the Redis store and intake (the same
# store for the single worker, so the comparison is like for like); without it the bundle of
# scripts/bundle-redis.sh carried to /root/redis is used where it is. BENCH_WORKER_ARGS replaces
# those worker flags ({redis_port}: the port of that redis-server). The worker needs the redis
# Python package. (Not WORKER_*: the worker refuses unknown WORKER_ environment variables.)
# BENCH_GPUS: the GPUs, in order (the single-worker phases take the first; default every GPU);
# BENCH_VLLM_CACHE: the compile cache (default /root/vllm-cache), another one where another
# benchmark compiles the same geometry at the same time.
# BENCH_CLIENTS: benchmark client processes that share each burst's sessions (default 1; one
# Python client can itself limit 1,000 sessions on four GPUs: multi.md gives each one's CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
geometry=${1:-qwen3-1.7b} phases=${2:-burst_single,burst_dp} profile=${3:-gpu}
export PYTHONPATH="/root/site:$PWD" VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  PYTHONUNBUFFERED=1 VLLM_CACHE_ROOT=${BENCH_VLLM_CACHE:-/root/vllm-cache}
count=$(nvidia-smi -L | grep -c '^GPU ')
gpus=${BENCH_GPUS:-$(seq -s, 0 $((count - 1)))}  # BENCH_GPUS=1,0: the single phases on GPU 1
name=$geometry${profile#gpu}
results=${BENCH_RESULTS:-/root/bench}/gpu-${count}x
out=$results/$name
mkdir -p "$out"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee -a "$out/bench.log"
if [ -z "${BENCH_REDIS_SERVER:-}" ] && [ -x /root/redis/bin/redis-server ]; then
  # The bundle (scripts/bundle-redis.sh) with its own libraries, for redis-server alone: a wrapper,
  # as bench.multigpu takes a binary.
  printf '#!/bin/sh\nLD_LIBRARY_PATH=/root/redis/lib exec /root/redis/bin/redis-server "$@"\n' > /root/redis/run
  chmod +x /root/redis/run
  BENCH_REDIS_SERVER=/root/redis/run
fi
if [ -n "${BENCH_REDIS_SERVER:-}" ] && [ -z "${BENCH_WORKER_ARGS:-}" ]; then
  BENCH_WORKER_ARGS="--store redis --redis-url redis://127.0.0.1:{redis_port}/0 --mqtt-session-expiry 0"
fi
extra=(--gpus "$gpus" --clients "${BENCH_CLIENTS:-1}")
[ -n "${BENCH_WORKER_ARGS:-}" ] && extra+=(--worker-args "$BENCH_WORKER_ARGS")
[ -n "${BENCH_REDIS_SERVER:-}" ] && extra+=(--redis-server "$BENCH_REDIS_SERVER")
status=0
python3 -m bench.multigpu --profile "$profile" --geometry "$geometry" --out "$out" --phases "$phases" \
  --mosquitto /root/mosq/bin/mosquitto "${extra[@]}" 2>&1 | tee -a "$out/bench.log" | grep -v "it/s\]$" || status=$?
tar czf "${OUT:-/tmp}/gpu${count}x-$name.tgz" --exclude=state -C "$results" "$name"
exit $status
