"""The vision phase: sessions that each send one 1024x768 JPEG and then a second, text-only
turn, through the worker over MQTT and through vLLM's AsyncLLM in this process with the same
engine arguments, in one run (as bench/burst.py does for text).

For each N of ``vision_sessions`` (after a warm-up of ``vision_warmup`` sessions, whose
images the engine's first encoder and CUDA-graph runs are spent on): N sessions at the same
moment send a first turn of a short question and one image (a generated JPEG, different for
each session and run: noise and shapes, about 115 KB, the size of a camera snapshot), as
Ollama's ``images``; once every reply is in, each sends a second turn of text, whose prompt
the kept history's image is sent again with (the worker does that itself; the raw side
renders the history and passes the same image with the same identifier).

Reported per N, side and turn: images per second (N over the time from the first request
sent to the last reply), TTFT p50/p95/max (the worker's: the client's time to the first
stream delta), latency, prompt, image and cached tokens, and the prefix-cache hit of the
second turn (cached over prompt tokens, over all sessions and the lowest of one session).

The event loop's lag while images are processed: the worker's, from outside, as the round
trip of a request the worker answers on its event loop without the engine (an invalid
``maxTokens``: an error reply), sent every 20 ms through the broker throughout, idle before
the runs and during each turn; raw AsyncLLM's, inside its process, as the overshoot of a
10 ms ``asyncio.sleep`` loop (vLLM 0.26's ``add_request`` runs the image processor on the
caller's loop; the worker runs it on a thread of its own).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import io
import json
import random
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from .common import percentile
from .profiles import Profile, engine_flags

WIDTH, HEIGHT = 1024, 768
FIRST = "What is in this picture? Describe it."
SECOND = "Which colour is the largest shape?"
PING_INTERVAL_S = 0.02
LOOP_TICK_S = 0.01


def make_jpeg(seed: int, width: int = WIDTH, height: int = HEIGHT) -> bytes:
    """A JPEG of ``width`` x ``height``: smooth colour noise (a coarse random grid scaled up),
    fine grain, and a dozen filled shapes; quality 85 (about 115 KB at 1024x768)."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    coarse = Image.frombytes("RGB", (32, 24), bytes(rng.randrange(256) for _ in range(32 * 24 * 3)))
    image = coarse.resize((width, height), Image.Resampling.BICUBIC)
    grain = Image.frombytes("L", (width, height), rng.randbytes(width * height)).convert(
        "RGB"
    )  # seeded, unlike effect_noise
    image = Image.blend(image, grain, 0.05)
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x0, y0 = rng.randrange(width - 40), rng.randrange(height - 40)
        box = (x0, y0, x0 + rng.randrange(30, 300), y0 + rng.randrange(30, 300))
        colour = (rng.randrange(256), rng.randrange(256), rng.randrange(256))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=colour)
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=85)
    return out.getvalue()


@dataclasses.dataclass(frozen=True)
class TurnOutcome:
    """One request: times in seconds from the run's first send."""

    session: int
    ttft_s: float | None
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    image_tokens: int
    completion_tokens: int


def turn_summary(outcomes: list[TurnOutcome], wall_s: float, images: int) -> dict[str, Any]:
    """Images/s, tokens/s, TTFT and latency percentiles, tokens and the prefix-cache hit."""
    ttfts = [o.ttft_s * 1000 for o in outcomes if o.ttft_s is not None]
    totals = [o.total_s * 1000 for o in outcomes]
    prompt = sum(o.prompt_tokens for o in outcomes)
    cached = sum(o.cached_tokens for o in outcomes)

    def ms(values: list[float], q: float) -> float | None:
        return round(percentile(values, q), 1) if values else None

    return {
        "sessions": len(outcomes),
        "images": images,
        "images_per_s": round(images / wall_s, 2) if images and wall_s > 0 else None,
        "tok_per_s": round(sum(o.completion_tokens for o in outcomes) / wall_s, 1) if wall_s > 0 else None,
        "ttft_p50_ms": ms(ttfts, 50),
        "ttft_p95_ms": ms(ttfts, 95),
        "ttft_max_ms": round(max(ttfts), 1) if ttfts else None,
        "latency_p50_ms": ms(totals, 50),
        "latency_p95_ms": ms(totals, 95),
        "prompt_tokens_mean": round(prompt / len(outcomes), 1) if outcomes else None,
        "image_tokens_mean": round(sum(o.image_tokens for o in outcomes) / len(outcomes), 1) if outcomes else None,
        "cached_tokens_mean": round(cached / len(outcomes), 1) if outcomes else None,
        "cache_hit": round(cached / prompt, 3) if prompt else None,
        "cache_hit_min": (
            round(min(o.cached_tokens / o.prompt_tokens for o in outcomes if o.prompt_tokens), 3)
            if any(o.prompt_tokens for o in outcomes)
            else None
        ),
        "wall_s": round(wall_s, 3),
    }


def first_turn_covered(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """How much of each session's first prompt (its image included) the second turn found in
    the prefix cache: cached tokens of the second turn over prompt tokens of the first, over all
    sessions and the lowest of one. The second turn's own hit (cache_hit) also counts the
    first reply and the new message, which cannot be cached. The worker writes the first reply
    into the second prompt as the ids it was generated as, so its blocks are found; the raw
    side renders the history's text again, and with dummy weights the reply's random tokens do
    not encode back to the same ids (a real model's text mostly does)."""
    pairs = list(zip(first["outcomes"], second["outcomes"], strict=True))
    prompt = sum(one[3] for one, _ in pairs)
    covered = [min(1.0, two[4] / one[3]) for one, two in pairs if one[3]]
    return {
        "first_turn_covered": round(min(1.0, sum(two[4] for _, two in pairs) / prompt), 3) if prompt else None,
        "first_turn_covered_min": round(min(covered), 3) if covered else None,
    }


def lag_summary(samples: list[float]) -> dict[str, Any]:
    """Percentiles of lag samples (ms)."""
    if not samples:
        return {"samples": 0}
    return {
        "samples": len(samples),
        "p50_ms": round(percentile(samples, 50), 2),
        "p95_ms": round(percentile(samples, 95), 2),
        "p99_ms": round(percentile(samples, 99), 2),
        "max_ms": round(max(samples), 2),
    }


class VisionClient:
    """Chat sessions over MQTT with images, and a ping thread probing the worker's event loop.
    Replies and first stream deltas are kept by request id (paho's thread hands them over
    under a condition; the benchmark's threads wait on it)."""

    def __init__(self, port: int, prefix: str = "chat", user: str = "bench") -> None:
        from devtools.mqtt_client import connect

        self.prefix, self.user = prefix, user
        self.run_id = uuid.uuid4().hex[:6]
        self.replies: dict[str, tuple[float, dict[str, Any]]] = {}
        self.first_delta: dict[str, float] = {}
        self.changed = threading.Condition()
        self.pings: list[tuple[float, float]] = []  # (sent, round trip ms)
        self._stop_pings = threading.Event()
        self._ping_thread: threading.Thread | None = None
        subscriptions = [(f"{prefix}/{user}/+/reply", 1), (f"{prefix}/{user}/+/stream", 0)]
        self.client = connect(port, subscriptions, on_message=self._on_message, keepalive=60)

    def _on_message(self, message: Any) -> None:
        received = time.perf_counter()
        data = json.loads(message.payload)
        request_id = data.get("requestId")
        if request_id is None:
            return
        with self.changed:
            if message.topic.endswith("/stream"):
                self.first_delta.setdefault(request_id, received)
            else:
                self.replies[request_id] = (received, data)
            self.changed.notify_all()

    def send(self, session: str, payload: dict[str, Any]) -> float:
        body = json.dumps(payload)
        sent = time.perf_counter()
        self.client.publish(f"{self.prefix}/{self.user}/{session}/request", body, qos=1)
        return sent

    def wait(self, request_ids: list[str], timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        with self.changed:
            while not all(r in self.replies for r in request_ids):
                if not self.changed.wait(max(0.0, deadline - time.monotonic())) and time.monotonic() > deadline:
                    missing = [r for r in request_ids if r not in self.replies]
                    raise TimeoutError(f"no reply to {len(missing)} of {len(request_ids)} requests")

    def start_pings(self) -> None:
        def run() -> None:
            session = f"ping-{self.run_id}"
            count = 0
            while not self._stop_pings.is_set():
                count += 1
                request_id = f"ping-{self.run_id}-{count}"
                sent = self.send(session, {"message": "x", "maxTokens": 10**9, "requestId": request_id})
                try:
                    self.wait([request_id], timeout=60)
                except TimeoutError:
                    continue
                received = self.replies.pop(request_id)[0]
                self.pings.append((sent, (received - sent) * 1000))
                self._stop_pings.wait(PING_INTERVAL_S)

        self._ping_thread = threading.Thread(target=run, name="pings", daemon=True)
        self._ping_thread.start()

    def pings_between(self, start: float, end: float) -> list[float]:
        return [rtt for sent, rtt in self.pings if start <= sent <= end]

    def close(self) -> None:
        self._stop_pings.set()
        if self._ping_thread is not None:
            self._ping_thread.join(5)
        self.client.disconnect()
        self.client.loop_stop()


def _images(seed: int, count: int) -> list[bytes]:
    return [make_jpeg(seed * 10_000 + i) for i in range(count)]


def vision_phase(profile: Profile, model: Path, out: Path, mosquitto: str) -> dict[str, Any]:
    from worker.config.models import EngineConfig
    from worker.engine.tokenizer import ChatTokenizer

    from .runs import STOP_TIMEOUT, start_broker, start_worker

    settings = {**profile.engine_overrides, "extra": dict(profile.engine_overrides.get("extra", {}))}
    sizes = list(profile.vision_sessions)
    max_tokens = profile.vision_max_tokens
    images = {n: _images(n, n) for n in [0, *sizes]}  # 0: the warm-up's
    images[0] = _images(0, profile.vision_warmup)
    result: dict[str, Any] = {
        "engine_settings": settings,
        "image": {
            "width": WIDTH,
            "height": HEIGHT,
            "jpeg_bytes_mean": round(sum(map(len, images[sizes[-1]])) / sizes[-1]),
        },
        "max_tokens": max_tokens,
        "sessions": sizes,
    }
    tokenizer = ChatTokenizer(str(model))
    # The worker over MQTT.
    broker = start_broker(mosquitto, out)
    log = out / "worker-vision.log"
    args = ["--model", str(model), *engine_flags(settings)]
    worker = start_worker(args, broker.port, log)
    result["start_to_ready_s"] = worker.start_to_ready_s
    client = VisionClient(broker.port)
    runs: dict[str, Any] = {"worker": {}, "raw": {}}
    lag: dict[str, Any] = {"worker": {}, "raw": {}}
    try:
        client.start_pings()
        time.sleep(2.0)
        idle_end = time.perf_counter()
        lag["worker"]["idle"] = lag_summary(client.pings_between(0.0, idle_end))
        for count in [0, *sizes]:
            label = "warm" if count == 0 else f"n{count}"
            first_payloads = [
                {"message": FIRST, "images": [_b64(data)], "maxTokens": max_tokens, "stream": True}
                for data in images[count]
            ]
            sessions = [f"vision-{label}-{i}-{client.run_id}" for i in range(len(first_payloads))]
            one = _worker_round(client, sessions, first_payloads)
            two = _worker_round(
                client, sessions, [{"message": SECOND, "maxTokens": max_tokens, "stream": True}] * len(sessions)
            )
            if count == 0:
                result["warmup_worker"] = {"first": one["summary"], "second": two["summary"]}
                continue
            runs["worker"][count] = {"first": one["summary"], "second": two["summary"]}
            two["summary"].update(first_turn_covered(one["summary"], two["summary"]))
            lag["worker"][count] = {
                "first": lag_summary(client.pings_between(*one["window"])),
                "second": lag_summary(client.pings_between(*two["window"])),
            }
            print(
                f"vision worker {count}: {_line(runs['worker'][count])}; lag {lag['worker'][count]['first']}",
                flush=True,
            )
        lag["worker"]["all_pings"] = [(round(s - idle_end, 4), round(r, 2)) for s, r in client.pings]
    finally:
        client.close()
        worker.stop(STOP_TIMEOUT)
        broker.stop()
    result["runs"] = runs
    result["lag"] = lag
    # The worker's side on its own, should the raw side not finish within the command's time.
    (out / "vision-worker.json").write_text(json.dumps(result, indent=1, default=str))
    # Raw vLLM in this process: the same engine arguments, images and questions.
    raw = asyncio.run(_raw_side(EngineConfig(model=str(model), **settings), tokenizer, images, sizes, max_tokens))
    runs["raw"] = raw.pop("runs")
    lag["raw"] = raw.pop("lag")
    result.update(raw)
    result["worker_over_raw_images_per_s"] = {
        count: round(runs["worker"][count]["first"]["images_per_s"] / runs["raw"][count]["first"]["images_per_s"], 3)
        for count in sizes
        if runs["raw"].get(count, {}).get("first", {}).get("images_per_s")
    }
    return result


def _b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode("ascii")


def _worker_round(client: VisionClient, sessions: list[str], payloads: list[dict[str, Any]]) -> dict[str, Any]:
    """One turn of every session at once: its summary and its window (perf_counter)."""
    request_ids = [f"{s}-{uuid.uuid4().hex[:6]}" for s in sessions]
    started = time.perf_counter()
    sent = [client.send(s, {**p, "requestId": r}) for s, p, r in zip(sessions, payloads, request_ids, strict=True)]
    client.wait(request_ids)
    outcomes: list[TurnOutcome] = []
    ended = started
    for index, (request_id, at) in enumerate(zip(request_ids, sent, strict=True)):
        received, reply = client.replies.pop(request_id)
        if "error" in reply:
            raise RuntimeError(f"error reply: {reply}")
        ended = max(ended, received)
        usage, latency = reply["usage"], reply["latency"]
        first = client.first_delta.pop(request_id, None)
        ttft: float | None = None
        if first is not None:
            ttft = first - at
        elif latency.get("ttftMs") is not None:
            # No stream delta: the client's time to the reply less the worker's from the first token on.
            ttft = max(0.0, received - at - (latency["totalMs"] - latency["ttftMs"]) / 1000)
        outcomes.append(
            TurnOutcome(
                session=index,
                ttft_s=ttft,
                total_s=received - at,
                prompt_tokens=int(usage["promptTokens"]),
                cached_tokens=int(usage.get("cachedTokens") or 0),
                image_tokens=int(usage.get("imageTokens") or 0),
                completion_tokens=int(usage["completionTokens"]),
            )
        )
    images = sum(1 for p in payloads if p.get("images"))
    summary = turn_summary(outcomes, ended - started, images)
    summary["outcomes"] = [dataclasses.astuple(o) for o in outcomes]
    return {"summary": summary, "window": (started, ended)}


async def _raw_side(
    config: Any, tokenizer: Any, images: dict[int, list[bytes]], sizes: list[int], max_tokens: int
) -> dict[str, Any]:
    """The same rounds on an AsyncLLM of the same engine arguments, in one event loop, with a
    task measuring that loop's lag."""
    from .inprocess import InProcess

    engine = InProcess(config, tokenizer)
    result: dict[str, Any] = {"raw_engine_start_s": engine.start_s, "runs": {}, "lag": {}}
    ticks: list[tuple[float, float]] = []  # (when, overshoot ms)
    stop = asyncio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            before = time.perf_counter()
            await asyncio.sleep(LOOP_TICK_S)
            after = time.perf_counter()
            ticks.append((after, (after - before - LOOP_TICK_S) * 1000))

    probe = asyncio.create_task(ticker())
    try:
        await asyncio.sleep(2.0)
        result["lag"]["idle"] = lag_summary([lag for _, lag in ticks])
        for count in [0, *sizes]:
            one, replies, window_one = await _raw_round(engine.llm, tokenizer, images[count], None, max_tokens)
            two, _, window_two = await _raw_round(engine.llm, tokenizer, images[count], replies, max_tokens)
            if count == 0:
                result["warmup_raw"] = {"first": one, "second": two}
                continue
            two.update(first_turn_covered(one, two))
            result["runs"][count] = {"first": one, "second": two}
            result["lag"][count] = {
                "first": lag_summary([lag for when, lag in ticks if window_one[0] <= when <= window_one[1]]),
                "second": lag_summary([lag for when, lag in ticks if window_two[0] <= when <= window_two[1]]),
            }
            print(
                f"vision raw {count}: {_line(result['runs'][count])}; lag {result['lag'][count]['first']}", flush=True
            )
    finally:
        stop.set()
        await probe
        engine.shutdown()
    return result


def _messages(replies: list[str] | None, index: int) -> list[dict[str, Any]]:
    first = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": FIRST}]}
    if replies is None:
        return [first]
    return [first, {"role": "assistant", "content": replies[index]}, {"role": "user", "content": SECOND}]


async def _raw_round(
    llm: Any, tokenizer: Any, images: list[bytes], replies: list[str] | None, max_tokens: int
) -> tuple[dict[str, Any], list[str], tuple[float, float]]:
    """Every session's turn at once into the AsyncLLM (ignore_eos: exactly max_tokens each):
    the JPEG decoded on a thread, its pixels with the content hash as their identifier, as
    the worker passes them (worker/engine/vllm.py image_prompt)."""
    from PIL import Image
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    from worker.engine.port import EngineImage
    from worker.engine.vllm import image_prompt

    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.7, top_p=0.95, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    prompts = [
        tokenizer.render(_messages(replies, i), add_generation_prompt=True)  # type: ignore[arg-type]
        for i in range(len(images))
    ]
    texts: list[str] = [""] * len(images)

    def decode(data: bytes) -> Any:
        with Image.open(io.BytesIO(data)) as opened:
            opened.load()
            return opened.convert("RGB")

    started = time.perf_counter()

    async def one(index: int) -> TurnOutcome:
        data = images[index]
        pixels = await asyncio.to_thread(decode, data)
        prompt = image_prompt(prompts[index], [EngineImage(pixels, hashlib.sha256(data).hexdigest())])
        first: float | None = None
        tokens = cached = prompt_tokens = 0
        parts: list[str] = []
        async for output in llm.generate(prompt, params, uuid.uuid4().hex):
            piece = output.outputs[0]
            if first is None and piece.token_ids:
                first = time.perf_counter() - started
            tokens += len(piece.token_ids)
            parts.append(piece.text)
            if output.prompt_token_ids:
                prompt_tokens = len(output.prompt_token_ids)
            cached = int(output.num_cached_tokens or 0)
        texts[index] = "".join(parts)
        return TurnOutcome(index, first, time.perf_counter() - started, prompt_tokens, cached, 0, tokens)

    outcomes = await asyncio.gather(*(one(i) for i in range(len(images))))
    ended = time.perf_counter()
    summary = turn_summary(list(outcomes), ended - started, len(images) if replies is None else 0)
    summary["outcomes"] = [dataclasses.astuple(o) for o in outcomes]
    return summary, texts, (started, ended)


def _line(run: dict[str, Any]) -> str:
    first, second = run["first"], run["second"]
    return (
        f"{first['images_per_s']} images/s, TTFT p50 {first['ttft_p50_ms']} ms p95 {first['ttft_p95_ms']} ms; "
        f"second turn TTFT p50 {second['ttft_p50_ms']} ms, "
        f"cache hit {second['cache_hit']} (min {second['cache_hit_min']})"
    )


def vision_markdown(result: dict[str, Any]) -> str:
    """The phase's tables: throughput and TTFT per N and side, then the event loop's lag."""
    lines = [
        "# Images: the worker over MQTT against raw AsyncLLM",
        "",
        f"One {WIDTH}x{HEIGHT} JPEG per session (about {result['image']['jpeg_bytes_mean'] // 1000} KB), "
        f"{result['max_tokens']} reply tokens; then a text-only second turn (the image re-sent from history).",
        "",
        "| sessions | side | images/s | TTFT p50 | TTFT p95 | image tokens | 2nd turn TTFT p50 | 2nd turn TTFT p95 "
        "| 2nd turn cache hit (min) | 1st prompt cached in 2nd (min) | worker / raw images/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratio = result.get("worker_over_raw_images_per_s", {})
    for count in result["sessions"]:
        for side in ("worker", "raw"):
            run = result["runs"][side].get(str(count)) or result["runs"][side].get(count)
            if not run:
                continue
            first, second = run["first"], run["second"]
            covered = first_turn_covered(first, second) if first.get("outcomes") else {}
            cell = ratio.get(str(count), ratio.get(count, "")) if side == "worker" else ""
            lines.append(
                f"| {count} | {side} | {first['images_per_s']} | {first['ttft_p50_ms']} ms | {first['ttft_p95_ms']} ms "
                f"| {first['image_tokens_mean'] or ''} | {second['ttft_p50_ms']} ms | {second['ttft_p95_ms']} ms "
                f"| {second['cache_hit']} ({second['cache_hit_min']}) "
                f"| {covered.get('first_turn_covered')} ({covered.get('first_turn_covered_min')}) | {cell} |"
            )
    lines += [
        "",
        "Event-loop lag (worker: round trip of a request answered without the engine, every "
        f"{PING_INTERVAL_S * 1000:.0f} ms; raw: overshoot of a {LOOP_TICK_S * 1000:.0f} ms sleep on AsyncLLM's loop):",
        "",
        "| side | while | p50 | p95 | p99 | max | samples |",
        "|---|---|---|---|---|---|---|",
    ]
    for side in ("worker", "raw"):
        lag = result["lag"].get(side, {})
        rows: list[tuple[str, dict[str, Any]]] = [("idle", lag.get("idle", {}))]
        for count in result["sessions"]:
            entry = lag.get(str(count)) or lag.get(count) or {}
            rows += [
                (f"{count} sessions, 1st turn", entry.get("first", {})),
                (f"{count} sessions, 2nd turn", entry.get("second", {})),
            ]
        for name, s in rows:
            if s.get("samples"):
                lines.append(
                    f"| {side} | {name} | {s['p50_ms']} ms | {s['p95_ms']} ms | {s['p99_ms']} ms | {s['max_ms']} ms "
                    f"| {s['samples']} |"
                )
    return "\n".join(lines) + "\n"


def write_vision_report(out: Path, phase: str = "vision") -> None:
    path = out / f"{phase}.json"
    if path.exists():
        (out / f"{phase}.md").write_text(vision_markdown(json.loads(path.read_text())))
