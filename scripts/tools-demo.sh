#!/usr/bin/env bash
# The worker's own tools (docs/tools.md), no GPU needed: a private mosquitto, a simulated lamp,
# room sensor and front-door camera answering MQTT 5 requests (devtools/devices.py: the camera
# answers with a JPEG snapshot, Content Type image/jpeg), and the worker on the real small chat
# model (SmolLM2-135M-Instruct, prepared once by python -m worker.prepare_model) with a
# generated config: the devices as [[tools.mqtt]] tools and a calculator MCP server
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
#   --vision (with any of the above)
#                                  the worker on a tiny random-weight vision model instead
#                                  (devtools/tinyvision.py: Qwen2-VL's architecture and image
#                                  processor, made here once, in seconds): the camera's snapshot
#                                  enters the prompt as an image (the usage line counts its
#                                  tokens) and the next turn finds it in the prefix cache. Its
#                                  replies are blank lines: its weights are random. --screenshot then
#                                  pictures the page with an image attached to the message.
#
# This 135M model calls a tool only when forced (it never called one on its own in the
# measurements, docs/benchmarks/demo-model.md): the conversation forces each call with
# --tool-choice (a forced choice applies to the first round of a message only). It has no
# vision: the camera's snapshot reaches it as the text "[image/jpeg, N bytes]", not as a picture.
set -euo pipefail
cd "$(dirname "$0")/.."
WEB="" SCREENSHOT="" VISION=""
usage() { echo "usage: $0 [--web | --screenshot FILE.png] [--vision]" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --web) WEB=1 ;;
    --screenshot) [ -n "${2:-}" ] || usage; WEB=1; SCREENSHOT=$(realpath -m "$2"); shift ;;
    --vision) VISION=1 ;;
    *) usage ;;
  esac
  shift
done
bash scripts/setup.sh
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$PWD/.cache/vllm}" HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1

RUN=$(mktemp -d)
if [ -n "$VISION" ]; then
  # Made in a folder of its own, then moved: an interrupted generation leaves no half model.
  MODEL=$PWD/.cache/tinyvision-qwen2-vl
  if [ ! -f "$MODEL/model.safetensors" ]; then
    echo "==> making the tiny random-weight vision model (once, seconds: devtools/tinyvision.py)"
    mkdir -p .cache
    .venv/bin/python -m devtools.tinyvision "$RUN/tinyvision" >/dev/null
    rm -rf "$MODEL" && mv "$RUN/tinyvision" "$MODEL"
  fi
  # Its weights are bfloat16, which the CPU backend runs natively.
  MODEL_FLAGS=(--model "$MODEL")
else
  echo "==> preparing the model (once: a 93 MB download and about half a minute)"
  MODEL=$(.venv/bin/python -m worker.prepare_model smollm2)
  MODEL_FLAGS=(--model "$MODEL" --dtype float32)
fi
# The camera's snapshot, as it answers it: to look at what the model was shown.
.venv/bin/python -c 'import sys; from devtools.devices import door_snapshot; sys.stdout.buffer.write(door_snapshot())' \
  >"$RUN/front-door.jpg"

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

[[tools.mqtt]]
name = "door_camera"
description = "Take a snapshot with the front-door camera: a picture of whoever is at the door"
parameters = '{"type": "object", "properties": {}, "additionalProperties": false}'
topic = "devices/camera/snapshot"
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

echo "==> starting the simulated lamp, sensor and door camera (devtools/devices.py; their log: $RUN/devices.jsonl)"
setsid .venv/bin/python -m devtools.devices --port "$PORT" --log "$RUN/devices.jsonl" >"$RUN/devices.out" 2>&1 &
DEVICES=$!
for _ in $(seq 100); do
  grep -q "devices ready" "$RUN/devices.out" 2>/dev/null && break
  kill -0 "$DEVICES" 2>/dev/null || { cat "$RUN/devices.out"; exit 1; }
  sleep 0.1
done

# --dtype float32, --block-size 32 and kv_cache_memory_bytes: see scripts/demo.sh.
setsid .venv/bin/python -m worker --config "$RUN/worker.toml" "${MODEL_FLAGS[@]}" --mqtt-port "$PORT" \
  --worker-id demo --store memory --wait-for-broker \
  --enforce-eager --block-size 32 --max-model-len 2048 --engine-extra '{"kv_cache_memory_bytes": 268435456}' \
  >"$RUN/worker.log" 2>&1 &
WORKER=$!
echo "==> starting the worker (vLLM engine start: about a minute on 2 cores; log: $RUN/worker.log)"
.venv/bin/python scripts/wait_for_worker.py "$RUN/worker.log" --pid "$WORKER" --timeout 300

SYSTEM="You look after a living room through tools. After a tool's result, tell the user in one short sentence what it means."
if [ -n "$SCREENSHOT" ] && [ -n "$VISION" ]; then
  # 4 tokens: the random model's reply is blank lines (below), and the picture is of the image
  # in the turn.
  echo "==> the chat page in headless Chromium: one message with the door camera's snapshot attached"
  .venv/bin/python scripts/chat_page_screenshot.py --broker-url "ws://127.0.0.1:$WS_PORT" --user demo \
    --window-size 1000,700 --max-tokens 4 --image "$RUN/front-door.jpg" \
    --message "Is anyone at the door?" "$SCREENSHOT"
  echo "==> saved $SCREENSHOT ($(stat -c %s "$SCREENSHOT") bytes)"
  exit 0
fi
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
  if [ -n "$VISION" ]; then
    echo "    The tiny vision model (random weights: its replies are blank) takes images: attach one with"
    echo "    the paperclip or paste it, e.g. the camera's snapshot $RUN/front-door.jpg, or force door_camera."
  fi
  # Until Ctrl-C (the INT trap exits; the devices' log is printed by the EXIT path below).
  trap 'trap - INT; echo; echo "==> what the devices received:"; cat "$RUN/devices.jsonl" 2>/dev/null; exit 130' INT
  while kill -0 "$WORKER" 2>/dev/null; do sleep 1; done
  echo "the worker stopped; its log: $RUN/worker.log" >&2
  exit 1
fi

SESSION="tools-$$"
# cat -s: a run of blank lines shows as one (the tiny vision model's replies are nothing else).
ask() {  # ask MESSAGE [chat flags...]: one message of the conversation, its replies and tool calls
  local message=$1
  shift
  echo
  echo ">>> $message   ($*)"
  .venv/bin/python -m worker.chat --mqtt-port "$PORT" --user demo --session "$SESSION" --temperature 0 \
    --max-tokens 96 --show-stats --system-prompt "$SYSTEM" --message "$message" "$@" 2>&1 | cat -s | sed 's/^/    /' \
    || echo "    (the chat client exited with status $?: python -m worker.chat --help explains it)"
}

if [ -n "$VISION" ]; then
  echo
  echo "==> the tiny vision model: its weights are random, so its replies say nothing (blank lines:"
  echo "    it repeats the last token of its prompt, a newline, at any temperature). What the demo"
  echo "    shows is the camera's picture in the prompt: the usage line counts its image tokens, and"
  echo "    the second message finds it in the prefix cache (the snapshot: $RUN/front-door.jpg)"
  # 48 tokens: enough for the forced call's markup (about 30); the replies run to the limit.
  ask "Is anyone at the door?" --worker-tools '*' --tool-choice door_camera --max-tokens 48
  ask "Is the visitor holding anything?" --max-tokens 48
else
  echo
  echo "==> the lamp is on (a call of this script's own: the devices log it too)"
  mosquitto_pub -p "$PORT" -V mqttv5 -q 1 -t devices/lamp/set -m '{"on": true}'

  # workerTools "*": every worker tool this user may use; the session keeps the choice.
  ask "Is anyone in the room? If not, switch the lamp off." --worker-tools '*' --tool-choice sensor_read
  ask "Nobody is in the room, so switch the lamp off." --tool-choice lamp_set
  ask "Is the lamp on now?" --tool-choice lamp_get
  ask "What is 21.5 multiplied by 3?" --tool-choice calc_multiply

  echo
  echo "==> the door camera answers with a JPEG (the snapshot: $RUN/front-door.jpg). The demo model"
  echo "    has no vision: the worker gives it the text [image/jpeg, N bytes], not the picture, so it"
  echo "    cannot say who is there. bash scripts/tools-demo.sh --vision shows the picture entering"
  echo "    a vision model's prompt."
  ask "Is anyone at the door?" --tool-choice door_camera
fi

echo
echo "==> what the devices received (devtools/devices.py's log, one call a line):"
.venv/bin/python - "$RUN/devices.jsonl" <<'PY'
import json
import sys

for line in open(sys.argv[1]):
    call = json.loads(line)
    who = f"call {call['toolCallId']} of request {call['requestId']}" if call["toolCallId"] else "no call id"
    print(f"    {call['topic']:<24} {call['payload'] or '(empty)':<16} {who}{' (duplicate)' if call['duplicate'] else ''}")
PY
echo
grep -o "worker call .*" "$RUN/worker.log" | sed 's/^/    worker log: /' || true
