"""What `--uniprefill-max-dropped-mass` would trigger on, and save, over an evaluation run.

A request whose first drop lets go more than the bound keeps every token from there on, so it
answers as dense (radix cache off). Given an `eval_suite.py` result whose UniPrefill runs record
`dropped_mass` (the share of the scored attention mass each drop let go), this replays each bound
over the cases dense answers: how many requests it turns dense, and the agreement with dense
that follows (a turned request agrees by construction, the others keep their recorded answer).

    python benchmarks/dropped_mass_bound.py results/fidelity/eval.json --config uniprefill \\
        --bounds 0.005,0.009,0.0095,0.0098
    python benchmarks/dropped_mass_bound.py REPORTING.json --tuned-on TUNING.json
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Dict, List, Optional, Sequence


def replay_bound(cases: Sequence[dict], config: str, bound: float) -> Dict[str, float]:
    """Over the cases dense answers right (by the benchmark's rule) that `config` ran: requests
    turned dense by `bound` (first drop's dropped mass above it), agreement with dense after,
    and the mean kept fraction after the first drop over the requests left sparse."""
    ran = [c for c in cases if c["dense"]["bench_correct"] and config in c["runs"]
           and c["runs"][config].get("dropped_mass")]
    turned = [c for c in ran if c["runs"][config]["dropped_mass"][0] > bound]
    agree = sum(1 for c in ran if c in turned or c["runs"][config]["bench_correct"])
    lost_turned = sum(1 for c in turned if not c["runs"][config]["bench_correct"])
    left = [c["runs"][config]["kept_tokens"] for c in ran if c not in turned]
    return {"bound": bound, "cases": len(ran), "turned_dense": len(turned),
            "losses_turned": lost_turned, "agreement": agree,
            "kept_after_first_drop": (sum(k[1] / k[0] for k in left) / len(left)) if left else 1.0}


def bound_below_losses(cases: Sequence[dict], config: str) -> Optional[float]:
    """The largest bound that turns every lost dense-right case of `cases` dense: just below
    the smallest first-drop mass among them (None when `config` lost none). Read off tuning
    seeds, it is the bound a profile may carry; replayed on reporting seeds, what it buys."""
    lost = [c["runs"][config]["dropped_mass"][0] for c in cases
            if c["dense"]["bench_correct"] and config in c["runs"]
            and c["runs"][config].get("dropped_mass") and not c["runs"][config]["bench_correct"]]
    return math.nextafter(min(lost), 0.0) if lost else None


def table(rows: List[Dict[str, float]]) -> str:
    out = ["| bound | dense-right cases | turned dense | of them lost without it | agreement "
           "| kept after the first drop (the rest) |", "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['bound']:g} | {r['cases']} | {r['turned_dense']} | "
                   f"{r['losses_turned']} | {r['agreement']}/{r['cases']} | "
                   f"{r['kept_after_first_drop']:.0%} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", help="an eval_suite.py JSON result")
    ap.add_argument("--config", default="uniprefill")
    ap.add_argument("--bounds", default="1.0,0.0095,0.009,0.005,0.0")
    ap.add_argument("--tuned-on", default=None,
                    help="an eval_suite.py result on tuning seeds: replay the bound read off it "
                         "(bound_below_losses) instead of --bounds")
    args = ap.parse_args()
    cases = json.load(open(args.result))["cases"]
    bounds = [float(b) for b in args.bounds.split(",")]
    if args.tuned_on:
        tuned = bound_below_losses(json.load(open(args.tuned_on))["cases"], args.config)
        if tuned is None:
            raise SystemExit(f"{args.tuned_on}: {args.config} lost no dense-right case, so no "
                             "bound can be read off it")
        print(f"bound read off {args.tuned_on}: {tuned!r}")
        bounds = [1.0, tuned]
    print(table([replay_bound(cases, args.config, b) for b in bounds]))


if __name__ == "__main__":
    main()
