"""Agreement against FLOP-ideal speed-up of the candidate schedules run on the reporting cases.

Reads results/fidelity/reporting_candidates.json (per model: each candidate's label, drop layers
and `eval_suite.py` results, pooled) and draws one panel per model: agreement with dense on
the cases dense answers right (all lengths) against the FLOP-ideal speed-up at the longest
length, with #30's bar (95%, 1.5x) drawn in; the shipped schedule is a star. It prints the
same figures as a markdown table, per length.

    python benchmarks/plot_fidelity_frontier.py \\
        [--out benchmarks/results/fidelity/reporting_candidates.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fidelity_table import rows

FIDELITY = Path(__file__).resolve().parent / "results" / "fidelity"
AGREEMENT_BAR, SPEEDUP_BAR = 0.95, 1.5


def candidate_rows(model: str, spec: dict) -> list[dict]:
    """Per candidate of `model` (a model_zoo name, whose config gives the FLOP shape): its label,
    whether it is shipped, and fidelity_table's per-length rows."""
    from transformers import AutoConfig

    from uniprefill_sglang.flops import FlopShape
    from uniprefill_sglang.tools.model_zoo import prepare_model

    shape = FlopShape.from_config(AutoConfig.from_pretrained(prepare_model(model)))
    out = []
    for cand in spec["candidates"]:
        cases = [c for name in cand["results"]
                 for c in json.loads((FIDELITY / name).read_text())["cases"]]
        out.append({"label": cand["label"], "shipped": cand.get("shipped", False),
                    "rows": rows(cases, "uniprefill", cand["drop_layers"], shape)})
    return out


def headline(cand: dict) -> tuple[dict, dict]:
    """A candidate's row over all lengths and its row at the longest length."""
    by_length = [r for r in cand["rows"] if r["length"] != "all"]
    return cand["rows"][-1], max(by_length, key=lambda r: r["length"])


def _k(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else f"{tokens / 1000:.1f}K"


def markdown(title: str, cands: list[dict]) -> str:
    lengths = [r["length"] for r in cands[0]["rows"] if r["length"] != "all"]
    head = " | ".join(f"{_k(n)}: agree, FLOP-ideal" for n in lengths)
    lines = [f"| {title} | {head} | all |", "|---" * (len(lengths) + 2) + "|"]
    for cand in cands:
        by_length = {r["length"]: r for r in cand["rows"]}
        cells = [f"{by_length[n]['agree']}/{by_length[n]['dense_right']}, "
                 f"{by_length[n]['flop_ideal']:.2f}x" if n in by_length else "not run"
                 for n in lengths]
        whole = by_length["all"]
        name = cand["label"] + (" (shipped)" if cand["shipped"] else "")
        lines.append(f"| {name} | {' | '.join(cells)} | {whole['agree']}/{whole['dense_right']} "
                     f"({whole['agree'] / whole['dense_right']:.0%}) |")
    return "\n".join(lines)


def plot(panels: list[tuple[str, list[dict]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5.5), squeeze=False)
    for ax, (title, cands) in zip(axes[0], panels):
        lowest = AGREEMENT_BAR
        for i, cand in enumerate(cands):
            whole, longest = headline(cand)
            x, y = longest["flop_ideal"], whole["agree"] / whole["dense_right"]
            lowest = min(lowest, y)
            ax.plot(x, y, "*" if cand["shipped"] else "o", ms=14 if cand["shipped"] else 8,
                    color=f"C{i}", label=f"{cand['label']} ({whole['agree']}/"
                                         f"{whole['dense_right']})")
        ax.axhline(AGREEMENT_BAR, color="grey", ls="--", lw=1)
        ax.axvline(SPEEDUP_BAR, color="grey", ls="--", lw=1)
        ax.set_title(f"{title}, reporting seed")
        ax.set_xlabel(f"FLOP-ideal speed-up at {_k(longest['length'])} tokens")
        ax.set_ylabel("agreement on dense-right cases")
        ax.set_ylim(lowest - 0.02, 1.005)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14))
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--candidates", default=str(FIDELITY / "reporting_candidates.json"))
    ap.add_argument("--out", default=None, help="PNG path (default: beside --candidates)")
    args = ap.parse_args()
    spec = json.loads(Path(args.candidates).read_text())
    panels = []
    for model, per_model in spec["models"].items():
        cands = candidate_rows(model, per_model)
        print(markdown(per_model["title"], cands), end="\n\n")
        panels.append((per_model["title"], cands))
    out = Path(args.out) if args.out else Path(args.candidates).with_suffix(".png")
    plot(panels, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
