"""Plot a bench_prepacking.py result: TTFT and peak memory against batch size, one line per method.

    python benchmarks/plot_prepacking.py benchmarks/results/prepacking/<result>.json [--out x.png]
    python benchmarks/plot_prepacking.py <result>.json --tables   # the README's tables too

Reads the JSON only. Left: mean TTFT per batch (the paper's definition; SGLang: the generate
call) over the sweep profile's pool, plus the single-batch points of the OOM search. Right: peak
GPU memory per batch (``max_memory_allocated``, weights included); SGLang's line is the memory it
preallocates (weights + KV pool), flat because batches wait for room instead of failing. A cross
marks the first batch size that ran out of memory.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

LABELS = {
    "hf_padded": "HF, padded",
    "hf_lenorder": "HF, length-ordered",
    "hf_packed": "HF, Prepacking",
    "sglang_dense": "SGLang ragged",
    "sglang_uniprefill": "SGLang + UniPrefill",
}


def series(res: dict, profile: str, method: str, metric: str):
    """(batch sizes, seconds, peak MiB, first OOM batch size or None) for one method."""
    prof = res["profiles"][profile]
    pts = {}
    oom = []
    if method.startswith("hf_"):
        for src in (prof["hf"].get(f"{method}/{metric}", {}),
                    prof.get("oom_search", {}).get(f"{method}/{metric}", {})):
            for b, e in src.items():
                if e.get("oom"):
                    oom.append(int(b))
                elif "mean_s_per_batch" in e:
                    pts[int(b)] = (e["mean_s_per_batch"], e["peak_mib"])
                else:
                    pts[int(b)] = (e["s"], e["peak_mib"])
    else:
        for b, e in prof["sglang"].get(method, {}).items():
            pts[int(b)] = (e["mean_s_per_batch"], None)
    xs = sorted(pts)
    return xs, [pts[x][0] for x in xs], [pts[x][1] for x in xs], (min(oom) if oom else None)


def plot(res: dict, out: Path, profile: str | None = None, metric: str = "ttft") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profile = profile or res["settings"]["sweep_profile"]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    sg_mem = None
    usage = (res.get("sglang") or {}).get("memory_usage") or {}
    if usage.get("weight") is not None and usage.get("kvcache") is not None:
        sg_mem = (float(usage["weight"]) + float(usage["kvcache"])) * 1024  # GB -> MiB as SGLang
    for method, label in LABELS.items():
        if method not in res["settings"]["methods"]:
            continue
        xs, ts, mems, oom = series(res, profile, method, metric)
        if not xs:
            continue
        (line,) = ax_t.plot(xs, [t * 1e3 for t in ts], marker="o", label=label)
        if method.startswith("hf_") and all(m is not None for m in mems):
            ax_m.plot(xs, [m / 1024 for m in mems], marker="o", color=line.get_color(),
                      label=label)
            if oom is not None:
                ax_m.plot([oom], [res.get("device_memory_gib") or 140], marker="x",
                          markersize=10, color=line.get_color(), linestyle="none")
        elif sg_mem is not None and method == "sglang_dense":
            ax_m.axhline(sg_mem / 1024, color=line.get_color(), linestyle="--",
                         label="SGLang: weights + KV pool (preallocated)")
    for ax in (ax_t, ax_m):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size (prompts)")
        ax.grid(alpha=0.3)
    ax_t.set_yscale("log")
    ax_t.set_ylabel(f"{metric.upper()} per batch (ms)")
    ax_m.set_ylabel("peak GPU memory (GiB, weights included)")
    ax_t.legend(fontsize=8)
    ax_m.legend(fontsize=8)
    model = res["header"].get("model") or res["model_path"]
    fig.suptitle(f"{model}, '{profile}' prompts, {res['device_name']} "
                 f"(x: first batch size out of memory)", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    return out


def tables(res: dict) -> str:
    """Markdown: per profile at the main batch size, each method's prefill and TTFT per batch (ms)
    and peak memory (MiB); then the largest batch before OOM where it was searched."""
    bsz = str(res["settings"]["batch_size"])
    methods = res["settings"]["methods"]
    lines = [f"batch size {bsz}, pool {res['settings']['pool']}: mean ms per batch; peak MiB "
             f"(weights included); speed-up against HF padded",
             "| profile | tokens padded/real, packed/real | method | prefill ms | TTFT ms "
             "| TTFT vs padded | peak MiB, prefill / TTFT |", "|---|---|---|---|---|---|---|"]
    for name, prof in res["profiles"].items():
        lo = prof["layout"][bsz]
        shape = (f"{lo['random']['padded_over_real']:.2f} (length-ordered "
                 f"{lo['length_ordered']['padded_over_real']:.2f}), "
                 f"{lo['random']['packed_over_real']:.2f}")
        base = prof["hf"].get("hf_padded/ttft", {}).get(bsz, {}).get("mean_s_per_batch")
        for i, m in enumerate(methods):
            if m.startswith("hf_"):
                pre = prof["hf"].get(f"{m}/prefill", {}).get(bsz, {})
                tt = prof["hf"].get(f"{m}/ttft", {}).get(bsz, {})
            else:
                pre, tt = {}, prof["sglang"].get(m, {}).get(bsz, {})

            def ms(e):
                if e.get("oom"):
                    return "OOM"
                return f"{e['mean_s_per_batch'] * 1e3:.1f}" if e else "-"

            speed = (f"{base / tt['mean_s_per_batch']:.2f}x"
                     if base and tt.get("mean_s_per_batch") else "-")
            mem = " / ".join(f"{e['peak_mib']:.0f}" if e.get("peak_mib") else "-"
                             for e in (pre, tt))
            lines.append(f"| {name if i == 0 else ''} | {shape if i == 0 else ''} | "
                         f"{LABELS[m]} | {ms(pre)} | {ms(tt)} | {speed} | {mem} |")
    for name, prof in res["profiles"].items():
        lb = prof.get("largest_batch")
        if not lb:
            continue
        lines += ["", f"largest batch before OOM, '{name}' prompts (doubling from 16)",
                  "| method | metric | largest batch that ran | first batch out of memory |",
                  "|---|---|---|---|"]
        for key, v in lb.items():
            m, metric = key.split("/")
            lines.append(f"| {LABELS[m]} | {metric} | {v['largest_fitting']} | "
                         f"{v['first_oom'] or 'none up to the cap'} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result")
    ap.add_argument("--profile", default=None, help="default: the run's sweep profile")
    ap.add_argument("--metric", default="ttft", choices=["ttft", "prefill"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--tables", action="store_true", help="print the markdown tables too")
    args = ap.parse_args()
    res = json.loads(Path(args.result).read_text())
    if args.tables:
        print(tables(res))
    out = Path(args.out or Path(args.result).with_suffix(f".{args.metric}.png"))
    print(plot(res, out, args.profile, args.metric))


if __name__ == "__main__":
    main()
