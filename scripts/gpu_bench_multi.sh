#!/usr/bin/env bash
# Several GPUs of one host (bench/multigpu.py) on the 2-GPU machine (two H200; vLLM 0.26
# installed there as for scripts/gpu_bench.sh, mosquitto carried to /root/mosq). Results
# accumulate in docs/benchmarks/gpu-2x/GEOMETRY of the repo copy (phases already there are
# skipped: a run that does not fit one command continues where it stopped) and come back as
# one tarball in $OUT.
# Usage: bash scripts/gpu_bench_multi.sh GEOMETRY PHASES [PROFILE]
#   bash scripts/gpu_bench_multi.sh qwen2.5-7b single,dp     # data parallel: two workers, one share group
#   bash scripts/gpu_bench_multi.sh qwq-32b single,tp        # tensor parallel 2 against one GPU
# The workers of a share group need a shared store to see each session's whole history
# (multi.md counts the turns served without it): WORKER_ARGS adds worker flags to every phase,
# REDIS_SERVER=/path/to/redis-server starts one per phase ({redis_port} in WORKER_ARGS).
set -euo pipefail
cd "$(dirname "$0")/.."
geometry=$1 phases=$2 profile=${3:-gpu}
export PYTHONPATH="/root/site:$PWD" VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  PYTHONUNBUFFERED=1 VLLM_CACHE_ROOT=/root/vllm-cache
name=$geometry${profile#gpu}
out=docs/benchmarks/gpu-2x/$name
mkdir -p "$out"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee -a "$out/bench.log"
extra=()
[ -n "${WORKER_ARGS:-}" ] && extra+=(--worker-args "$WORKER_ARGS")
[ -n "${REDIS_SERVER:-}" ] && extra+=(--redis-server "$REDIS_SERVER")
status=0
python3 -m bench.multigpu --profile "$profile" --geometry "$geometry" --out "$out" --phases "$phases" \
  --mosquitto /root/mosq/bin/mosquitto "${extra[@]}" 2>&1 | tee -a "$out/bench.log" | grep -v "it/s\]$" || status=$?
tar czf "${OUT:-/tmp}/gpu2x-$name.tgz" --exclude=state -C docs/benchmarks/gpu-2x "$name"
exit $status
