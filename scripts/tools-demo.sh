#!/usr/bin/env bash
# The worker's own tools (docs/tools.md), no GPU needed: a private mosquitto, a simulated lamp
# and room sensor answering MQTT 5 requests (devtools/devices.py), and the worker on the real
# small chat model (SmolLM2-135M-Instruct, prepared once by python -m worker.prepare_model) with
# a generated config: the devices as [[tools.mqtt]] tools and a calculator MCP server
# (devtools/calc_mcp.py, stdio) as [[tools.mcp]]. Then a conversation through the chat client
# (python -m worker.chat) in which the worker calls them, shown as the calls start and end, and
# at the end what the devices received (their log).
#
#   scripts/tools-demo.sh          the conversation in this terminal, then everything stops
#   scripts/tools-demo.sh --web    the chat page instead (worker/web): open the address it
#                                  prints, tick "Use the worker's tools"; Ctrl-C stops it all
#   scripts/tools-demo.sh --screenshot FILE.png
#                                  the chat page in headless Chromium, one message with a
#                                  forced sensor_read, saved as a picture (the README's), then
#                                  everything stops (scripts/chat_page_screenshot.py)
#
# This 135M model calls a tool only when forced (it never called one on its own in the
# measurements, docs/benchmarks/demo-model.md): the conversation forces each call with
# --tool-choice (a forced choice applies to the first round of a message only).
set -euo pipefail
cd "$(dirname "$0")/.."
WEB="" SCREENSHOT=""
case "${1:-}" in
  --web) WEB=1 ;;
  --screenshot) [ -n "${2:-}" ] || { echo "usage: $0 --screenshot FILE.png" >&2; exit 2; }; WEB=1; SCREENSHOT=$(realpath -m "$2") ;;
  "") ;;
  *) echo "usage: $0 [--web | --screenshot FILE.png]" >&2; exit 2 ;;
esac
bash scripts/setup.sh
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$PWD/.cache/vllm}" HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1

echo "==> preparing the model (once: a 93 MB download and about half a minute)"
MODEL=$(.venv/bin/python -m worker.prepare_model smollm2)

RUN=$(mktemp -d)
free_port() { .venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
PORT=$(free_port)
MOSQUITTO=$(command -v mosquitto || echo /usr/sbin/mosquitto)
{
  printf 'listener %s 127.0.0.1\nallow_anonymous true\nset_tcp_nodelay true\nmax_inflight_messages 0\n' "$PORT"
  # The page talks MQTT over WebSockets. mosquitto's WebSockets listener takes an interface
  # name (lo), not an address (docs/frontend.md).
  if [ -n "$WEB" ]; then WS_PORT=$(free_port); printf 'listener %s lo\nprotocol websockets\n' "$WS_PORT"; fi
} > "$RUN/mosquitto.conf"
# setsid: each in its own process group, so that a Ctrl-C is for this script alone, and the
# clean-up stops each group.
setsid "$MOSQUITTO" -c "$RUN/mosquitto.conf" >"$RUN/mosquitto.log" 2>&1 &
BROKER=$!
DEVICES="" WORKER="" PAGE=""

# The worker's tools. The devices and the calculator are for every user namespace here
# (users = ["*"]); docs/tools.md has a per-namespace setup and docs/security.md the broker ACL
# that keeps users off the device topics.
cat > "$RUN/worker.toml" <<EOF
[[tools.mqtt]]
name = "lamp_set"
description = "Switch the living-room lamp on or off"
parameters = '{"type": "object", "properties": {"on": {"type": "boolean", "description": "true: on, false: off"}}, "required": ["on"]}'
topic = "devices/lamp/set"
timeout = 5.0
users = ["*"]
confirm = false

[[tools.mqtt]]
name = "lamp_get"
description = "Whether the living-room lamp is on"
topic = "devices/lamp/get"
timeout = 5.0
users = ["*"]

[[tools.mqtt]]
name = "sensor_read"
description = "Read the living-room sensor: the temperature in degrees Celsius and whether anyone is in the room"
topic = "devices/sensor/read"
timeout = 5.0
users = ["*"]

[[tools.mcp]]
name = "calc"
command = ["$PWD/.venv/bin/python", "$PWD/devtools/calc_mcp.py"]
allow = ["add", "subtract", "multiply", "divide"]
users = ["*"]
timeout = 10
EOF

# Stops what this script started, by pid, on every way out (the end, an error, Ctrl-C): the
# chat page's server, the worker (SIGTERM: it finishes a running reply, then stops its engine
# and its MCP server; a Ctrl-C here ends the wait, and the worker, at once), the devices, then
# the broker.
cleanup() {
  local now=""
  trap 'now=1' INT
  [ -n "$PAGE" ] && kill "$PAGE" 2>/dev/null || true
  if [ -n "$WORKER" ] && kill -0 "$WORKER" 2>/dev/null; then
    echo "==> stopping the worker, the devices and the broker (Ctrl-C to stop the worker at once)"
    kill -TERM "$WORKER" 2>/dev/null || true
    for _ in $(seq 600); do  # up to 120 s: its drain (60 s at most) and its engine's stop
      { [ -z "$now" ] && kill -0 "$WORKER" 2>/dev/null; } || break
      sleep 0.2 || true  # a Ctrl-C ends the sleep too: not an error (set -e)
    done
  fi
  [ -n "$WORKER" ] && kill -KILL -- "-$WORKER" 2>/dev/null || true
  [ -n "$DEVICES" ] && kill "$DEVICES" 2>/dev/null || true
  kill "$BROKER" 2>/dev/null || true
}
trap cleanup EXIT
# Ctrl-C: a plain exit, and the clean-up above runs as the EXIT trap, where a second Ctrl-C
# ends the wait for the worker.
trap 'exit 130' INT

echo "==> starting the simulated lamp and sensor (devtools/devices.py; their log: $RUN/devices.jsonl)"
setsid .venv/bin/python -m devtools.devices --port "$PORT" --log "$RUN/devices.jsonl" >"$RUN/devices.out" 2>&1 &
DEVICES=$!
for _ in $(seq 100); do
  grep -q "devices ready" "$RUN/devices.out" 2>/dev/null && break
  kill -0 "$DEVICES" 2>/dev/null || { cat "$RUN/devices.out"; exit 1; }
  sleep 0.1
done

# --dtype float32, --block-size 32 and kv_cache_memory_bytes: see scripts/demo.sh.
setsid .venv/bin/python -m worker --config "$RUN/worker.toml" --model "$MODEL" --dtype float32 --mqtt-port "$PORT" \
  --worker-id demo --store memory --wait-for-broker \
  --enforce-eager --block-size 32 --max-model-len 2048 --engine-extra '{"kv_cache_memory_bytes": 268435456}' \
  >"$RUN/worker.log" 2>&1 &
WORKER=$!
echo "==> starting the worker (vLLM engine start: about a minute on 2 cores; log: $RUN/worker.log)"
.venv/bin/python scripts/wait_for_worker.py "$RUN/worker.log" --pid "$WORKER" --timeout 300

SYSTEM="You look after a living room through tools. After a tool's result, tell the user in one short sentence what it means."
if [ -n "$SCREENSHOT" ]; then
  echo "==> the chat page in headless Chromium: one message, sensor_read forced (the demo model calls a tool only then)"
  .venv/bin/python scripts/chat_page_screenshot.py --broker-url "ws://127.0.0.1:$WS_PORT" --user demo \
    --window-size 1000,700 --worker-tools --system-prompt "$SYSTEM" \
    --message "Is anyone in the room?" --tool-choice sensor_read "$SCREENSHOT"
  echo "==> saved $SCREENSHOT ($(stat -c %s "$SCREENSHOT") bytes)"
  exit 0
fi

if [ -n "$WEB" ]; then
  PAGE_PORT=$(free_port)
  setsid .venv/bin/python -m worker.web --port "$PAGE_PORT" >"$RUN/web.log" 2>&1 &
  PAGE=$!
  echo
  # temperature=0 and maxTokens=96: the page asks what the terminal conversation below asks
  # (greedy: the demo model answers in English, docs/benchmarks/demo-model.md).
  echo "==> the chat page: http://127.0.0.1:$PAGE_PORT/?broker=ws%3A%2F%2F127.0.0.1%3A$WS_PORT&user=demo&temperature=0&maxTokens=96"
  echo "    Options: tick \"Use the worker's tools\"; Tool choice \"required\" makes the model call one."
  echo "    Ask e.g. \"Is anyone in the room?\". Ctrl-C stops everything; then the devices' log is printed."
  # Until Ctrl-C (the INT trap exits; the devices' log is printed by the EXIT path below).
  trap 'trap - INT; echo; echo "==> what the devices received:"; cat "$RUN/devices.jsonl" 2>/dev/null; exit 130' INT
  while kill -0 "$WORKER" 2>/dev/null; do sleep 1; done
  echo "the worker stopped; its log: $RUN/worker.log" >&2
  exit 1
fi

SESSION="tools-$$"
ask() {  # ask MESSAGE [chat flags...]: one message of the conversation, its replies and tool calls
  local message=$1
  shift
  echo
  echo ">>> $message   ($*)"
  .venv/bin/python -m worker.chat --mqtt-port "$PORT" --user demo --session "$SESSION" --temperature 0 \
    --max-tokens 96 --show-stats --system-prompt "$SYSTEM" --message "$message" "$@" 2>&1 | sed 's/^/    /' \
    || echo "    (the chat client exited with status $?: python -m worker.chat --help explains it)"
}

echo
echo "==> the lamp is on (a call of this script's own: the devices log it too)"
mosquitto_pub -p "$PORT" -V mqttv5 -q 1 -t devices/lamp/set -m '{"on": true}'

# workerTools "*": every worker tool this user may use; the session keeps the choice.
ask "Is anyone in the room? If not, switch the lamp off." --worker-tools '*' --tool-choice sensor_read
ask "Nobody is in the room, so switch the lamp off." --tool-choice lamp_set
ask "Is the lamp on now?" --tool-choice lamp_get
ask "What is 21.5 multiplied by 3?" --tool-choice calc_multiply

echo
echo "==> what the devices received (devtools/devices.py's log, one call a line):"
.venv/bin/python - "$RUN/devices.jsonl" <<'PY'
import json
import sys

for line in open(sys.argv[1]):
    call = json.loads(line)
    who = f"call {call['toolCallId']} of request {call['requestId']}" if call["toolCallId"] else "no call id"
    print(f"    {call['topic']:<22} {call['payload'] or '(empty)':<16} {who}{' (duplicate)' if call['duplicate'] else ''}")
PY
echo
grep -o "worker call .*" "$RUN/worker.log" | sed 's/^/    worker log: /' || true
