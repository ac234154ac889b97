"""Plot of a stage_kv_serving.py result file (it only reads the JSON; no GPU needed).

Two panels against concurrency, one line per mode (dense, shared, staged): running requests
(mean over the run's steady part, solid; maximum, dashed) and output throughput. A mode's
label carries the KV one memory-probe request held, as a fraction of dense's, when measured.

    python benchmarks/plot_stage_kv.py benchmarks/results/stage_kv/stage_kv_h200.json
    # writes benchmarks/results/stage_kv/stage_kv_h200.png (or --png PATH)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

STYLE = {"dense": ("s", "C0", "dense SGLang"),
         "shared": ("o", "C1", "UniPrefill, shared KV layout"),
         "staged": ("^", "C2", "UniPrefill, staged KV pools")}


def label(mode: str, memory: dict) -> str:
    text = STYLE.get(mode, ("o", None, mode))[2]
    row = memory.get(mode)
    if row and row.get("fraction_of_dense") is not None and mode != "dense":
        text += f" (KV of a {row['prompt_tokens'] // 1024}K request: " \
                f"{row['fraction_of_dense']:.2f}x dense)"
    return text


def plot(result: dict, dst: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setup, header = result.get("setup", {}), result.get("header", {})
    memory = {r["mode"]: r for r in result.get("memory_table", [])}
    by_mode: dict = {}
    for row in result.get("summary", []):
        by_mode.setdefault(row["mode"], []).append(row)
    concs = sorted({r["concurrency"] for rows in by_mode.values() for r in rows})
    fig, (ax_run, ax_tput) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, rows in by_mode.items():
        rows = sorted(rows, key=lambda r: r["concurrency"])
        marker, color, _ = STYLE.get(mode, ("o", None, mode))
        xs = [r["concurrency"] for r in rows]
        mean = [(x, r["mean_running"]) for x, r in zip(xs, rows) if r["mean_running"] is not None]
        ax_run.plot([x for x, _ in mean], [y for _, y in mean], marker + "-", color=color,
                    markersize=7, label=f"{mode}: mean (steady part)")
        ax_run.plot(xs, [r["max_running"] for r in rows], marker + "--", color=color,
                    markersize=5, alpha=0.6, label=f"{mode}: max")
        tput = [(x, r["output_throughput"]) for x, r in zip(xs, rows)
                if r["output_throughput"] is not None]
        ax_tput.plot([x for x, _ in tput], [y for _, y in tput], marker + "-", color=color,
                     markersize=7, label=label(mode, memory))
    ax_run.plot(concs, concs, ":", color="gray", alpha=0.5, label="= concurrency")
    for ax, ylabel in ((ax_run, "running requests"), (ax_tput, "output throughput (tok/s)")):
        if concs:
            ax.set_xscale("log", base=2)
            ax.set_xticks(concs, [str(c) for c in concs])
        ax.set_xlabel("concurrency (bench_serving --max-concurrency)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    where = header.get("device") or "?"
    length = setup.get("input_len")
    fig.suptitle(f"{length // 1024 if length else '?'}K-token prompts, {setup.get('output_len')} "
                 f"output tokens, keep {setup.get('keep_ratio')}; {where}", fontsize=10)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", help="a JSON file written by stage_kv_serving.py")
    ap.add_argument("--png", help="default: the result's path with .png")
    args = ap.parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:
        print("plot_stage_kv.py needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 1
    src = Path(args.result)
    dst = Path(args.png) if args.png else src.with_suffix(".png")
    plot(json.loads(src.read_text()), dst)
    print("wrote", dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
