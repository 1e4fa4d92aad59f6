"""Tool calling through the worker over MQTT: what tools cost.

    python -m bench.tools --geometry qwq-32b --out DIR [--mosquitto BIN] [--worker-args "..."]
    python -m bench.tools --model DIR --out DIR --worker-args "..."     (a model directory)

Four measurements, each through a real worker process and broker:

- ``prefix``: the second turn's TTFT of sessions that keep 20 tools, against sessions with
  none: the tools sit in the system message, a prefix the cache holds, so the second turn
  should cost what it costs without them.
- ``forced``: decode time per output token of forced calls (toolChoice naming a tool: the
  grammar writes the call in the model's own format) against free text, at batch 1 and 16.
- ``round``: a full client tool round (request -> toolCalls -> toolResults -> answer), timed by
  the client, against the generation time the worker reports: what the round costs beyond
  generating, set against one MQTT round trip plus the worker's TTFT for the results.
- ``raw``: the ``prefix`` measurement without the worker: the same rendered prompts straight
  into vLLM in this process (after the worker has stopped), so that a ratio can be told apart
  into what vLLM itself costs for a longer cached prefix and what the worker adds.
- ``parse``: forced calls (required, and each tool named) at once: every one must parse and
  validate against its tool's parameters.
- ``loop``: the worker's own tool loop (docs/tools.md): sessions at once, each sending
  ``--loop-rounds`` requests that each force a call to a simulated device (devtools/devices.py,
  answering after ``--device-ms``), which the worker runs before generating the answer;
  against the same sessions sending plain requests for the same number of tokens. Reported:
  throughput and p95 request time of both, the worker's overhead per device round beyond
  generation (and beyond the device and its MQTT round trip), and whether the answer's
  generation found the whole prompt before the call in the prefix cache.

Results: DIR/tools.json and DIR/tools.md. The tools' parameters are bounded (enums, integers
with a range, strings with maxLength) so that a random-weights model finishes every call.
"""

from __future__ import annotations

import argparse
import json
import platform
import queue
import shlex
import statistics
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

from devtools.mqtt_client import connect

from .common import REPO, phase_list
from .runs import STOP_TIMEOUT, start_broker, start_worker

PHASES = ("prefix", "forced", "round", "parse", "raw", "loop")
# The worker tool of the loop phase: the simulated sensor (devtools/devices.py).
LOOP_TOOL = {
    "name": "sensor_read",
    "description": "Read the living-room sensor: temperature and whether anyone is in the room",
    "topic": "devices/sensor/read",
    "users": ["bench"],
    "timeout": 30,
}

PARAMETERS = {
    "set_lamp": {
        "type": "object",
        "properties": {"on": {"type": "boolean"}, "room": {"enum": ["kitchen", "hall", "office"]}},
        "required": ["on", "room"],
        "additionalProperties": False,
    },
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "unit": {"enum": ["c", "f"]},
        },
        "required": ["city", "days", "unit"],
        "additionalProperties": False,
    },
}


def tool(name: str, parameters: dict[str, Any] | None = None, description: str = "") -> dict[str, Any]:
    function: dict[str, Any] = {"name": name, "description": description or f"The {name} tool of the house."}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


DEVICE_TOOLS = [tool(name, parameters) for name, parameters in PARAMETERS.items()]
# 20 tools of realistic size (a description and a few typed parameters each).
TWENTY_TOOLS = [
    *DEVICE_TOOLS,
    *(
        tool(
            f"device_{i:02d}",
            {
                "type": "object",
                "properties": {
                    "level": {"type": "integer", "minimum": 0, "maximum": 100},
                    "mode": {"enum": ["auto", "manual", "off"]},
                    "label": {"type": "string", "maxLength": 16},
                },
                "required": ["level"],
            },
            f"Set device number {i}: its level in percent, its mode and a label shown on its display.",
        )
        for i in range(18)
    ),
]
SYSTEM = "You are the assistant of a smart home. Be brief and precise; call a tool when one fits. " * 8


class Chat:
    """A chat frontend on the bench user's topics: sends requests, timestamps every reply."""

    def __init__(self, port: int) -> None:
        self.replies: queue.Queue[tuple[float, str, dict[str, Any]]] = queue.Queue()
        self.run = uuid.uuid4().hex[:6]
        self.client = connect(
            port,
            ["chat/bench/+/reply"],
            on_message=lambda m: self.replies.put((time.perf_counter(), m.topic.split("/")[2], json.loads(m.payload))),
        )

    def session(self, label: str, i: int) -> str:
        return f"{label}-{self.run}-{i}"

    def send(self, session: str, payload: dict[str, Any]) -> float:
        sent = time.perf_counter()
        self.client.publish(f"chat/bench/{session}/request", json.dumps(payload), qos=1).wait_for_publish(10)
        return sent

    def wait(self, count: int, timeout: float = 900) -> dict[str, tuple[float, dict[str, Any]]]:
        """The next ``count`` replies by session."""
        out: dict[str, tuple[float, dict[str, Any]]] = {}
        deadline = time.perf_counter() + timeout
        while len(out) < count:
            received, session, reply = self.replies.get(timeout=max(deadline - time.perf_counter(), 0.1))
            if "error" in reply:
                raise RuntimeError(f"error reply on {session}: {reply['error']}")
            out[session] = (received, reply)
        return out

    def ask(self, session: str, payload: dict[str, Any]) -> tuple[float, float, dict[str, Any]]:
        sent = self.send(session, payload)
        received, reply = self.wait(1)[session]
        return sent, received, reply

    def ping(self, count: int = 20) -> list[float]:
        """Round trips of a request refused without the engine: the MQTT hop and dispatch."""
        times = []
        for i in range(count):
            session = self.session("ping", i)
            sent = self.send(session, {"message": "x", "maxTokens": 10**9})
            while True:
                received, where, _ = self.replies.get(timeout=30)
                if where == session:
                    times.append((received - sent) * 1000)
                    break
        return times

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def per_token_ms(reply: dict[str, Any]) -> float | None:
    """Decode time per output token by the worker's clock (first token to the reply)."""
    tokens = reply["usage"]["completionTokens"]
    decoding = reply["latency"]["totalMs"] - reply["latency"]["ttftMs"]
    return decoding / (tokens - 1) if tokens > 1 and decoding > 0 else None


def median(values: list[float]) -> float:
    return round(statistics.median(values), 2) if values else float("nan")


def measure_prefix(chat: Chat, sessions: int, count: int = 20) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, tools in (("none", None), (f"{count} tools", TWENTY_TOOLS[:count])):
        ttfts, cached, prompts = [], [], []
        for i in range(sessions):
            session = chat.session(f"prefix{len(out)}", i)
            first: dict[str, Any] = {"message": "Good evening. What can you do?", "systemPrompt": SYSTEM}
            first |= {"maxTokens": 32, **({"tools": tools} if tools else {})}
            chat.ask(session, first)
            _, _, reply = chat.ask(session, {"message": "Dim the hall lights a little, please.", "maxTokens": 32})
            ttfts.append(reply["latency"]["ttftMs"])
            cached.append(reply["usage"]["cachedTokens"])
            prompts.append(reply["usage"]["promptTokens"])
        out[label] = {"ttft_ms_p50": median(ttfts), "prompt_tokens": median(prompts), "cached_tokens": median(cached)}
    out["ratio"] = round(out[f"{count} tools"]["ttft_ms_p50"] / out["none"]["ttft_ms_p50"], 3)
    return out


def measure_forced(chat: Chat, batches: tuple[int, ...], repeats: int) -> dict[str, Any]:
    named = {"type": "function", "function": {"name": "get_weather"}}
    out: dict[str, Any] = {}
    # The grammar of the forced call is compiled once, then cached: not part of the measurement.
    chat.ask(chat.session("forced-warm", 0), {"message": "Weather?", "tools": DEVICE_TOOLS, "toolChoice": named})
    for batch in batches:
        row: dict[str, Any] = {}
        for label, extra in (
            ("free text", {"maxTokens": 64}),
            ("forced call", {"tools": DEVICE_TOOLS, "toolChoice": named, "maxTokens": 96}),
        ):
            rates, tokens = [], []
            for r in range(repeats):
                names = [chat.session(f"forced-{batch}-{label[0]}-{r}", i) for i in range(batch)]
                for name in names:
                    chat.send(name, {"message": "What is the weather like in Lisbon this week?", **extra})
                for _, reply in chat.wait(batch).values():
                    rate = per_token_ms(reply)
                    if rate is not None:
                        rates.append(rate)
                    tokens.append(reply["usage"]["completionTokens"])
            row[label] = {"ms_per_token_p50": median(rates), "tokens_p50": median(tokens)}
        row["ratio"] = round(row["forced call"]["ms_per_token_p50"] / row["free text"]["ms_per_token_p50"], 3)
        out[f"batch {batch}"] = row
    return out


def measure_round(chat: Chat, rounds: int, rtt_ms: float) -> dict[str, Any]:
    lamp = {"type": "function", "function": {"name": "set_lamp"}}
    rows = []
    for i in range(rounds):
        session = chat.session("round", i)
        request = {"message": "Switch on the kitchen lamp.", "systemPrompt": SYSTEM, "tools": DEVICE_TOOLS}
        sent, _, first = chat.ask(session, {**request, "toolChoice": lamp})
        (call,) = first["toolCalls"]
        results = {"toolResults": [{"toolCallId": call["id"], "content": '{"ok": true, "on": true}'}], "maxTokens": 16}
        results_sent, received, second = chat.ask(session, {**results, "toolChoice": "none"})
        generation = sum(r["latency"]["totalMs"] - r["latency"]["ttftMs"] for r in (first, second))
        step_ms = (received - results_sent) * 1000
        rows.append(
            {
                "round_ms": (received - sent) * 1000,
                "generation_ms": generation,
                "beyond_generation_ms": (received - sent) * 1000 - generation,
                "results_step_beyond_generation_ms": step_ms
                - (second["latency"]["totalMs"] - second["latency"]["ttftMs"]),
                "results_ttft_ms": second["latency"]["ttftMs"],
                "results_prompt_tokens": second["usage"]["promptTokens"],
                "results_cached_tokens": second["usage"]["cachedTokens"],
                "first_ttft_ms": first["latency"]["ttftMs"],
            }
        )
    summary = {key: median([row[key] for row in rows]) for key in rows[0]}
    summary["mqtt_round_trip_ms"] = rtt_ms
    summary["expected_results_step_ms"] = round(rtt_ms + summary["results_ttft_ms"], 2)
    return summary


def measure_loop(
    chat: Chat, sessions: int, rounds: int, rtt_ms: float, device_ms: float, max_tokens: int, block: int
) -> dict[str, Any]:
    """``sessions`` at once, each ``rounds`` requests in a row: a forced call to the sensor (a
    worker tool), the device's answer, then the answer's generation; then the same sessions'
    plain requests for the same tokens."""
    sensor = {"type": "function", "function": {"name": "sensor_read"}}

    def run(label: str, payload: dict[str, Any]) -> tuple[float, list[dict[str, Any]]]:
        names = [chat.session(label, i) for i in range(sessions)]
        replies: list[dict[str, Any]] = []
        started = time.perf_counter()
        for r in range(rounds):
            for name in names:
                chat.send(name, {**payload, "message": f"Is anyone in the room? ({r})", "systemPrompt": SYSTEM})
            replies.extend(reply for _, reply in chat.wait(sessions).values())
        return time.perf_counter() - started, replies

    wall, replies = run("loop", {"workerTools": ["sensor_read"], "toolChoice": sensor, "maxTokens": max_tokens})
    overhead, beyond_device, coverage, covered = [], [], [], 0
    for reply in replies:
        gens = reply["rounds"]
        assert len(gens) == 2 and reply["workerCalls"][0]["outcome"] == "ok", reply
        generation_ms = sum(g["ms"] for g in gens)
        beyond = reply["latency"]["totalMs"] - reply["latency"]["queueMs"] - generation_ms
        overhead.append(beyond)
        beyond_device.append(beyond - device_ms - rtt_ms)
        before_call = gens[0]["promptTokens"] + gens[0]["completionTokens"]
        coverage.append(gens[1]["cachedTokens"] / before_call)
        covered += gens[1]["cachedTokens"] >= before_call // block * block
    tokens = [reply["usage"]["completionTokens"] for reply in replies]
    plain_wall, plain = run("plain", {"maxTokens": round(statistics.mean(tokens))})
    times = [reply["latency"]["totalMs"] for reply in replies]
    plain_times = [reply["latency"]["totalMs"] for reply in plain]

    def p95(values: list[float]) -> float:
        return round(sorted(values)[max(0, int(len(values) * 0.95 + 0.5) - 1)], 1)

    return {
        "sessions": sessions,
        "rounds_per_session": rounds,
        "device_ms": device_ms,
        "mqtt_round_trip_ms": rtt_ms,
        "overhead_per_round_beyond_generation_ms_p50": median(overhead),
        "overhead_per_round_beyond_generation_and_device_ms_p50": median(beyond_device),
        "continuation_cached_share_p50": round(median(coverage), 4),
        "continuations_covering_the_prompt_before_the_call": f"{covered} of {len(replies)}",
        "tools": {
            "tokens_per_s": round(sum(tokens) / wall, 1),
            "request_ms_p50": median(times),
            "request_ms_p95": p95(times),
        },
        "plain": {
            "tokens_per_s": round(sum(r["usage"]["completionTokens"] for r in plain) / plain_wall, 1),
            "request_ms_p50": median(plain_times),
            "request_ms_p95": p95(plain_times),
        },
    }


def measure_prefix_raw(worker_args: list[str], sessions: int, count: int = 20) -> dict[str, Any]:
    """measure_prefix's second turns, rendered by the worker's tokenizer and sent to vLLM's
    engine in this process: turn 1 (its reply as the history), then turn 2, TTFT by this clock."""
    import asyncio

    from worker.config.loader import load_config
    from worker.core.history import HistoryLimits, build_prompt
    from worker.engine.port import GenerationRequest, SamplingOptions
    from worker.engine.tokenizer import ChatTokenizer
    from worker.engine.vllm import VllmEngine
    from worker.session import SessionHistory, ToolSpec, Turn

    config, _ = load_config(worker_args, environ={})
    assert config.engine.model is not None
    tokenizer = ChatTokenizer(config.engine.model)
    limits = HistoryLimits(config.history.max_history_turns, config.history.max_history_tokens)

    async def run() -> dict[str, Any]:
        engine = await VllmEngine.start(config.engine, stop_token_ids=tokenizer.stop_token_ids, progress_bars=False)
        ids = iter(range(10**6))

        async def ttft(prompt: list[int], max_tokens: int) -> tuple[float, str]:
            sampling = SamplingOptions(max_tokens=max_tokens, temperature=0.7, top_p=0.95)
            started, first, text = time.perf_counter(), None, ""
            async for update in engine.generate(GenerationRequest(f"raw-{next(ids)}", prompt, sampling)):
                if first is None and update.completion_tokens:
                    first = time.perf_counter()
                text += update.delta
            return ((first or time.perf_counter()) - started) * 1000, text

        out: dict[str, Any] = {}
        try:
            for label, forms in (("none", []), (f"{count} tools", TWENTY_TOOLS[:count])):
                specs = [
                    ToolSpec(f["function"]["name"], f["function"].get("description"), f["function"].get("parameters"))
                    for f in forms
                ]
                times = []
                for i in range(sessions):
                    history = SessionHistory(SYSTEM + f" Session {label} {i}.", tools=specs)
                    first = build_prompt(
                        tokenizer,
                        history,
                        "Good evening. What can you do?",
                        limits=limits,
                        max_tokens=32,
                        max_model_len=engine.info.max_model_len,
                    )
                    _, reply = await ttft(first.token_ids, 32)
                    history.turns.append(Turn.plain(f"t{i}", "Good evening. What can you do?", reply))
                    second = build_prompt(
                        tokenizer,
                        history,
                        "Dim the hall lights a little, please.",
                        limits=limits,
                        max_tokens=32,
                        max_model_len=engine.info.max_model_len,
                    )
                    times.append((await ttft(second.token_ids, 32))[0])
                out[label] = {"ttft_ms_p50": median(times), "prompt_tokens": len(second.token_ids)}
        finally:
            await engine.shutdown()
        out["ratio"] = round(out[f"{count} tools"]["ttft_ms_p50"] / out["none"]["ttft_ms_p50"], 3)
        return out

    return asyncio.run(run())


def measure_parse(chat: Chat, calls: int) -> dict[str, Any]:
    import jsonschema

    choices: list[Any] = ["required", *({"type": "function", "function": {"name": n}} for n in PARAMETERS)]
    names = [chat.session("parse", i) for i in range(calls)]
    for i, name in enumerate(names):
        chat.send(name, {"message": f"Task {i}.", "tools": DEVICE_TOOLS, "toolChoice": choices[i % 3], "maxTokens": 96})
    valid = 0
    failures: list[Any] = []
    for _, reply in chat.wait(calls).values():
        try:
            (call,) = reply["toolCalls"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS[call["function"]["name"]])
            valid += 1
        except Exception as exc:
            failures.append({"reply": reply, "error": str(exc)[:200]})
    return {"calls": calls, "parsed_and_valid": valid, "share": round(valid / calls, 4), "failures": failures[:5]}


def report(results: dict[str, Any]) -> str:
    lines = [f"# Tool calling: {results['meta']['model']}", "", f"{results['meta']}", ""]
    if "prefix" in results:
        p = results["prefix"]
        lines += [
            "## Second turn TTFT, tools kept by the session vs none",
            "",
            "| | TTFT p50 ms | prompt | cached |",
        ]
        lines += ["|---|---|---|---|"]
        lines += [
            f"| {k} | {v['ttft_ms_p50']} | {v['prompt_tokens']} | {v['cached_tokens']} |"
            for k, v in p.items()
            if k != "ratio"
        ]
        lines += ["", f"tools / none: **{p['ratio']}**", ""]
    if "raw" in results:
        r = results["raw"]
        lines += ["## The same second turns straight into vLLM (no worker)", "", "| | TTFT p50 ms | prompt |"]
        lines += ["|---|---|---|"]
        lines += [f"| {k} | {v['ttft_ms_p50']} | {v['prompt_tokens']} |" for k, v in r.items() if k != "ratio"]
        lines += ["", f"tools / none, raw vLLM: **{r['ratio']}**", ""]
    if "forced" in results:
        lines += [
            "## Forced calls: decode ms per output token vs free text",
            "",
            "| batch | free text | forced call | forced / free |",
        ]
        lines += ["|---|---|---|---|"]
        for batch, row in results["forced"].items():
            free, forced = row["free text"], row["forced call"]
            lines.append(
                f"| {batch} | {free['ms_per_token_p50']} ({free['tokens_p50']} tok) | "
                f"{forced['ms_per_token_p50']} ({forced['tokens_p50']} tok) | **{row['ratio']}** |"
            )
        lines.append("")
    if "round" in results:
        lines += ["## A client tool round (medians, ms)", "", "| | ms |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in results["round"].items()]
        lines.append("")
    if "parse" in results:
        p = results["parse"]
        lines += [
            "## Forced calls that parse and validate",
            "",
            f"{p['parsed_and_valid']} of {p['calls']} ({p['share']:.2%})",
            "",
        ]
    if "loop" in results:
        loop = results["loop"]
        tools, plain = loop["tools"], loop["plain"]
        lines += [
            f"## The worker's tool loop: {loop['sessions']} sessions x {loop['rounds_per_session']} device rounds "
            f"(forced calls, a {loop['device_ms']:g} ms device)",
            "",
            "| | tokens/s | request p50 ms | request p95 ms |",
            "|---|---|---|---|",
            *(
                f"| {label} | {row['tokens_per_s']} | {row['request_ms_p50']} | {row['request_ms_p95']} |"
                for label, row in (("device round + answer", tools), ("plain, same tokens", plain))
            ),
            "",
            f"- per device round, beyond generation: {loop['overhead_per_round_beyond_generation_ms_p50']} ms p50; "
            f"beyond generation, the device ({loop['device_ms']:g} ms) and one MQTT round trip "
            f"({loop['mqtt_round_trip_ms']} ms): {loop['overhead_per_round_beyond_generation_and_device_ms_p50']} ms",
            f"- the answer's generation found {loop['continuation_cached_share_p50']:.1%} (p50) of the prompt before "
            f"the call cached; {loop['continuations_covering_the_prompt_before_the_call']} covered it to the last "
            "full block",
            "",
        ]
    return "\n".join(lines)


def through_worker(args: argparse.Namespace, worker_args: list[str], results: dict[str, Any]) -> None:
    """The phases that run through a worker process and a broker."""
    (args.out / "broker").mkdir(exist_ok=True)
    broker = start_broker(args.mosquitto, args.out / "broker")
    devices = None
    if "loop" in args.phases:
        from devtools.devices import SimulatedDevices

        devices = SimulatedDevices(port=broker.port, delay_ms=round(args.device_ms))
        devices.start()
        worker_args = [*worker_args, "--tools-mqtt", json.dumps(LOOP_TOOL)]
    worker = start_worker([*worker_args, "--stats-interval", "0"], broker.port, args.out / "worker.log")
    chat = Chat(broker.port)
    try:
        results["meta"]["start_to_ready_s"] = worker.start_to_ready_s
        rtt = median(chat.ping())
        results["mqtt_round_trip_ms_p50"] = rtt
        for phase in args.phases:
            if phase == "raw":
                continue  # after the worker has stopped: the engine needs its GPU memory
            started = time.perf_counter()
            if phase == "prefix":
                results["prefix"] = measure_prefix(chat, args.sessions, args.prefix_tools)
            elif phase == "forced":
                results["forced"] = measure_forced(chat, (1, 16), args.repeats)
            elif phase == "round":
                results["round"] = measure_round(chat, args.sessions, rtt)
            elif phase == "loop":
                results["loop"] = measure_loop(
                    chat, args.loop_sessions, args.loop_rounds, rtt, args.device_ms, args.loop_max_tokens, args.block
                )
            else:
                results["parse"] = measure_parse(chat, args.calls)
            print(f"{phase}: {time.perf_counter() - started:.0f} s", flush=True)
            (args.out / "tools.json").write_text(json.dumps(results, indent=1) + "\n")
    finally:
        chat.close()
        worker.stop(STOP_TIMEOUT)
        if devices is not None:
            devices.stop()
        broker.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--geometry", help="a devtools.tinymodel geometry, served with dummy weights")
    where.add_argument("--model", help="a model directory")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--mosquitto", default="/usr/sbin/mosquitto")
    parser.add_argument("--worker-args", default="", help="more arguments for python -m worker")
    parser.add_argument(
        "--phases", type=phase_list(PHASES), default=",".join(PHASES), help=f"comma separated, of {', '.join(PHASES)}"
    )
    parser.add_argument("--sessions", type=int, default=8, help="sessions per prefix variant, rounds")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--prefix-tools", type=int, default=20, help="tools the prefix phase's sessions keep")
    parser.add_argument("--loop-sessions", type=int, default=16, help="sessions at once in the loop phase")
    parser.add_argument("--loop-rounds", type=int, default=3, help="device rounds (requests) per session")
    parser.add_argument("--loop-max-tokens", type=int, default=64, help="maxTokens of the loop's answers")
    parser.add_argument("--device-ms", type=float, default=10.0, help="the simulated device's answer delay")
    parser.add_argument("--block", type=int, default=16, help="the engine's KV block size (prefix-cache unit)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    worker_args = shlex.split(args.worker_args)
    if args.geometry:
        from devtools.tinymodel import generate_geometry_model

        model = generate_geometry_model(REPO / ".cache" / "models" / f"{args.geometry}-tools", args.geometry)
        worker_args = ["--model", str(model), "--engine-extra", '{"load_format": "dummy"}', *worker_args]
    else:
        model = Path(args.model)
        worker_args = ["--model", str(model), *worker_args]
    import vllm

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    results: dict[str, Any] = {
        "meta": {
            "model": args.geometry or str(model),
            "vllm": vllm.__version__,
            "machine": platform.platform(),
            "commit": commit,
            "worker_args": worker_args,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
    }
    try:
        import torch

        if torch.cuda.is_available():
            results["meta"]["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    if set(args.phases) - {"raw"}:
        through_worker(args, worker_args, results)
    if "raw" in args.phases:
        started = time.perf_counter()
        results["raw"] = measure_prefix_raw(worker_args, args.sessions, args.prefix_tools)
        print(f"raw: {time.perf_counter() - started:.0f} s", flush=True)
        (args.out / "tools.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "tools.md").write_text(report(results) + "\n")
    print(report(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
