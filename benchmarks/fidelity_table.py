"""Agreement with dense and FLOP-ideal speed-up per prompt length, from `eval_suite.py` results.

Over the cases dense answers right by the benchmark's rule: how many UniPrefill answers right
too, the mean kept fraction after each drop, and the FLOP-ideal speed-up from the recorded kept
counts (`flops.flop_ideal_speedup`, every layer at its own cost); the cases lost are listed.
The drop layers are given (a result records the engine's flags, not the profile's schedule).

    python benchmarks/fidelity_table.py results/fidelity/A.json results/fidelity/B.json \\
        --model gemma3-270m --drop-layers 5,11

``--record-test-seed PROFILE`` also writes the figure into a shipped profile (its ``test_seed``
field, every other field left as it is): for results that ran on test seeds only
(``tools/seeds.py``), with the shipped profile as it is (no ``--engine-kwargs``), and the
profile's own drop layers. That figure is the profile's headline; the reporting seeds chose it.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Sequence

REPO = Path(__file__).resolve().parent.parent
# Issue #30's bar: agreement on dense-right cases, FLOP-ideal speed-up at the longest length.
AGREEMENT_BAR, SPEEDUP_BAR = 0.95, 1.5


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


def test_seed_figure(results: Dict[str, dict], rows_: List[dict],
                     drop_layers: Sequence[int]) -> dict:
    """The ``test_seed`` field a profile records for its evaluation on the test seeds:
    ``results`` maps each result file's path (as the profile names it) to its content, ``rows_``
    are their pooled rows. Raises ValueError where they are no such evaluation."""
    from uniprefill_sglang.tools.seeds import TEST_SEEDS

    metas = [r["meta"] for r in results.values()]
    for path, result in results.items():
        meta = result["meta"]
        if not meta["seeds"] or not set(meta["seeds"]) <= set(TEST_SEEDS):
            raise ValueError(f"{path}: seeds {meta['seeds']} are not all test seeds "
                             f"({TEST_SEEDS[0]}-{TEST_SEEDS[-1]})")
        if meta["engine_kwargs"] or any(c["engine"] or c["custom"] for c in result["configs"]):
            raise ValueError(f"{path}: ran with settings of its own ({meta['engine_kwargs']}), "
                             "not the shipped profile as it is")
        stages = {len(run["kept_tokens"]) - 1 for c in result["cases"]
                  for name, run in c["runs"].items() if run.get("kept_tokens")}
        if stages - {len(drop_layers)}:
            raise ValueError(f"{path}: its runs dropped {sorted(stages)} times, the profile "
                             f"{len(drop_layers)} times ({list(drop_layers)})")
    by_length = {r["length"]: r for r in rows_}
    whole, longest = by_length.pop("all"), max(by_length)
    if not whole["dense_right"]:
        raise ValueError("dense answers none of the cases right: no agreement to record")
    agreement = whole["agree"] / whole["dense_right"]
    headers = [r["header"] for r in results.values()]
    return {
        "about": "evaluated once on test seeds with this profile as shipped, after it was chosen "
                 "on the reporting (validation) seeds: its headline figure",
        "seeds": sorted({s for m in metas for s in m["seeds"]}),
        "lengths": sorted(by_length), "tasks": sorted({t for m in metas for t in m["tasks"]}),
        "depths": sorted({d for m in metas for d in m["depths"]}),
        "dense_right": whole["dense_right"], "agree": whole["agree"],
        "agreement": round(agreement, 4),
        "flop_ideal_speedup": {str(n): round(r["flop_ideal"], 3) for n, r in by_length.items()},
        "kept_per_drop": {str(n): [round(k, 4) for k in r["kept_per_drop"]]
                          for n, r in by_length.items()},
        "lost": whole["lost"],
        "meets_bar": agreement >= AGREEMENT_BAR and by_length[longest]["flop_ideal"] >= SPEEDUP_BAR,
        "results": list(results),
        "case_fingerprints": [m["case_fingerprint"] for m in metas],
        "date": max(h["date"] for h in headers),
        "commits": sorted({h["commit"] for h in headers}),
        "sglang": sorted({h["sglang"] for h in headers}),
    }


def record_test_seed(profile_path: Path, figure: dict) -> None:
    """Write ``figure`` as the profile's ``test_seed`` field; the other fields stay as written."""
    profile = json.loads(profile_path.read_text())
    profile["test_seed"] = figure
    profile_path.write_text(json.dumps(profile, indent=1) + "\n")


def _repo_path(path: str) -> str:
    p = Path(path).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="eval_suite.py JSON results (their cases pooled)")
    ap.add_argument("--model", required=True,
                    help="a model folder, or a name model_zoo prepares (its config gives the shape)")
    ap.add_argument("--drop-layers", required=True, help="the schedule's drop layers, e.g. 5,11")
    ap.add_argument("--config", default="uniprefill", help="the run's configuration name")
    ap.add_argument("--record-test-seed", metavar="PROFILE", default=None,
                    help="write the figure into this shipped profile's test_seed field (test-seed "
                         "results of the profile as shipped only)")
    args = ap.parse_args()
    from transformers import AutoConfig

    from uniprefill_sglang.flops import FlopShape
    from uniprefill_sglang.tools.model_zoo import MODELS, prepare_model

    path = prepare_model(args.model) if args.model in MODELS else args.model
    shape = FlopShape.from_config(AutoConfig.from_pretrained(path))
    results = {_repo_path(f): json.loads(Path(f).read_text()) for f in args.results}
    cases = [c for r in results.values() for c in r["cases"]]
    drop_layers = [int(x) for x in args.drop_layers.split(",") if x]
    rows_ = rows(cases, args.config, drop_layers, shape)
    print(table(rows_))
    if args.record_test_seed:
        from uniprefill_sglang.config import load_profile

        profile = load_profile(args.record_test_seed)
        if list(profile.drop_layers) != drop_layers:
            ap.error(f"--drop-layers {drop_layers} are not the profile's "
                     f"{list(profile.drop_layers)}")
        try:
            figure = test_seed_figure(results, rows_, drop_layers)
        except ValueError as e:
            ap.error(str(e))
        record_test_seed(Path(args.record_test_seed), figure)
        print(f"recorded in {args.record_test_seed}: {figure['agree']}/{figure['dense_right']} "
              f"at {figure['flop_ideal_speedup']}")


if __name__ == "__main__":
    main()
