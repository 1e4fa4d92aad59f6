#!/usr/bin/env bash
# Chat with the worker in this terminal, no GPU needed: sets up like scripts/demo.sh, starts a
# private mosquitto and the worker on a real small chat model (SmolLM2-135M-Instruct, prepared
# once by python -m worker.prepare_model), then runs the chat client (python -m worker.chat) with
# per-turn stats on.
# Arguments go to the client (e.g. --session ID). Everything stops when the client exits.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$PWD/.cache/vllm}" HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1

echo "==> preparing the model (once: a 93 MB download and about half a minute)"
MODEL=$(.venv/bin/python -m worker.prepare_model smollm2)

RUN=$(mktemp -d)
PORT=$(.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
MOSQUITTO=$(command -v mosquitto || echo /usr/sbin/mosquitto)
printf 'listener %s 127.0.0.1\nallow_anonymous true\nset_tcp_nodelay true\nmax_inflight_messages 0\n' "$PORT" \
  > "$RUN/mosquitto.conf"
setsid "$MOSQUITTO" -c "$RUN/mosquitto.conf" >"$RUN/mosquitto.log" 2>&1 &  # setsid: Ctrl-C is for the client
BROKER=$!
# --dtype float32, --block-size 32 and kv_cache_memory_bytes: see scripts/demo.sh.
# The sampling that gives English on this model: greedy (the client's --temperature 0 below)
# with a repetition penalty of 1.2 (worker-wide: requests have no field for it). Over 36
# everyday one-line questions it answered all 36 in English without going round in circles;
# at the model's own defaults (temperature 0.2, top_p 0.9) 150 of 180 replies, greedy alone 30
# of 36 ("What is the capital of Italy?": "Il Coriobella, Italy."; "Summarise MQTT in one
# line.": "high-performance, low-latency, high-performance, ..."): docs/benchmarks/demo-model.md.
setsid .venv/bin/python -m worker --model "$MODEL" --dtype float32 --mqtt-port "$PORT" --worker-id demo --store memory --wait-for-broker \
  --enforce-eager --block-size 32 --max-model-len 2048 --engine-extra '{"kv_cache_memory_bytes": 268435456}' \
  --repetition-penalty 1.2 --stats-interval 5 \
  >"$RUN/worker.log" 2>&1 &
WORKER=$!
# Stops what this script started, by pid, on every way out (the end, an error, Ctrl-C): the
# worker first (SIGTERM: it finishes a running reply, then stops its engine; a Ctrl-C here ends
# the wait, and the worker, at once), then the broker.
cleanup() {
  local now=""
  trap 'now=1' INT
  if kill -0 "$WORKER" 2>/dev/null; then
    echo "==> stopping the worker and the broker (Ctrl-C to stop the worker at once)"
    kill -TERM "$WORKER" 2>/dev/null || true
    for _ in $(seq 600); do  # up to 120 s: its drain (60 s at most) and its engine's stop
      { [ -z "$now" ] && kill -0 "$WORKER" 2>/dev/null; } || break
      sleep 0.2 || true  # a Ctrl-C ends the sleep too: not an error (set -e)
    done
  fi
  kill -KILL -- "-$WORKER" 2>/dev/null || true
  kill "$BROKER" 2>/dev/null || true
}
trap cleanup EXIT
# Ctrl-C: a plain exit, and the clean-up above runs as the EXIT trap, where a second Ctrl-C
# ends the wait for the worker.
trap 'exit 130' INT

echo "==> starting the worker (vLLM engine start: about a minute on 2 cores; log: $RUN/worker.log)"
.venv/bin/python scripts/wait_for_worker.py "$RUN/worker.log" --pid "$WORKER" --timeout 300

.venv/bin/python -m worker.chat --mqtt-port "$PORT" --show-stats --max-tokens 64 --temperature 0 "$@"
