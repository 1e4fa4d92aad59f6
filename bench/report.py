"""From the phase JSONs of one run: results.json (the numbers), results.md (tables) and plots."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

from .common import load, percentile, save

HBM_TB_S = {"H200": 4.8, "H100": 3.35}


def weight_bytes(geometry: dict[str, Any]) -> float | None:
    """bf16 bytes of a Qwen2 geometry's weights: what one decode step must read."""
    try:
        h, layers, inter, vocab = (
            geometry[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")
        )
        kv = geometry["num_key_value_heads"] * (h // geometry["num_attention_heads"])
    except (KeyError, TypeError):
        return None
    per_layer = h * h * 2 + 2 * h * kv + h + 2 * kv + 3 * h * inter + 2 * h  # q,o + k,v + biases + mlp + norms
    params = layers * per_layer + vocab * h * (1 if geometry.get("tie_word_embeddings") else 2) + h
    return 2.0 * params


def _by_turn(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(records, key=lambda r: r["turn"])


def _reuse(records: list[dict[str, Any]], block: int) -> list[float | None]:
    """cachedTokens / the previous turn's prompt rounded down to the block size, per turn >= 2."""
    out: list[float | None] = [None]
    for previous, current in itertools.pairwise(records):
        reusable = previous["prompt_tokens"] // block * block
        out.append(round(current["cached_tokens"] / reusable, 3) if reusable else None)
    return out


def summarize_run(out: Path) -> dict[str, Any]:
    meta = load(out / "meta.json")
    worker = load(out / "worker.json") if (out / "worker.json").exists() else {}
    inproc = load(out / "inprocess.json") if (out / "inprocess.json").exists() else {}
    block = inproc.get("block_size") or meta["engine_args"].get("block_size") or 16
    result: dict[str, Any] = {"meta": meta}
    result["phase_commits"] = {
        p.stem: load(p)["commit"]
        for p in sorted(out.glob("*.json"))
        if p.stem not in ("meta", "results") and "commit" in load(p)
    }
    if worker:
        turns = _by_turn(worker["multi_turn"])
        lat = [r["client_ms"] for r in turns]
        result["multi_turn"] = {
            "worker_ms": lat,
            "worker_ratio_to_turn1": [round(x / lat[0], 2) for x in lat],
            "worker_last_over_turn2": round(lat[-1] / lat[1], 2) if len(lat) > 2 else None,
            "worker_reuse": _reuse(turns, block),
            "worker_prompt_tokens": [r["prompt_tokens"] for r in turns],
        }
        everything = [r for runs in worker["concurrency"].values() for r in runs["records"]]
        hop = [r["client_ms"] - r["worker_total_ms"] for r in everything]
        result["mqtt_hop_ms"] = {
            "ping_p50": round(percentile(worker["ping_ms"], 50), 3),
            "ping_p99": round(percentile(worker["ping_ms"], 99), 3),
            "client_minus_worker_p50": round(percentile(hop, 50), 3),
            "client_minus_worker_p99": round(percentile(hop, 99), 3),
        }
        for c, run in worker["concurrency"].items():  # the hop grows with the clients' traffic
            hop_c = [r["client_ms"] - r["worker_total_ms"] for r in run["records"]]
            result["mqtt_hop_ms"][f"c{c}_p50"] = round(percentile(hop_c, 50), 3)
            result["mqtt_hop_ms"][f"c{c}_p99"] = round(percentile(hop_c, 99), 3)
        result["decode_batch1"] = {"worker_tok_per_s": worker["decode_batch1"]["decode_tok_per_s"]}
        result["start_to_ready_s"] = worker["start_to_ready_s"]
        result["rss_mb_max"] = max((r["total_rss_mb"] for r in worker["rss"]), default=None)
        result["worker_rss_mb_max"] = max((r["worker_rss_mb"] for r in worker["rss"]), default=None)
        result["kv_cache_usage_max"] = worker["kv_cache_usage_max"]
        stats = worker.get("worker_stats") or {}
        result["prefix_cache_hit_rate_total"] = stats.get("prefixCacheHitRateTotal")
    if inproc:
        before = _by_turn(inproc["before"])
        lat = [r["client_ms"] for r in before]
        result.setdefault("multi_turn", {}).update(
            {
                "before_ms": lat,
                "before_ratio_to_turn1": [round(x / lat[0], 2) for x in lat],
                "before_prompt_tokens": [r["prompt_tokens"] for r in before],
            }
        )
        result.setdefault("decode_batch1", {})["raw_tok_per_s"] = inproc["decode_batch1"][
            "decode_tok_per_s_per_request"
        ]
    result["concurrency"] = _concurrency_table(worker, inproc)
    result["think_s"] = worker.get("think_s", 0.0)
    first = result["concurrency"][0] if result["concurrency"] else {}
    if first.get("sessions") == 1 and "worker" in first and "one_at_a_time" in first:
        # The one-at-a-time baseline is the same worker: at one session the two must agree.
        ratio = first["one_at_a_time"]["p50_ms"] / first["worker"]["p50_ms"]
        result["baseline_check"] = {
            "one_at_a_time_over_worker_at_c1": round(ratio, 3),
            "within_10_percent": abs(ratio - 1) <= 0.1,
        }
    decode = result.get("decode_batch1", {})
    if "worker_tok_per_s" in decode and "raw_tok_per_s" in decode:
        decode["worker_over_raw"] = _ratio(decode["worker_tok_per_s"], decode["raw_tok_per_s"])
    gpu = next((name for name in HBM_TB_S if name in meta.get("gpu", "")), None)
    weights = weight_bytes(meta.get("geometry", {}))
    if gpu and weights:
        roofline = HBM_TB_S[gpu] * 1e12 / weights
        decode["hbm_roofline_tok_per_s"] = round(roofline, 1)
        for key in ("worker_tok_per_s", "raw_tok_per_s"):
            if key in decode:
                decode[key.replace("tok_per_s", "of_roofline")] = round(decode[key] / roofline, 3)
    structured_path = out / "structured.json"
    if structured_path.exists():
        result["structured"] = _structured(load(structured_path))
    elif worker.get("structured"):  # runs before the structured phase existed
        result["structured"] = _structured(worker["structured"])
    if (out / "restart.json").exists():
        result["restart"] = load(out / "restart.json")
    ablation = {p.stem.removeprefix("ablation-"): load(p) for p in sorted(out.glob("ablation-*.json"))}
    if ablation:
        result["ablation"] = ablation
    return result


def _structured(runs: dict[str, Any]) -> dict[str, Any]:
    ok = {name: run["summary"] for name, run in runs.items() if "summary" in run}
    steady = [name for name in ok if name != "first_use"]
    keys = ("tokens_per_s", "p50_ms", "completion_tokens")
    out: dict[str, Any] = {f"{name}_{key}": ok[name][key] for name in steady for key in keys}
    # Per-request time per generated token (worker's clock, first token to reply): unlike
    # tokens/s it does not depend on how long the replies run.
    for name in steady:
        out[f"{name}_ms_per_token_p50"] = _ms_per_token(runs[name]["records"])
    plain_token_ms = [out[f"{n}_ms_per_token_p50"] for n in ("plain", "plain_again") if n in ok]
    if plain_token_ms and "json_schema" in ok and all(plain_token_ms):
        out["schema_over_plain_ms_per_token"] = _ratio(
            out["json_schema_ms_per_token_p50"], sum(plain_token_ms) / len(plain_token_ms)
        )
    plain = [ok[name]["tokens_per_s"] for name in ("plain", "plain_again") if name in ok]
    if plain and "json_schema" in ok:
        out["schema_over_plain_throughput"] = _ratio(ok["json_schema"]["tokens_per_s"], sum(plain) / len(plain))
    if "first_use" in ok:  # includes compiling the schema into a grammar
        out["json_schema_first_request_ms"] = ok["first_use"]["p50_ms"]
    errors = {name: run["error"] for name, run in runs.items() if "error" in run}
    if errors:
        out["errors"] = errors
    return out


def _ms_per_token(records: list[dict[str, Any]]) -> float | None:
    per_token = [
        (r["worker_total_ms"] - r["worker_ttft_ms"]) / (r["completion_tokens"] - 1)
        for r in records
        if r.get("worker_total_ms") and r.get("worker_ttft_ms") is not None and r["completion_tokens"] > 1
    ]
    return round(percentile(per_token, 50), 3) if per_token else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def _concurrency_table(worker: dict[str, Any], inproc: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    sources = (worker.get("concurrency", {}), inproc.get("ceiling", {}), worker.get("one_at_a_time", {}))
    counts = sorted({int(c) for source in sources for c in source})
    for count in counts:
        row: dict[str, Any] = {"sessions": count}
        for name, source in (
            ("worker", worker.get("concurrency", {})),
            ("ceiling", inproc.get("ceiling", {})),
            ("one_at_a_time", worker.get("one_at_a_time", {})),
        ):
            summary = source.get(str(count), source.get(count, {})).get("summary")  # type: ignore[call-overload]
            if summary:
                keys = ("p50_ms", "p95_ms", "tokens_per_s", "requests", "p50_ttft_later_turns_ms")
                row[name] = {k: summary.get(k) for k in keys}
        if "worker" in row and "ceiling" in row:
            row["worker_over_ceiling"] = _ratio(row["worker"]["tokens_per_s"], row["ceiling"]["tokens_per_s"])
        if "worker" in row and "one_at_a_time" in row:
            row["worker_over_one_at_a_time"] = _ratio(
                row["worker"]["tokens_per_s"], row["one_at_a_time"]["tokens_per_s"]
            )
        rows.append(row)
    return rows


def _fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:,.1f}" if isinstance(value, float) else str(value)


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    lines = [
        f"# Benchmark: {meta.get('profile')} profile",
        "",
        f"GPU: {meta['gpu']} · vLLM {meta['vllm']} · commit `{meta['git_commit']}` · {meta['time']}",
        "",
        f"Model geometry: {meta['geometry']} · engine: {meta['engine_args']}",
        "",
    ]
    if result.get("phase_commits"):
        phases = ", ".join(f"{name} `{commit[:7]}`" for name, commit in result["phase_commits"].items())
        lines += [f"Commit per phase: {phases}", ""]
    turns = result.get("multi_turn", {})
    if turns:
        lines += [
            "## Multi-turn growth (1 session)",
            "",
            "| turn | worker ms | worker / turn 1 | cache reuse | before ms | before / turn 1 |",
            "|---|---|---|---|---|---|",
        ]
        for i in range(max(len(turns.get("worker_ms", [])), len(turns.get("before_ms", [])))):

            def at(key: str, i: int = i) -> Any:
                values = turns.get(key, [])
                return values[i] if i < len(values) else None

            lines.append(
                f"| {i + 1} | {_fmt(at('worker_ms'))} | {_fmt(at('worker_ratio_to_turn1'))} | "
                f"{_fmt(at('worker_reuse'))} | {_fmt(at('before_ms'))} | {_fmt(at('before_ratio_to_turn1'))} |"
            )
        last = len(turns.get("worker_ms", []))
        lines += ["", f"Worker turn {last} / turn 2: {_fmt(turns.get('worker_last_over_turn2'))}", ""]
    if result.get("concurrency"):
        lines += [
            "## Concurrency (3 turns per session"
            + (f"; users think {result['think_s']:g} s on average between turns)" if result.get("think_s") else ")"),
            "",
            "| sessions | worker p50 / p95 ms | worker tok/s | ceiling p50 / p95 ms | ceiling tok/s | worker / ceiling"
            " | TTFT p50 of turns 2+, worker / ceiling ms"
            " | one-at-a-time p50 / p95 ms | one-at-a-time tok/s | worker / one-at-a-time |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in result["concurrency"]:
            cells = [str(row["sessions"])]
            for name in ("worker", "ceiling"):
                part = row.get(name, {})
                cells += [f"{_fmt(part.get('p50_ms'))} / {_fmt(part.get('p95_ms'))}", _fmt(part.get("tokens_per_s"))]
            cells.append(_fmt(row.get("worker_over_ceiling")))
            later = [row.get(name, {}).get("p50_ttft_later_turns_ms") for name in ("worker", "ceiling")]
            cells.append(f"{_fmt(later[0])} / {_fmt(later[1])}")
            part = row.get("one_at_a_time", {})
            cells += [
                f"{_fmt(part.get('p50_ms'))} / {_fmt(part.get('p95_ms'))}" if part else "–",
                _fmt(part.get("tokens_per_s")),
                _fmt(row.get("worker_over_one_at_a_time")),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    for title, key in (
        ("MQTT hop (ms)", "mqtt_hop_ms"),
        ("Batch-1 decode", "decode_batch1"),
        ("Structured output", "structured"),
        ("Restart", "restart"),
    ):
        if result.get(key):
            lines += [f"## {title}", "", "| | |", "|---|---|"]
            lines += [f"| {k} | {_fmt(v) if not isinstance(v, dict) else v} |" for k, v in result[key].items()]
            lines.append("")
    extras = {
        k: result.get(k)
        for k in (
            "start_to_ready_s",
            "rss_mb_max",
            "worker_rss_mb_max",
            "kv_cache_usage_max",
            "prefix_cache_hit_rate_total",
        )
    }
    extras |= result.get("baseline_check", {})
    lines += ["## Worker", "", "| | |", "|---|---|", *[f"| {k} | {_fmt(v)} |" for k, v in extras.items()], ""]
    if result.get("ablation"):
        lines += [
            "## Engine settings (in-process)",
            "",
            "| setting | engine start s | batch-1 decode tok/s | batch-64 aggregate tok/s |",
            "|---|---|---|---|",
        ]
        for name, data in result["ablation"].items():
            if "error" in data:
                lines.append(f"| {name} `{data['settings']}` | failed: {data['error'][:120]} | | |")
                continue
            lines.append(
                f"| {name} `{data['settings']}` | {_fmt(data['engine_start_s'])} | "
                f"{_fmt(data['batch1']['decode_tok_per_s_per_request'])} | "
                f"{_fmt(data['batch64']['aggregate_tok_per_s'])} |"
            )
        lines.append("")
    return "\n".join(lines)


def plots(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = result.get("multi_turn", {})
    if turns:
        fig, ax = plt.subplots(figsize=(6, 4))
        for key, label in (("worker_ms", "worker (defaults)"), ("before_ms", "before (no reuse, maxTokens 512)")):
            if turns.get(key):
                ax.plot(range(1, len(turns[key]) + 1), [v / 1000 for v in turns[key]], marker="o", label=label)
        ax.set(xlabel="turn", ylabel="latency (s)", title="Latency per turn, one session")
        ax.set_ylim(bottom=0)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "latency_per_turn.png", dpi=120)
        plt.close(fig)
    rows = result.get("concurrency", [])
    if rows:
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        for name in ("worker", "ceiling", "one_at_a_time"):
            points = [(r["sessions"], r[name]) for r in rows if name in r]
            if points:
                xs = [p[0] for p in points]
                left.plot(xs, [p[1]["p50_ms"] / 1000 for p in points], marker="o", label=name.replace("_", "-"))
                right.plot(xs, [p[1]["tokens_per_s"] for p in points], marker="o", label=name.replace("_", "-"))
        left.set(xlabel="sessions at once", ylabel="p50 latency (s)", title="Latency per concurrency")
        right.set(xlabel="sessions at once", ylabel="generated tokens/s", title="Throughput per concurrency")
        for ax in (left, right):
            ax.set_xscale("log")
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / "concurrency.png", dpi=120)
        plt.close(fig)


def write_report(out: Path) -> dict[str, Any]:
    result = summarize_run(out)
    save(out / "results.json", result)
    (out / "results.md").write_text(markdown(result))
    plots(result, out)
    print((out / "results.md").read_text())
    return result


if __name__ == "__main__":
    import sys

    write_report(Path(sys.argv[1]))
