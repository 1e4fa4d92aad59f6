"""Where a burst's request spends its time outside the engine: N one-turn requests published at
once to a worker process (the real transport, Service and store, the model's tokenizer; an
engine that answers every request ``--gen-s`` after it came, devtools.fakes.ZeroCostEngine; with
``--together`` every reply of the burst at one moment, ``--gen-s`` after the first request
reached it, as replies of one length end in one decode step),
each leg timed on CLOCK_MONOTONIC, one clock for every process of the host:

- way in: sent by the client -> paho's callback in the worker;
- to the engine: the worker's queue (its reply's ``queueMs``: received -> handed to the engine),
  and when the last request reached the engine after the first was sent;
- commit: the reply built (its ``totalMs``) -> handed to paho, the session's turn committed to
  the store in between;
- way back: handed to paho in the worker -> the client's callback.

    python -m bench.legs MODEL_DIR [--requests 320] [--rounds 3] [--switch-ms 5 1]
        [--store sqlite|memory] [--gen-s 1.0] [--together] [--mosquitto PATH]

Each ``--switch-ms`` value (Python's thread switch interval, sys.setswitchinterval: how long
paho's and the store's threads may wait for the interpreter while the event loop is busy) runs
in a worker process of its own, on a topic prefix of its own, idle while another's round
runs; the variants take turns round by round. A benchmark, not a test: the numbers depend on
the machine and what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .common import Workload, percentile

REPLY_TOKENS = 128


def _together(gen_s: float) -> Any:
    """An engine that answers every request of a burst at one moment, ``gen_s`` after the
    burst's first request reached it: as replies of one length end in one decode step."""
    import asyncio
    from collections.abc import AsyncIterator

    from devtools.fakes import ZeroCostEngine
    from worker.engine.port import GenerationRequest, GenerationUpdate

    class Together(ZeroCostEngine):
        def __init__(self) -> None:
            super().__init__(REPLY_TOKENS, 1, gen_s)
            self.deadline, self.running = 0.0, 0

        async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationUpdate]:
            now = time.monotonic()
            if not self.running and now > self.deadline:  # a new burst
                self.deadline = now + gen_s
            self.running += 1
            try:
                await asyncio.sleep(self.deadline - now)
                tokens = min(REPLY_TOKENS, request.sampling.max_tokens)
                yield GenerationUpdate("w " * tokens, tokens, len(request.prompt_token_ids), 0, True, "length")
            finally:
                self.running -= 1

    return Together()


def _worker(
    port: int, prefix: str, model: str, switch_ms: float, store: str, gen_s: float, together: bool, conn: Any
) -> None:
    """The worker's process: LiveWorker on the broker, the times of its receipts and replies
    sent to the parent whenever it asks."""
    sys.setswitchinterval(switch_ms / 1000)
    from devtools.fakes import ZeroCostEngine
    from devtools.inproc import LiveWorker
    from worker.engine.tokenizer import ChatTokenizer
    from worker.transport import mqtt as transport

    received: dict[str, float] = {}
    published: dict[str, float] = {}
    on_message, publish = transport.MqttTransport._on_message, transport.MqttTransport._publish

    def timed_on_message(self: Any, client: Any, userdata: Any, message: Any) -> None:
        received[message.topic.split("/")[-2]] = time.monotonic()
        on_message(self, client, userdata, message)

    def timed_publish(self: Any, topic: str, payload: bytes, *args: Any) -> Any:
        if topic.endswith("/reply"):
            published[topic.split("/")[-2]] = time.monotonic()
        return publish(self, topic, payload, *args)

    transport.MqttTransport._on_message = timed_on_message  # type: ignore[method-assign]
    transport.MqttTransport._publish = timed_publish  # type: ignore[method-assign,assignment]
    LiveWorker(
        port,
        engine=_together(gen_s) if together else ZeroCostEngine(REPLY_TOKENS, 1, gen_s),
        renderer=ChatTokenizer(model),
        history={"store": store, "state_dir": tempfile.mkdtemp()},
        mqtt={"topic_prefix": prefix, "worker_id": f"legs-{prefix}"},  # a client id each
        limits={"max_requests_per_user_per_minute": 0},
    )
    conn.send("ready")
    while conn.recv() == "times":
        conn.send((dict(received), dict(published)))


def _quantiles(values: list[float]) -> str:
    ms = [v * 1000 for v in values]
    return f"p50 {percentile(ms, 50):7.1f}  p95 {percentile(ms, 95):7.1f}  max {max(ms):7.1f} ms"


def _round(client: Any, replies: dict[str, tuple[float, dict[str, Any]]], done: threading.Event,
           payloads: dict[str, str], prefix: str) -> dict[str, float]:  # fmt: skip
    replies.clear()
    done.clear()
    sent: dict[str, float] = {}
    for session, payload in payloads.items():
        sent[session] = time.monotonic()
        client.publish(f"{prefix}/bench/{session}/request", payload, qos=1)
    if not done.wait(300):
        raise RuntimeError(f"{len(replies)} of {len(payloads)} replies within 300 s")
    return sent


def legs(sent: dict[str, float], received: dict[str, float], published: dict[str, float],
         replies: dict[str, tuple[float, dict[str, Any]]]) -> dict[str, list[float]]:  # fmt: skip
    """Each leg's times (s), one per request."""
    out: dict[str, list[float]] = {"way in": [], "queue": [], "commit": [], "way back": [], "outside": []}
    first = min(sent.values())
    at_engine = []
    for session, start in sent.items():
        got, reply = replies[session]
        latency = reply["latency"]
        total, queue = latency["totalMs"] / 1000, latency["queueMs"] / 1000
        out["way in"].append(received[session] - start)
        out["queue"].append(queue)
        out["commit"].append(published[session] - received[session] - total)
        out["way back"].append(got - published[session])
        out["outside"].append(got - start - total)
        at_engine.append(received[session] + queue - first)
    out["at the engine"] = at_engine
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="the model's directory (its tokenizer and chat template)")
    parser.add_argument("--requests", type=int, default=320)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--switch-ms", type=float, nargs="+", default=[5.0], help="sys.setswitchinterval")
    parser.add_argument("--store", choices=["sqlite", "memory"], default="sqlite")
    parser.add_argument("--gen-s", type=float, default=1.0, help="each request's time in the engine")
    parser.add_argument(
        "--together", action="store_true", help="every reply of a round at one moment, --gen-s after the first request"
    )
    parser.add_argument("--mosquitto", default=None, help="the broker's binary (default: Debian's)")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from devtools.mosquitto import Mosquitto
    from devtools.mqtt_client import connect

    tokenizer = AutoTokenizer.from_pretrained(args.model)

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text))

    workload = Workload("You are a helpful assistant.", (300, 300), REPLY_TOKENS)
    broker = Mosquitto(Path(tempfile.mkdtemp()), persistence=False, log=False, binary=args.mosquitto)
    broker.start()
    context = multiprocessing.get_context("spawn")
    workers = []
    try:
        for index, switch_ms in enumerate(args.switch_ms):
            mine, theirs = context.Pipe()
            process = context.Process(
                target=_worker,
                args=(broker.port, f"w{index}", args.model, switch_ms, args.store, args.gen_s, args.together, theirs),
                daemon=True,
            )
            process.start()
            if not mine.poll(300) or mine.recv() != "ready":
                raise RuntimeError("the worker did not start")
            workers.append((f"switch interval {switch_ms:g} ms", mine, process))
        replies: dict[str, tuple[float, dict[str, Any]]] = {}
        done = threading.Event()
        expected = [0]

        def on_message(message: Any) -> None:
            replies[message.topic.split("/")[-2]] = (time.monotonic(), json.loads(message.payload))
            if len(replies) >= expected[0]:
                done.set()

        client = connect(broker.port, [("+/bench/+/reply", 1)], on_message=on_message, keepalive=60, max_inflight=0)
        for number in range(args.rounds):
            for index, (variant, conn, _) in enumerate(workers):
                # Each round's own messages and sessions: nothing from the tokenizer's caches.
                tag = f"r{number}w{index}"
                payloads = {
                    f"{tag}-{i}": json.dumps(
                        {
                            "message": workload.user_message(i + 100_000 * number, 0, count_tokens),
                            "maxTokens": REPLY_TOKENS,
                            "stream": False,
                            "requestId": f"{tag}-{i}",
                            "systemPrompt": workload.system_prompt,
                        }
                    )
                    for i in range(args.requests)
                }
                expected[0] = args.requests
                sent = _round(client, replies, done, payloads, f"w{index}")  # that worker's prefix
                conn.send("times")
                received, published = conn.recv()
                print(f"round {number}, {variant}, {args.requests} requests")
                for name, values in legs(sent, received, published, replies).items():
                    print(f"  {name:14} {_quantiles(values)}")
                time.sleep(1)
        client.disconnect()
    finally:
        for _, _, process in workers:
            process.kill()
        broker.stop()


if __name__ == "__main__":
    main()
