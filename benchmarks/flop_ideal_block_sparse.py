"""The FLOP-ideal of token dropping with block-sparse attention, and where the FLOPs go.

From a defaults result file's realised kept tokens (its single-request rows of one
configuration, e.g. keep 0.5,0.8 on the GPU) and the model's config: per length, the dense
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


def main() -> None:
    from uniprefill_sglang.architectures import FULL_ATTENTION, lookup, scaled_reference_layers
    from uniprefill_sglang.flops import FlopShape, attended_pairs, prefill_flops

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--kept-from", required=True, help="a benchmarks/defaults.py result file")
    ap.add_argument("--config", default="keep", help="the row whose kept tokens are used")
    ap.add_argument("--densities", default="1.0,0.3,0.2,0.1,0.05")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cfg = json.load(open(os.path.join(args.model_path, "config.json")))
    shape = FlopShape.from_config(cfg)
    entry = lookup(cfg.get("architectures", []))
    rule = entry.default_drop_layers if entry else scaled_reference_layers
    drop_layers = tuple(rule(shape.num_layers, tuple(range(shape.num_layers))))
    row = next(r for r in json.load(open(args.kept_from))["rows"] if r["config"] == args.config)
    densities = [float(x) for x in args.densities.split(",")]
    rows = []
    print("| tokens | attention share of dense | density | block-sparse alone | "
          f"{args.config} alone | both |")
    print("|---|---|---|---|---|---|")
    for length, single in sorted(row["single"].items(), key=lambda kv: int(kv[0])):
        kept = single.get("kept_tokens")
        if not kept:
            continue
        n = kept[0]
        dense = prefill_flops([n], (), shape)
        full = sum(1 for kind in shape.layer_kinds if kind == FULL_ATTENTION)
        pairs = 4.0 * shape.num_heads * shape.head_dim * attended_pairs(n) * full
        for density in densities:
            out = {"tokens": n, "kept_tokens": kept, "drop_layers": list(drop_layers),
                   "attention_share_dense": round(pairs / dense, 4), "density": density,
                   "block_sparse_alone": round(dense / prefill_flops([n], (), shape, density), 3),
                   "dropping_alone": round(dense / prefill_flops(kept, drop_layers, shape), 3),
                   "both": round(dense / prefill_flops(kept, drop_layers, shape, density), 3)}
            rows.append(out)
            print(f"| {n} | {out['attention_share_dense']:.2f} | {density} | "
                  f"{out['block_sparse_alone']}x | {out['dropping_alone']}x | {out['both']}x |")
    note = (f"kept tokens of row {args.config!r} in {os.path.relpath(args.kept_from)}; drop layers "
            "the architecture's default; attention pairs counted causally, full-attention layers")
    with open(args.out, "w") as f:
        json.dump({"header": result_header(model=cfg.get("architectures", ["?"])[0] + " shape",
                                           note=note), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
