"""How fast the worker takes requests in: the service's dispatch (a message out of the inbox
until it is queued as a turn or answered) and a flood through a real broker.

    python -m bench.intake [--requests 650] [--sessions 650] [--store memory|sqlite|both]
        [--repeat 5] [--flood 2000] [--flood-sessions 200] [--out FILE]
    python -m bench.intake --to-engine MODEL_DIR --requests 1000 [--store ...] [--repeat 5]
    python -m bench.intake --to-engine MODEL_DIR --over-mqtt [--mosquitto PATH] --requests 320

- **to the engine** (``--to-engine``): ``--requests`` one-turn requests of about 300 words,
  each its own session, all in the inbox at once, through the real Service and the model's
  tokenizer (chat template, encoding) to an engine that records when each reached it: the
  time until the last and the median reached it, and the event loop's CPU per request.

- **to the engine over MQTT** (``--to-engine MODEL --over-mqtt``): the same requests through a
  private mosquitto and the in-process worker (devtools/inproc.py: the real transport and
  Service; the memory store, or SQLite with ``--store sqlite``), published at once by another
  process (paho, QoS 1): when each reached the engine after the first was sent (quantiles) and
  the event loop's CPU per request until the last did, round after round (``--repeat``), each
  round's messages new to the tokenizer's caches. What a burst's requests meet before vLLM,
  with paho's thread and the broker in, and nothing of vLLM's. ``--timeline`` adds when each
  request passed each stage on the way (``Timeline``): handed over by paho's thread,
  dispatched, its turn's segments queued for encoding and encoded, at the engine; and the
  encoding batches (how many, their segments, how long each took in its thread).

- **dispatch**: one user's ``--requests`` requests over ``--sessions`` sessions, all in the
  inbox at once, through the real Service on a MemoryTransport and an engine that answers at
  once (devtools.fakes.ZeroCostEngine), on the memory store or SQLite (in a temporary
  directory). Reported per run: the time until the last message was dispatched and until the
  last was answered, and the answers by code (the default rate limit, 600 a minute, refuses
  the user's requests beyond it: ``rate_limited``).
- **flood**: the in-process worker (devtools/inproc.py: the real transport and service, the
  memory store) on a private mosquitto; two rounds of ``--flood`` requests over
  ``--flood-sessions`` sessions, published without waiting (as tests/broker/test_backpressure.py
  does); the time until each round is answered (``busy`` for turns beyond a session's queue).
  ``--flood 0`` leaves it out.

A benchmark, not a test: the numbers depend on the machine and what else runs on it. The
results behind docs/performance.md ("Taking requests in") came from running this file against
the commit before the store moved to its own thread and against the one after (PYTHONPATH
set to each checkout, the file copied in).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import inspect
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from devtools.fakes import MemoryTransport, WordRenderer, ZeroCostEngine
from worker.config.models import WorkerConfig
from worker.core.service import Service
from worker.store.memory import MemoryStore


def _service(store_kind: str, state: Path) -> tuple[Service, MemoryTransport]:
    config = WorkerConfig.model_validate({"engine": {"model": "fake"}, "mqtt": {"worker_id": "bench"}})
    if store_kind == "sqlite":
        from worker.store.sqlite import SqliteStore

        store: Any = SqliteStore(state)
    else:
        store = MemoryStore()
    transport = MemoryTransport()
    engine = ZeroCostEngine(reply_tokens=8, deltas=1, gen_s=0)
    return Service(config, engine, WordRenderer(), transport, lambda code: None, store), transport


async def _dispatch_run(store_kind: str, requests: int, sessions: int, state: Path) -> dict[str, Any]:
    service, transport = _service(store_kind, state)
    dispatched = [0]
    last = [0.0]
    inner = service.dispatch
    if inspect.iscoroutinefunction(inner):

        async def timed(message: Any) -> None:
            try:
                await inner(message)
            finally:
                dispatched[0] += 1
                last[0] = time.perf_counter()

    else:  # the store on the event loop (before it had its own thread): dispatch was plain

        def timed(message: Any) -> None:  # type: ignore[misc]
            try:
                inner(message)
            finally:
                dispatched[0] += 1
                last[0] = time.perf_counter()

    service.dispatch = timed  # type: ignore[method-assign]
    for n in range(requests):
        transport.deliver(f"chat/bob/s{n % sessions}/request", {"message": "hello there", "requestId": f"r{n}"})
    started, cpu = time.perf_counter(), time.process_time()
    consumer = asyncio.ensure_future(service.consume())
    try:
        while len(transport.published) < requests:
            await asyncio.sleep(0.002)
        answered, cpu = time.perf_counter(), time.process_time() - cpu
    finally:
        consumer.cancel()
    codes = collections.Counter(p.get("error", {}).get("code") or "reply" for _, p in transport.published)
    assert dispatched[0] == requests, dispatched
    store = service.sessions.store
    store.close()
    return {
        "dispatch_s": round(last[0] - started, 3),
        "answered_s": round(answered - started, 3),
        "per_s": round(requests / (last[0] - started)),
        "cpu_s": round(cpu, 3),  # the process's CPU time until all were answered: the work, whatever the load
        "codes": dict(codes),
    }


def dispatch(store_kind: str, requests: int, sessions: int, repeat: int) -> dict[str, Any]:
    runs = []
    for _ in range(repeat):
        with tempfile.TemporaryDirectory() as state:
            runs.append(asyncio.run(_dispatch_run(store_kind, requests, sessions, Path(state))))
    times = [r["dispatch_s"] for r in runs]
    return {
        "store": store_kind,
        "requests": requests,
        "sessions": sessions,
        "dispatch_s_median": round(statistics.median(times), 3),
        "dispatch_s_range": [min(times), max(times)],
        "answered_s_median": round(statistics.median(r["answered_s"] for r in runs), 3),
        "cpu_s_median": round(statistics.median(r["cpu_s"] for r in runs), 3),
        "runs": runs,
    }


def flood(per_round: int, sessions: int) -> dict[str, Any]:
    """Two rounds through a private mosquitto and the in-process worker; seconds per round."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    from devtools.inproc import LiveWorker
    from devtools.mosquitto import Mosquitto

    answered = [0]
    codes: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()

    def on_message(client: Any, userdata: Any, message: Any) -> None:
        answer = json.loads(message.payload)
        with lock:
            answered[0] += 1
            codes[answer.get("error", {}).get("code") or "reply"] += 1

    with tempfile.TemporaryDirectory() as tmp:
        broker = Mosquitto(Path(tmp))
        broker.start()
        # As tests/broker/test_backpressure.py: two tokens a reply, no per-user rate limit.
        live = LiveWorker(broker.port, generation={"max_tokens": 2}, limits={"max_requests_per_user_per_minute": 0})
        client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        client.max_inflight_messages_set(1000)
        client.max_queued_messages_set(0)
        client.on_message = on_message
        client.connect("127.0.0.1", broker.port)
        client.loop_start()
        client.subscribe(f"{live.prefix}/+/+/reply", qos=1)
        time.sleep(0.3)
        rounds = []
        try:
            for round_ in range(2):
                started = time.perf_counter()
                per_session = per_round // sessions
                for s in range(sessions):
                    for turn in range(per_session):
                        payload = json.dumps({"message": "x", "requestId": f"{round_}-{turn}"}).encode()
                        client.publish(live.topic("bob", f"s{s}"), payload, qos=1)
                want = (round_ + 1) * per_session * sessions
                deadline = time.monotonic() + 600
                while answered[0] < want and time.monotonic() < deadline:
                    time.sleep(0.01)
                rounds.append(round(time.perf_counter() - started, 2))
                live.wait_idle(60)
        finally:
            client.disconnect()
            client.loop_stop()
            live.close()
            broker.stop()
    return {"per_round": per_round, "sessions": sessions, "round_s": rounds, "codes": dict(codes)}


class HoldingEngine:
    """Records when each request reached ``generate`` (on ``clock``: the wall clock where the
    sender is another process), and the event loop's CPU time when the last did; answers them
    all (a few tokens) once the last has come: the time to the engine, with nothing else on
    the loop."""

    def __init__(self, requests: int, clock: Callable[[], float] = time.perf_counter) -> None:
        from worker.engine.port import EngineInfo

        self.info = EngineInfo("hold", "0", "hold", max_model_len=16384, block_size=16, prefix_caching=True)
        self.requests, self.called, self.clock = requests, list[float](), clock
        self.loop_cpu_at_last = 0.0
        self.release = asyncio.Event()

    async def generate(self, request: Any) -> Any:
        from worker.engine.port import GenerationUpdate

        self.called.append(self.clock())
        if len(self.called) >= self.requests:
            self.loop_cpu_at_last = time.thread_time()  # on the worker's loop: its CPU so far
            self.release.set()
        await self.release.wait()
        yield GenerationUpdate("w " * 4, 4, len(request.prompt_token_ids), 0, True, "length")

    async def abort(self, request_id: str) -> None:
        pass

    def take_stats(self) -> Any:
        from worker.engine.port import EngineStats

        return EngineStats()

    def is_alive(self) -> bool:
        return True

    async def shutdown(self) -> None:
        pass


async def _to_engine_run(model: str, requests: int, store_kind: str, state: Path) -> dict[str, Any]:
    from worker.engine.tokenizer import ChatTokenizer

    config = WorkerConfig.model_validate(
        {"engine": {"model": model}, "mqtt": {"worker_id": "bench"}, "limits": {"max_requests_per_user_per_minute": 0}}
    )
    store: Any = MemoryStore()
    if store_kind == "sqlite":
        from worker.store.sqlite import SqliteStore

        store = SqliteStore(state)
    transport, engine = MemoryTransport(), HoldingEngine(requests)
    service = Service(config, engine, ChatTokenizer(model), transport, lambda code: None, store)  # type: ignore[arg-type]
    # About 300 words, each several tokens ("word12"): 811 tokens with SmolLM2's tokenizer,
    # 1,091 with the qwen3-1.7b test tokenizer's.
    text = " ".join(f"word{i % 97}" for i in range(280))
    for n in range(requests):
        transport.deliver(f"chat/bench/s{n}/request", {"message": f"{n} {text}", "requestId": f"r{n}"})
    started, loop_cpu = time.perf_counter(), time.thread_time()
    consumer = asyncio.ensure_future(service.consume())
    try:
        while len(transport.published) < requests:
            await asyncio.sleep(0.002)
    finally:
        consumer.cancel()
    loop_cpu = time.thread_time() - loop_cpu
    store.close()
    reached = sorted(t - started for t in engine.called)
    return {
        "first_to_engine_s": round(reached[0], 3),
        "last_to_engine_s": round(reached[-1], 3),
        "median_to_engine_s": round(reached[len(reached) // 2], 3),
        "loop_cpu_ms_per_request": round(loop_cpu * 1000 / requests, 3),  # the event loop's thread, to the answers
    }


def to_engine(model: str, requests: int, store_kind: str, repeat: int) -> dict[str, Any]:
    """``requests`` one-turn requests of about 300 words, all in the inbox at once, through the
    real Service and the model's real tokenizer (chat template, encoding) to an engine that
    records when each reached it (HoldingEngine): the worker's own cost per request at intake."""
    runs = []
    for _ in range(repeat):
        with tempfile.TemporaryDirectory() as state:
            runs.append(asyncio.run(_to_engine_run(model, requests, store_kind, Path(state))))
    return {
        "store": store_kind,
        "requests": requests,
        **{key: statistics.median(r[key] for r in runs) for key in runs[0]},
        "runs": runs,
    }


# Run by to_engine_mqtt in a process of its own (the burst's sender must not share the worker's
# GIL): connects, publishes every request at QoS 1 without waiting, prints when it began.
_PUBLISHER = r"""
import json, sys, time
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
port, prefix, count, label = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
client.max_inflight_messages_set(0)
client.max_queued_messages_set(0)
client.connect("127.0.0.1", port)
client.loop_start()
text = " ".join(f"word{i % 97}" for i in range(280))
payloads = [json.dumps({"message": f"{label}-{n} {text}", "requestId": f"r{n}"}).encode() for n in range(count)]
time.sleep(0.3)
started = time.time()
for n, payload in enumerate(payloads):
    client.publish(f"{prefix}/{label}/s{n}/request", payload, qos=1)
print(json.dumps({"started": started, "sent_s": time.time() - started}), flush=True)
time.sleep(1.0)
client.loop_stop()
"""


class Timeline:
    """When each request of a round passed each stage of the intake, on the wall clock (the
    sender is another process): ``received`` (paho's thread handed it to the loop: its
    InboundMessage.received_at), ``dispatched`` (the service's dispatch began), ``preparing`` and
    ``prepared`` (its turn's prompt segments queued for encoding, and encoded:
    ChatTokenizer.prepare), and the encoding batches, each (start, end, segments). Recorded by
    wrapping the instances' methods, so nothing of the worker changes for it."""

    STAGES = ("received", "dispatched", "preparing", "prepared")

    def __init__(self) -> None:
        self.marks: dict[str, list[float]] = {stage: [] for stage in self.STAGES}
        self.batches: list[list[float]] = []
        self._wrapped: list[tuple[Any, str]] = []

    def detach(self) -> None:
        """Undo attach: the renderer outlives a round (its caches are the tokenizer's), and a
        wrapper left on it would wrap the next round's too, each round one layer more."""
        for owner, name in self._wrapped:
            vars(owner).pop(name, None)
        self._wrapped.clear()

    def attach(self, service: Any, renderer: Any) -> None:
        self._wrapped += [(service, "dispatch"), (renderer, "prepare")]
        wall_minus_monotonic = time.time() - time.monotonic()
        marks, batches = self.marks, self.batches
        dispatch, prepare = service.dispatch, renderer.prepare

        async def timed_dispatch(message: Any) -> None:
            marks["received"].append(message.received_at + wall_minus_monotonic)
            marks["dispatched"].append(time.time())
            await dispatch(message)

        async def timed_prepare(*args: Any, **kwargs: Any) -> None:
            marks["preparing"].append(time.time())
            await prepare(*args, **kwargs)
            marks["prepared"].append(time.time())

        service.dispatch, renderer.prepare = timed_dispatch, timed_prepare
        if hasattr(renderer, "_start_batch"):  # ChatTokenizer's encoding batches
            start, done = renderer._start_batch, renderer._batch_done

            def timed_start() -> None:
                before = len(renderer._queued)
                at = time.time()
                start()
                if len(renderer._queued) < before:
                    batches.append([at, 0.0, float(before - len(renderer._queued))])

            def timed_done(parts: list[str], encoding: Any) -> None:
                for batch in batches:
                    if batch[1] == 0.0 and batch[2] == len(parts):
                        batch[1] = time.time()
                        break
                done(parts, encoding)

            renderer._start_batch, renderer._batch_done = timed_start, timed_done
            self._wrapped += [(renderer, "_start_batch"), (renderer, "_batch_done")]

    def summary(self, started: float) -> dict[str, Any]:
        """Each stage's quantiles (s after the first request was sent), and the batches'."""
        stages = {stage: _quantiles([t - started for t in times]) for stage, times in self.marks.items() if times}
        took = [end - begin for begin, end, _ in self.batches if end]
        return {
            "stages_s": stages,
            "encoding_batches": len(self.batches),
            "batch_segments": _quantiles([n for _, _, n in self.batches]) if self.batches else {},
            "batch_encode_ms": _quantiles([t * 1000 for t in took]) if took else {},
            "batches_started_s": _quantiles([begin - started for begin, _, _ in self.batches]) if self.batches else {},
        }


def _quantiles(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    return {f"q{int(q * 100)}": round(values[min(len(values) - 1, int(len(values) * q))], 3) for q in QUANTILES}


QUANTILES = (0, 0.1, 0.25, 0.5, 0.75, 0.9, 1)


def to_engine_mqtt(
    model: str, requests: int, repeat: int, mosquitto: str | None, *, store: str = "memory", timeline: bool = False
) -> dict[str, Any]:
    """``requests`` one-turn requests published at once by another process through a private
    mosquitto to the in-process worker (the ``store``, the model's tokenizer) and an engine
    that records when each reached it; ``repeat`` rounds, each a new user's sessions and texts
    (nothing of them in the tokenizer's caches). ``timeline``: each stage's times too (Timeline)."""
    import subprocess
    import sys

    from devtools.inproc import LiveWorker
    from devtools.mosquitto import Mosquitto
    from worker.engine.tokenizer import ChatTokenizer

    tokenizer = ChatTokenizer(model)
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        broker = Mosquitto(Path(tmp), binary=mosquitto, persistence=False, log=False)
        broker.start()
        try:
            for round_ in range(repeat):
                engine = HoldingEngine(requests, clock=time.time)
                history = {"store": store, "state_dir": str(Path(tmp) / f"state{round_}")}
                live = LiveWorker(
                    broker.port,
                    engine=engine,
                    renderer=tokenizer,
                    limits={"max_requests_per_user_per_minute": 0},
                    history=history,
                )
                stages = Timeline() if timeline else None
                if stages is not None:
                    stages.attach(live.service, tokenizer)
                try:
                    prefix = live.topic("u", "s").removesuffix("/u/s/request")
                    loop_cpu = live.call(time.thread_time)
                    sent = subprocess.run(
                        [sys.executable, "-c", _PUBLISHER, str(broker.port), prefix, str(requests), f"round{round_}"],
                        capture_output=True,
                        text=True,
                        check=True,
                        timeout=120,
                    )
                    sender = json.loads(sent.stdout.strip().splitlines()[-1])
                    live.wait_idle(120)
                finally:
                    live.close()
                    if stages is not None:
                        stages.detach()
                rounds.append(
                    {
                        "sent_s": round(sender["sent_s"], 3),
                        # the worker's event loop, from before the first was sent until the last reached the engine
                        "loop_cpu_ms_per_request": round((engine.loop_cpu_at_last - loop_cpu) * 1000 / requests, 3),
                        "reached_engine_s": _quantiles([at - sender["started"] for at in engine.called]),
                        **(stages.summary(sender["started"]) if stages is not None else {}),
                    }
                )
        finally:
            broker.stop()
    return {"requests": requests, "store": store, "rounds": rounds}


def _what_if(args: argparse.Namespace) -> None:
    """Set the intake's constants the options name, for this process."""
    import sys

    from worker.core import service
    from worker.engine import tokenizer

    if args.encode_in_flight is not None:
        tokenizer.ENCODE_BATCHES_IN_FLIGHT = args.encode_in_flight
    if args.encode_batch_chars is not None:
        tokenizer.ENCODE_BATCH_CHARS = args.encode_batch_chars
    if args.dispatch_slice is not None:
        service.DISPATCH_SLICE = args.dispatch_slice
    if args.switch_ms is not None:
        sys.setswitchinterval(args.switch_ms / 1000)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.intake", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=650)
    parser.add_argument("--sessions", type=int, default=650)
    parser.add_argument(
        "--store", choices=["memory", "sqlite", "both"], default=None, help="default: both; memory with --over-mqtt"
    )
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--flood", type=int, default=2000, help="requests per flood round; 0: no flood")
    parser.add_argument("--flood-sessions", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument(
        "--to-engine", metavar="MODEL", default=None, help="only the time to the engine, with this model's tokenizer"
    )
    parser.add_argument("--over-mqtt", action="store_true", help="--to-engine through a broker and the transport")
    parser.add_argument("--mosquitto", default=None, help="the broker's binary (default: Debian's)")
    parser.add_argument(
        "--timeline", action="store_true", help="--over-mqtt: when each request passed each stage of the intake"
    )
    # What-if settings of the intake's own constants, to measure them on a host (not config:
    # the worker sets them from measurements, see their comments).
    parser.add_argument("--encode-in-flight", type=int, default=None, help="tokenizer ENCODE_BATCHES_IN_FLIGHT")
    parser.add_argument("--encode-batch-chars", type=int, default=None, help="tokenizer ENCODE_BATCH_CHARS")
    parser.add_argument("--dispatch-slice", type=int, default=None, help="service DISPATCH_SLICE")
    parser.add_argument("--switch-ms", type=float, default=None, help="Python's thread switch interval (ms)")
    args = parser.parse_args(argv)
    _what_if(args)
    if args.over_mqtt and not args.to_engine:
        parser.error("--over-mqtt measures --to-engine MODEL's requests: give the model too")
    if args.timeline and not args.over_mqtt:
        parser.error("--timeline is recorded with --over-mqtt")
    if args.store is None:
        args.store = "memory" if args.over_mqtt else "both"
    if args.over_mqtt and args.store == "both":
        parser.error("--over-mqtt runs one store: --store memory or --store sqlite")
    import sys

    from loguru import logger

    logger.remove()  # the worker's DEBUG lines would cost more than what is measured
    logger.add(sys.stderr, level="WARNING")
    if args.to_engine and args.over_mqtt:
        result = to_engine_mqtt(
            args.to_engine, args.requests, args.repeat, args.mosquitto, store=args.store, timeline=args.timeline
        )
        for round_ in result["rounds"]:
            print(f"to the engine over MQTT, {args.requests} requests: {json.dumps(round_)}", flush=True)
        if args.out is not None:
            args.out.write_text(json.dumps(result, indent=1) + "\n")
        return 0
    if args.to_engine:
        kinds = ["memory", "sqlite"] if args.store == "both" else [args.store]
        report = {kind: to_engine(args.to_engine, args.requests, kind, args.repeat) for kind in kinds}
        for kind, result in report.items():
            print(f"to the engine, {kind}: {json.dumps({k: v for k, v in result.items() if k != 'runs'})}", flush=True)
        if args.out is not None:
            args.out.write_text(json.dumps(report, indent=1) + "\n")
        return 0
    results: dict[str, Any] = {"dispatch": []}
    for kind in ["memory", "sqlite"] if args.store == "both" else [args.store]:
        result = dispatch(kind, args.requests, args.sessions, args.repeat)
        results["dispatch"].append(result)
        print(
            f"dispatch {kind}: {args.requests} requests over {args.sessions} sessions: "
            f"{result['dispatch_s_median']} s (range {result['dispatch_s_range']}), "
            f"answered in {result['answered_s_median']} s, CPU {result['cpu_s_median']} s; "
            f"{result['runs'][0]['codes']}",
            flush=True,
        )
    if args.flood:
        results["flood"] = flood(args.flood, args.flood_sessions)
        print(f"flood: 2 x {args.flood} over {args.flood_sessions} sessions: {results['flood']}", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
