"""The FLOP-ideal of token dropping with block-sparse attention, and where the FLOPs go.

From the kept tokens a GPU run realised (the single-request rows of one configuration of a
`benchmarks/defaults.py` result, e.g. keep 0.5,0.8, or the rows of one schedule of a
`benchmarks/bench_prefill.py` result, whose drop layers it records; several files may each give
some lengths) and the model's config: per length, the dense
prefill's FLOPs split into attention pairs (QK^T and PV) and the rest (projections, MLPs), and
the FLOP-ideal speedup (dense FLOPs over the sparse ones, `flops.py`) of dropping alone,
block-sparse attention alone and both, over a list of densities (the fraction of causal pairs
each full-attention layer attends; sliding-window layers stay dense, as served). The estimate
that picks the blocks and the kernels' efficiency are left out: an upper bound on what a run can
show, to set beside measured rows.

    python benchmarks/flop_ideal_block_sparse.py --model-path benchmarks/models/llama-3.1-8b \
        --kept-from benchmarks/results/defaults/defaults_fa3_adapter_b_h200.json --config keep \
        --out benchmarks/results/block_sparse/flop_ideal_llama31_8b.json
"""

from __future__ import annotations

import argparse
import json
import os

from result_header import result_header


def realised_kept(path: str, config: str) -> list:
    """[(kept tokens per stage, drop layers or None)] of one prompt per length in a result file:
    a defaults.py file's single-request rows of configuration `config`, or a bench_prefill.py
    file's rows of schedule `config` (with the drop layers it ran)."""
    result = json.load(open(path))
    if "drop_layers" in result:  # bench_prefill.py
        return [(r["kept"], tuple(result["drop_layers"])) for r in result["rows"]
                if r["schedule"] == config and r.get("kept")]
    row = next(r for r in result["rows"] if r["config"] == config)
    return [(single["kept_tokens"], None) for _, single in
            sorted(row["single"].items(), key=lambda kv: int(kv[0])) if single.get("kept_tokens")]


def main() -> None:
    from uniprefill_sglang.architectures import FULL_ATTENTION, lookup, scaled_reference_layers
    from uniprefill_sglang.flops import FlopShape, attended_pairs, prefill_flops

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--kept-from", required=True, action="append",
                    help="a benchmarks/defaults.py or bench_prefill.py result file (repeatable)")
    ap.add_argument("--config", default="keep",
                    help="the configuration (defaults.py) or schedule (bench_prefill.py) whose "
                         "kept tokens are used")
    ap.add_argument("--densities", default="1.0,0.3,0.2,0.1,0.05")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from transformers import AutoConfig

    # transformers' config derives the layer kinds a config.json may leave implicit (Gemma 3's
    # sliding-window pattern, Qwen3-Next's full-attention interval).
    cfg = AutoConfig.from_pretrained(args.model_path)
    shape = FlopShape.from_config(cfg)
    architecture = (cfg.architectures or ["?"])[0]
    entry = lookup(cfg.architectures or [])
    rule = entry.default_drop_layers if entry else scaled_reference_layers
    full_layers = tuple(i for i, kind in enumerate(shape.layer_kinds) if kind == FULL_ATTENTION)
    default_drops = tuple(rule(shape.num_layers, full_layers))
    realised = sorted((kept_drops for path in args.kept_from
                       for kept_drops in realised_kept(path, args.config)),
                      key=lambda kd: kd[0][0])
    densities = [float(x) for x in args.densities.split(",")]
    rows = []
    print("| tokens | attention share of dense | density | block-sparse alone | "
          f"{args.config} alone | both |")
    print("|---|---|---|---|---|---|")
    for kept, ran_drops in realised:
        drop_layers = ran_drops or default_drops
        if len(drop_layers) != len(kept) - 1:
            raise SystemExit(f"{len(kept)} kept counts for drop layers {list(drop_layers)}")
        n = kept[0]
        dense = prefill_flops([n], (), shape)
        pairs = 4.0 * shape.num_heads * shape.head_dim * attended_pairs(n) * len(full_layers)
        for density in densities:
            out = {"tokens": n, "kept_tokens": kept, "drop_layers": list(drop_layers),
                   "attention_share_dense": round(pairs / dense, 4), "density": density,
                   "block_sparse_alone": round(dense / prefill_flops([n], (), shape, density), 3),
                   "dropping_alone": round(dense / prefill_flops(kept, drop_layers, shape), 3),
                   "both": round(dense / prefill_flops(kept, drop_layers, shape, density), 3)}
            rows.append(out)
            print(f"| {n} | {out['attention_share_dense']:.2f} | {density} | "
                  f"{out['block_sparse_alone']}x | {out['dropping_alone']}x | {out['both']}x |")
    sources = ", ".join(os.path.relpath(p) for p in args.kept_from)
    note = (f"kept tokens of {args.config!r} in {sources}; drop layers as the run recorded them, "
            "else the architecture's default; attention pairs counted causally, full-attention "
            "layers")
    with open(args.out, "w") as f:
        json.dump({"header": result_header(model=architecture + " shape",
                                           note=note), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
