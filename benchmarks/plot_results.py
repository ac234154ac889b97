"""Plots of the H200 results in benchmarks/results (run here, after the GPU runs wrote the JSON).

    python benchmarks/plot_results.py

* speedup_vs_length_h200.png: measured TTFT speedup over dense against prompt length, per
  keep-ratio schedule, with the FLOP-ideal speedup for the tokens actually kept (dashed); static
  prefill, one request. Left FlashInfer (prefill_h200_flashinfer.json, fourth session, as
  lines; prefill_h200_flashinfer_after_host_rows.json, the fifth session's 8K and 32K, as large
  markers), right Triton (prefill_h200_triton.json);
* ttft_vs_concurrency_h200.png: mean TTFT of dense SGLang and UniPrefill servers under
  sglang.bench_serving at 32K and 64K inputs, against concurrency (serving_h200_flashinfer.json,
  the second session's sweep, faint; serving_h200_after_ragged_extend*.json, the current
  extend path at concurrency 1, 4, 8 and 16, bold).
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
                        markersize=12, label=f"keep {schedule} (after host rows)")
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


def plot_serving(plt, sweep: Path, latest: list, dst: Path) -> None:
    """The second session's sweep faint, the current code's (several runs) bold on top."""
    current = [r for path in latest for r in json.loads(path.read_text())["rows"]]
    runs = [(json.loads(sweep.read_text())["rows"], 5, 0.4, "2nd session"),
            (current, 9, 1.0, "after ragged extend")]
    lengths = sorted({r["length"] for rows, *_ in runs for r in rows})
    fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 4), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        for rows, size, alpha, when in runs:
            for name, marker, color in (("dense", "s", "C0"), ("uniprefill", "o", "C1")):
                rs = sorted((r for r in rows if "error" not in r and r["server"] == name
                             and r["length"] == length), key=lambda r: r["concurrency"])
                label = "dense SGLang" if name == "dense" else "UniPrefill (keep 0.5, 0.8)"
                ax.plot([r["concurrency"] for r in rs], [r["mean_ttft_ms"] / 1e3 for r in rs],
                        marker + "-", color=color, markersize=size, alpha=alpha,
                        label=f"{label}, {when}")
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 4, 8, 16], ["1", "4", "8", "16"])
        ax.set_xlabel("concurrency")
        ax.set_ylabel("mean TTFT (s)")
        ax.set_title(f"bench_serving, {length // 1024}K-token inputs")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    plt.close(fig)


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_speedup(plt, [
        ("FlashInfer, Llama-3.1-8B shape, H200", RESULTS / "prefill_h200_flashinfer.json",
         RESULTS / "prefill_h200_flashinfer_after_host_rows.json"),
        ("Triton, Llama-3.1-8B shape, H200", RESULTS / "prefill_h200_triton.json", None),
    ], RESULTS / "speedup_vs_length_h200.png")
    plot_serving(plt, RESULTS / "serving_h200_flashinfer.json",
                 [RESULTS / "serving_h200_after_ragged_extend.json",
                  RESULTS / "serving_h200_after_ragged_extend_conc4_16.json"],
                 RESULTS / "ttft_vs_concurrency_h200.png")
    print("wrote", RESULTS / "speedup_vs_length_h200.png", RESULTS / "ttft_vs_concurrency_h200.png")


if __name__ == "__main__":
    main()
