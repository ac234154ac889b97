"""Plots of the H200 results in benchmarks/results (it only reads their JSON; no GPU needed).

    python benchmarks/plot_results.py

* prefill/speedup_vs_length_h200.png: measured TTFT speedup over dense against prompt length,
  per keep-ratio schedule, with the FLOP-ideal speedup for the tokens actually kept (dashed);
  static prefill, one request. Left FlashInfer (prefill/static_flashinfer_h200.json as lines;
  prefill/static_flashinfer_8k_32k_h200.json, the later 8K and 32K run, as stars), right Triton
  (prefill/static_triton_h200.json);
* serving/ttft_vs_concurrency_h200.png: mean TTFT of dense SGLang and UniPrefill servers under
  sglang.bench_serving at 32K and 64K inputs, against concurrency
  (serving/bench_serving_flashinfer_h200.json).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _by_schedule(path: Path) -> dict:
    by_schedule = defaultdict(list)
    for r in json.loads(path.read_text())["rows"]:
        by_schedule[r["schedule"]].append(r)
    return {k: sorted(v, key=lambda r: r["length"]) for k, v in by_schedule.items()}


def plot_speedup(plt, panels: list, dst: Path) -> None:
    """panels: (title, lines json, markers json or None)."""
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (title, lines, markers) in zip(axes[0], panels):
        extra = _by_schedule(markers) if markers else {}
        for i, (schedule, rs) in enumerate(sorted(_by_schedule(lines).items())):
            xs = [r["length"] // 1024 for r in rs]
            color = f"C{i}"
            ax.plot(xs, [r["speedup"] for r in rs], "o-", color=color,
                    label=f"keep {schedule} (measured)")
            ax.plot(xs, [r["flop_ideal"] for r in rs], "--", color=color, alpha=0.6,
                    label=f"keep {schedule} (FLOP-ideal)")
            if schedule in extra:
                ax.plot([r["length"] // 1024 for r in extra[schedule]],
                        [r["speedup"] for r in extra[schedule]], "*", color=color,
                        markersize=12, label=f"keep {schedule} (8K/32K re-run)")
        ax.set_xscale("log", base=2)
        ax.set_xticks([8, 32, 64, 128], ["8K", "32K", "64K", "128K"])
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel("TTFT speedup over dense")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    plt.close(fig)


def plot_serving(plt, sweep: Path, dst: Path) -> None:
    """One panel per input length: mean TTFT of both servers against concurrency."""
    rows = [r for run in json.loads(sweep.read_text())["runs"] for r in run["rows"]]
    lengths = sorted({r["length"] for r in rows})
    fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 4), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        for name, marker, color in (("dense", "s", "C0"), ("uniprefill", "o", "C1")):
            rs = sorted((r for r in rows if "error" not in r and r["server"] == name
                         and r["length"] == length), key=lambda r: r["concurrency"])
            label = "dense SGLang" if name == "dense" else "UniPrefill (keep 0.5, 0.8)"
            ax.plot([r["concurrency"] for r in rs], [r["mean_ttft_ms"] / 1e3 for r in rs],
                    marker + "-", color=color, markersize=8, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 4, 8, 16], ["1", "4", "8", "16"])
        ax.set_xlabel("concurrency")
        ax.set_ylabel("mean TTFT (s)")
        ax.set_title(f"bench_serving, {length // 1024}K-token inputs, H200")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    plt.close(fig)


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prefill, serving = RESULTS / "prefill", RESULTS / "serving"
    plot_speedup(plt, [
        ("FlashInfer, Llama-3.1-8B shape, H200", prefill / "static_flashinfer_h200.json",
         prefill / "static_flashinfer_8k_32k_h200.json"),
        ("Triton, Llama-3.1-8B shape, H200", prefill / "static_triton_h200.json", None),
    ], prefill / "speedup_vs_length_h200.png")
    plot_serving(plt, serving / "bench_serving_flashinfer_h200.json",
                 serving / "ttft_vs_concurrency_h200.png")
    print("wrote", prefill / "speedup_vs_length_h200.png", serving / "ttft_vs_concurrency_h200.png")

if __name__ == "__main__":
    main()
