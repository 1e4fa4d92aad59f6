"""The full-scale capacity runs as one picture and one table: returning-turn prefix reuse and
TTFT p50 against oversubscription (1x to 10x the GPU's KV cache), the host tier off, at the
worker's default size, and at the default size with FP8 KV.

    python -m bench.plot_capacity bench/results/gpu docs/capacity-fullscale.png

Reads the capacity phases' JSON of the ``gpu-fullscale*`` profiles (each multiple ran in one
of two worker starts: 1x and 10x, then 3x and 7x) and prints the table as Markdown.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# Per series, the result files of its starts (under the results directory).
SERIES: dict[str, tuple[str, ...]] = {
    "host tier off": (
        "qwq-32b-capacity-fullscale/tier-off/capacity.json",
        "qwq-32b-capacity-fullscale-mid/tier-off/capacity.json",
    ),
    "default tier (64 GiB)": (
        "qwq-32b-capacity-fullscale/capacity_offload.json",
        "qwq-32b-capacity-fullscale-mid/capacity_offload.json",
    ),
    "default tier + FP8 KV": (
        "qwq-32b-capacity-fullscale-fp8/capacity_offload.json",
        "qwq-32b-capacity-fullscale-fp8-mid/capacity_offload.json",
    ),
}


def load_series(results: Path) -> dict[str, list[dict[str, Any]]]:
    """Per series, its runs ordered by multiple (the records left out)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for name, files in SERIES.items():
        runs = []
        for file in files:
            data = json.loads((results / file).read_text())
            for run in data["runs"].values():
                runs.append(
                    {k: v for k, v in run.items() if k != "records"} | {"kv_cache_tokens": data["kv_cache_tokens"]}
                )
        out[name] = sorted(runs, key=lambda r: r["multiple"])
    return out


def markdown(series: dict[str, list[dict[str, Any]]]) -> str:
    """One row per series and multiple; ratios against the same series' 1x."""
    lines = [
        "| host tier | N | sessions | reuse of prefix | of 1x | TTFT p50 | of 1x | TTFT p95 | of 1x | "
        "host hit / computed tokens |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in series.items():
        base = next(r for r in runs if r["multiple"] == 1)
        for run in runs:
            src = run["engine_prompt_tokens"]
            lines.append(
                f"| {name} | {run['multiple']}x | {run['sessions']} | {run['prefix_reuse']} | "
                f"{run['prefix_reuse'] / base['prefix_reuse']:.0%} | {run['ttft_p50_ms']:,.0f} ms | "
                f"{run['ttft_p50_ms'] / base['ttft_p50_ms']:.2f}x | {run['ttft_p95_ms']:,.0f} ms | "
                f"{run['ttft_p95_ms'] / base['ttft_p95_ms']:.2f}x | {src['host_hit']:,} / {src['computed']:,} |"
            )
    return "\n".join(lines)


def plot(series: dict[str, list[dict[str, Any]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (reuse_ax, ttft_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, runs in series.items():
        x = [r["multiple"] for r in runs]
        reuse_ax.plot(x, [r["prefix_reuse"] for r in runs], marker="o", label=name)
        ttft_ax.plot(x, [r["ttft_p50_ms"] for r in runs], marker="o", label=name)
    resident = next(r for r in series["default tier (64 GiB)"] if r["multiple"] == 1)
    reuse_ax.axhline(0.9 * resident["prefix_reuse"], color="grey", linestyle=":", label="90% of 1x")
    ttft_ax.axhline(1.5 * resident["ttft_p50_ms"], color="grey", linestyle=":", label="1.5x of 1x (bf16)")
    reuse_ax.set(
        xlabel="sessions / sessions the GPU's KV cache holds (bf16)",
        ylabel="returning-turn prefix reuse",
        ylim=(0.6, 1.0),
        title="Reuse of the session's cached prefix",
    )
    ttft_ax.set(
        xlabel="sessions / sessions the GPU's KV cache holds (bf16)",
        ylabel="TTFT p50 of returning turns (ms)",
        yscale="log",
        title="Time to first token, p50",
    )
    for ax in (reuse_ax, ttft_ax):
        ax.set_xticks([1, 3, 7, 10])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("QwQ-32B geometry on one H100 80GB, the worker's defaults (util 0.93), users thinking between turns")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.plot_capacity", description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="the directory holding the qwq-32b-capacity-fullscale* results")
    parser.add_argument("out", type=Path, help="the PNG to write")
    args = parser.parse_args(argv)
    series = load_series(args.results)
    plot(series, args.out)
    print(markdown(series))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
