#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs every check CI runs: ruff, mypy, a benchmark smoke run,
# the tests. Extra arguments go to pytest (and skip the smoke run): `bash scripts/test.sh -k config`.
# It says how long each step took and, at the end, the whole run (also when a step fails).
# Measured on 2 cores: the setup ~6 minutes on a fresh machine (seconds later; 7.5 beside
# `stress --cpu 2`); ruff and mypy under 1 (mypy's first run 4.9 there); the smoke runs 3.5-5.4 idle
# (then 7 engine starts of ~40 s, now 6), about 5 beside `stress --cpu 2`; pytest 26.8 idle,
# about 31.5 beside it. The whole run 29.0-32.5 minutes on idle cores with the setup done; beside
# `stress --cpu 2` on a fresh clone 37.1, 37.1 and 38.2 in three runs in a row after the first
# (59.3 before the test engines ran one OpenMP thread each: tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
minutes() { awk -v s="$1" 'BEGIN { printf "%d s (%.1f min)", s, s / 60 }'; }
trap 'status=$?; echo "==> scripts/test.sh: $([ $status -eq 0 ] && echo passed || echo "failed (exit code $status)") after $(minutes $((SECONDS - started)))"' EXIT
# Stopped by a signal: the EXIT trap above would read the last command's status (a run killed
# with SIGTERM said "passed"); exit with the signal's code (128 + its number) instead.
trap 'exit 143' TERM
trap 'exit 130' INT
bash scripts/setup.sh
echo "    setup: $(minutes $((SECONDS - started)))"
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$PWD/.cache/vllm}" HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
# One OpenMP thread per CPU engine, unbound, as tests/conftest.py sets for pytest (why there):
# the smoke runs' engines too.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-nobind}"
echo "==> ruff"
step=$SECONDS
.venv/bin/ruff check worker devtools tests scripts bench
.venv/bin/ruff format --check worker devtools tests scripts bench
echo "==> mypy"
.venv/bin/mypy
echo "    ruff and mypy: $(minutes $((SECONDS - step)))"
# A long step: its output into a file, its phase lines ("worker: 95 s": each phase's
# duration) shown as they come, and how long it took; on failure the end of its output.
run_step() {  # run_step NAME LOGFILE COMMAND...
  local name=$1 log=$2 start=$SECONDS status
  shift 2
  set +o pipefail
  "$@" 2>&1 | tee "$log" | { grep --line-buffered -E '^[a-z_]+: ([0-9]+ s|done before)' | sed -u 's/^/    /'; true; }
  status=${PIPESTATUS[0]}
  set -o pipefail
  if [ "$status" -ne 0 ]; then
    tail -50 "$log"
    echo "$name: failed after $(minutes $((SECONDS - start))) (exit code $status; whole output: $log)"
    exit 1
  fi
  echo "    $name: $(minutes $((SECONDS - start)))"
}
if [ $# -eq 0 ]; then
  # The three smoke runs: 5.4 minutes on 2 idle cores, almost all of it engine starts (each
  # phase but the scale run starts one), 5.9 beside `stress --cpu 2`; each prints its phases
  # as they end.
  echo "==> benchmark smoke run (every phase end to end on the tiny model; no timing is asserted)"
  smoke=$(mktemp -d)
  run_step "benchmark smoke run" "$smoke/bench.out" \
    .venv/bin/python -m bench --profile smoke --out "$smoke" --phases worker,inprocess,structured --think-time 0.05
  grep -q "## Concurrency (3 turns per session; users think" "$smoke/results.md" && ls "$smoke"/*.png >/dev/null
  echo "benchmark smoke run: ok ($smoke/results.md)"
  echo "==> several-GPU benchmark smoke run (two CPU workers in one share group, Redis store, tiny model)"
  run_step "several-GPU benchmark smoke run" "$smoke/multi.out" \
    .venv/bin/python -m bench.multigpu --profile smoke --out "$smoke/multi" --phases single,dp \
    --redis-server "$(command -v redis-server)" \
    --worker-args "--store redis --redis-url redis://127.0.0.1:{redis_port}/0 --mqtt-session-expiry 0"
  # Both workers of the group served requests, every turn with its history; every phase
  # compared with the single worker.
  .venv/bin/python -c "import json, sys; r = json.load(open(sys.argv[1]))['phases']
assert all(w['processed'] for w in r['dp']['workers'].values()) and len(r['dp']['workers']) == 2, r['dp']
assert all(s['turns_without_history'] == 0 for s in r['dp']['runs'].values()), r['dp']
assert all(s.get('tokens_per_s_vs_single') for p in ('dp',) for s in r[p]['runs'].values()), r" "$smoke/multi/multi.json"
  echo "several-GPU benchmark smoke run: ok ($smoke/multi/multi.md)"
  echo "==> scale load test smoke run (4 simulated workers in one share group, zero-cost engine)"
  run_step "scale load test smoke run" "$smoke/scale.out" \
    .venv/bin/python -m bench.scale --out "$smoke/scale" --workers 4 --processes 2 --rates 50 --duration 2
  .venv/bin/python -c "import json, sys; s = json.load(open(sys.argv[1]))['steps'][0]
assert s['replies'] == s['sent'] == 100 and s['error_replies'] == 0, s" "$smoke/scale/scale-w4.json"
  echo "scale load test smoke run: ok ($smoke/scale/scale.md)"
fi
echo "==> pytest"
step=$SECONDS
# --durations: the slowest tests and fixtures (an engine start is ~50 s of a fixture's setup).
.venv/bin/python -m pytest -ra --durations=15 "$@"
echo "    pytest: $(minutes $((SECONDS - step)))"
