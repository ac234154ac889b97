"""Agreement with dense and FLOP-ideal speed-up per prompt length, from `eval_suite.py` results.

Over the cases dense answers right by the benchmark's rule: how many UniPrefill answers right
too, the mean kept fraction after each drop, and the FLOP-ideal speed-up from the recorded kept
counts (`flops.flop_ideal_speedup`, every layer at its own cost); the cases lost are listed.
The drop layers are given (a result records the engine's flags, not the profile's schedule).

    python benchmarks/fidelity_table.py results/fidelity/A.json results/fidelity/B.json \\
        --model gemma3-270m --drop-layers 5,11
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from typing import Dict, List, Sequence


def rows(cases: Sequence[dict], config: str, drop_layers: Sequence[int], shape) -> List[dict]:
    """One row per prompt length (target tokens), then one over all lengths; FLOP-ideal counts
    every case UniPrefill ran, whether dense answered it right or not."""
    from uniprefill_sglang.flops import flop_ideal_speedup

    ran = [c for c in cases if config in c["runs"]]
    by_length: Dict[object, List[dict]] = defaultdict(list)
    for c in ran:
        by_length[c["target_tokens"]].append(c)
    out = []
    for length, group in [*sorted(by_length.items()), ("all", ran)]:
        right = [c for c in group if c["dense"]["bench_correct"]]
        kept = [c["runs"][config]["kept_tokens"] for c in group if c["runs"][config]["kept_tokens"]]
        stages = max((len(k) for k in kept), default=1) - 1
        out.append({
            "length": length, "dense_right": len(right),
            "agree": sum(bool(c["runs"][config]["bench_correct"]) for c in right),
            "kept_per_drop": [sum(k[min(s, len(k) - 1)] / k[0] for k in kept) / len(kept)
                              for s in range(1, stages + 1)],
            "flop_ideal": flop_ideal_speedup(kept, drop_layers, shape) if kept else 1.0,
            "lost": [c["name"] for c in right if not c["runs"][config]["bench_correct"]]})
    return out


def table(rows_: List[dict]) -> str:
    out = ["| length | dense right | UniPrefill agrees | kept after each drop | FLOP-ideal |",
           "|---|---|---|---|---|"]
    for r in rows_:
        kept = ", ".join(f"{k:.0%}" for k in r["kept_per_drop"]) or "-"
        out.append(f"| {r['length']} | {r['dense_right']} | {r['agree']}/{r['dense_right']} | "
                   f"{kept} | {r['flop_ideal']:.2f}x |")
    lost = [name for r in rows_ if r["length"] == "all" for name in r["lost"]]
    return "\n".join(out + ([f"\nlost: {', '.join(lost)}"] if lost else []))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="eval_suite.py JSON results (their cases pooled)")
    ap.add_argument("--model", required=True,
                    help="a model folder, or a name model_zoo prepares (its config gives the shape)")
    ap.add_argument("--drop-layers", required=True, help="the schedule's drop layers, e.g. 5,11")
    ap.add_argument("--config", default="uniprefill", help="the run's configuration name")
    args = ap.parse_args()
    from transformers import AutoConfig

    from uniprefill_sglang.flops import FlopShape
    from uniprefill_sglang.tools.model_zoo import MODELS, prepare_model

    path = prepare_model(args.model) if args.model in MODELS else args.model
    shape = FlopShape.from_config(AutoConfig.from_pretrained(path))
    cases = [c for f in args.results for c in json.load(open(f))["cases"]]
    drop_layers = [int(x) for x in args.drop_layers.split(",") if x]
    print(table(rows(cases, args.config, drop_layers, shape)))


if __name__ == "__main__":
    main()
