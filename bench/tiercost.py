"""What the host-memory KV tier costs a burst: raw AsyncLLM alone (no worker, no MQTT), the
burst phases' prompts and sampling (bench/burst.py), one engine after the other in this
process, each with its own tier setting.

    python -m bench.tiercost MODEL [--profile gpu-goal] [--sizes 320 1000] [--repeats 2]
        [--variant NAME=JSON ...]

A variant is EngineConfig fields over the profile's burst settings, as JSON, plus optional
``"env"`` (variables set before its engine starts) and ``"connector"`` (entries for vLLM's
``kv_connector_extra_config``, e.g. ``{"block_size": 256}``: the tier's transfer unit in
tokens, where the vLLM release has it). Without --variant: ``off`` (kv_offload_gib 0) and
``on`` (the worker's default size). Each engine runs a warm-up burst, then ``--repeats`` bursts
of each size; printed and written to --out as JSON: tok/s, TTFT p50/p95 of each burst, and the
connector vLLM ended up with (so that a setting the release ignored shows).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from .burst import burst_settings, burst_summary, model_burst_workload, raw_burst, render_burst
from .profiles import PROFILES

DEFAULT_VARIANTS = {"off": {"kv_offload_gib": 0}, "on": {}}


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    name, sep, body = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"--variant: NAME=JSON, not {text!r}")
    value = json.loads(body)
    if not isinstance(value, dict):
        raise SystemExit(f"--variant {name}: a JSON object, not {body!r}")
    return name, value


async def run_variant(
    model: Path,
    settings: dict[str, Any],
    variant: dict[str, Any],
    prompts: dict[tuple[int, int], list[list[int]]],
    **run: Any,
) -> dict[str, Any]:
    from worker.config.models import EngineConfig

    from .inprocess import InProcess

    variant = dict(variant)
    os.environ.update({k: str(v) for k, v in variant.pop("env", {}).items()})
    connector = variant.pop("connector", None)
    merged = {**settings, **variant, "extra": {**settings.get("extra", {}), **variant.get("extra", {})}}
    if connector:
        from vllm.config import KVTransferConfig

        # Named as vLLM names its own tier's (its size still from kv_offload_gib).
        merged["extra"]["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=dict(connector)
        )
    engine = InProcess(EngineConfig(model=str(model), **merged), run["tokenizer"])
    transfer = engine.llm.vllm_config.kv_transfer_config
    out: dict[str, Any] = {
        "start_s": engine.start_s,
        "connector": None
        if transfer is None
        else {
            "name": transfer.kv_connector,
            "extra": {k: str(v) for k, v in transfer.kv_connector_extra_config.items()},
        },
        "bursts": {},
    }
    print(f"  engine up in {engine.start_s} s; connector {out['connector']}", flush=True)
    try:
        await raw_burst(engine.llm, prompts[(0, 0)], run["max_tokens"])  # warm-up
        for size in run["sizes"]:
            out["bursts"][size] = []
            for repeat in range(run["repeats"]):
                outcomes, wall = await raw_burst(engine.llm, prompts[(size, repeat)], run["max_tokens"])
                summary = {k: v for k, v in burst_summary(outcomes, wall).items() if not k.startswith("transit")}
                out["bursts"][size].append(summary)
                print(
                    f"  {size}: {summary['tok_per_s']:,.0f} tok/s, TTFT p50 {summary['ttft_p50_ms']} ms, "
                    f"p95 {summary['ttft_p95_ms']} ms, wall {summary['wall_s']} s",
                    flush=True,
                )
                time.sleep(1.0)
    finally:
        engine.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--profile", default="gpu-goal", choices=sorted(PROFILES))
    parser.add_argument("--sizes", type=int, nargs="+", default=[320, 1000])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--variant", action="append", default=[], help="NAME=JSON (repeatable)")
    parser.add_argument("--out", type=Path, default=Path("tiercost.json"))
    args = parser.parse_args()
    from worker.engine.tokenizer import ChatTokenizer

    profile = PROFILES[args.profile]
    variants = dict(parse_variant(v) for v in args.variant) or DEFAULT_VARIANTS
    settings = burst_settings(profile, profile.burst_limits["new"])
    settings.pop("kv_offload_gib", None)  # each variant says its own
    tokenizer = ChatTokenizer(str(args.model))
    workload = model_burst_workload(profile, tokenizer)
    # Prompts of their own for every burst (seeded by size and repeat), the same for every
    # variant: no burst finds another's in the prefix cache or in the tier.
    prompts = {
        (size, repeat): render_burst(tokenizer, workload, size * 100 + repeat, size)
        for size in args.sizes
        for repeat in range(args.repeats)
    }
    prompts[(0, 0)] = render_burst(tokenizer, workload, 0, profile.burst_first)
    results: dict[str, Any] = {"profile": args.profile, "settings": {k: str(v) for k, v in settings.items()}}
    for name, variant in variants.items():
        print(f"variant {name}: {variant}", flush=True)
        results[name] = asyncio.run(
            run_variant(
                args.model,
                settings,
                variant,
                prompts,
                tokenizer=tokenizer,
                sizes=args.sizes,
                repeats=args.repeats,
                max_tokens=profile.burst_max_tokens,
            )
        )
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
