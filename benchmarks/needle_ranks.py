"""Where a needle's block ranks when a layer scores the prompt, under scoring variants.

A drop keeps the blocks that draw the most attention from the prompt's last queries; it keeps a
needle only if the needle's blocks rank high. For each case (tuning seeds only) one dense
pass (transformers, float32, `calibrate.DensePass`) records every layer's queries and keys; then,
per layer and per variant (how many of the last queries score; whether each head's scores are
normalised before the heads are summed), this reports for the needle's lowest-ranked block

* `rank`: the fraction of the droppable blocks (outside the sinks and the last window) that
  score above it: a keep ratio above it keeps the needle;
* `mass`: the share of the droppable blocks' score held by it and every block above it: a top-p
  at or above it keeps the needle (the sinks and the last window counted out, as the selection
  does).

    python benchmarks/needle_ranks.py --model smollm2 --layers 8,11,14,17 --lengths 7600 \\
        --seeds 0,1 --windows 128,32 --out benchmarks/results/calibration/needle_ranks_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))  # result_header
from result_header import result_header  # noqa: E402


def needle_rank(block_scores, droppable, needle_blocks: Sequence[int]) -> dict:
    """`rank` and `mass` (module docstring) of the lowest-ranked needle block among the
    droppable blocks; None for both when no needle block is droppable. Ties rank the lower
    block first, as the selection's stable sort does."""
    import torch

    index = torch.nonzero(droppable).squeeze(1).tolist()
    where = {b: i for i, b in enumerate(index)}
    needle = [where[b] for b in needle_blocks if b in where]
    if not needle:
        return {"rank": None, "mass": None}
    scores = block_scores[droppable].double()
    order = torch.sort(scores, descending=True, stable=True).indices
    place = torch.empty_like(order)
    place[order] = torch.arange(order.numel())
    worst = max(int(place[i]) for i in needle)
    mass = torch.cumsum(scores[order] / scores.sum(), 0)
    return {"rank": worst / order.numel(), "mass": float(mass[worst])}


def head_scores(q, k, sm_scale: float, window: int):
    """[heads, keys]: each query head's causal softmax summed over the last `window` of the
    recorded queries (q: [n, Hq, D], the prompt's last n; k: [m, Hkv, D]), by the selection's
    own scoring reference, one query head at a time."""
    import torch

    from uniprefill_sglang.kernels.reference import score_segment_reference

    n, hq, _ = q.shape
    m, hkv, _ = k.shape
    group = hq // hkv
    q_pos, k_pos = torch.arange(m - window, m), torch.arange(m)
    return torch.stack([
        score_segment_reference(q[n - window:, h:h + 1], q_pos, k[:, h // group:h // group + 1],
                                k_pos, sm_scale) for h in range(hq)])


def variants(per_head, droppable_tokens) -> Dict[str, object]:
    """Token scores per head reduction: `sum` over heads (the plugin's), `headnorm` (each head's
    scores over the droppable tokens normalised to one first)."""
    totals = per_head[:, droppable_tokens].sum(-1, keepdim=True).clamp_min(1e-30)
    return {"sum": per_head.sum(0), "headnorm": (per_head / totals).sum(0)}


def case_ranks(recorded_q, recorded_k, sm_scale, layers, windows, spans, n_tokens: int,
               block_size: int, sink_tokens: int) -> dict:
    """{"<layer>:q<window>:<reduction>": needle_rank(...)} for one case; the last window kept
    whole is the widest scoring window."""
    import torch

    from uniprefill_sglang.kernels.reference import block_scores_reference

    num_blocks = -(-n_tokens // block_size)
    droppable = torch.ones(num_blocks, dtype=torch.bool)
    droppable[:-(-sink_tokens // block_size)] = False
    droppable[(n_tokens - max(windows)) // block_size:] = False
    droppable_tokens = droppable.repeat_interleave(block_size)[:n_tokens]
    needle_blocks = sorted({p // block_size for occurrences in spans if occurrences
                            for p in range(*occurrences[0])})
    out = {}
    for layer in layers:
        for window in windows:
            per_head = head_scores(recorded_q[layer], recorded_k[layer], sm_scale, window)
            for name, scores in variants(per_head, droppable_tokens).items():
                out[f"{layer}:q{window}:{name}"] = needle_rank(
                    block_scores_reference(scores, block_size), droppable, needle_blocks)
    return out


def summary(cases: List[dict]) -> Dict[str, dict]:
    """Per variant over the cases dense answers right: median and worst rank and mass."""
    right = [c for c in cases if c["dense_correct"]]
    out = {}
    for key in (right[0]["ranks"] if right else {}):
        ranks = sorted(c["ranks"][key]["rank"] for c in right if c["ranks"][key]["rank"] is not None)
        masses = sorted(c["ranks"][key]["mass"] for c in right if c["ranks"][key]["mass"] is not None)
        if ranks:
            out[key] = {"cases": len(ranks), "rank_median": statistics.median(ranks),
                        "rank_worst": ranks[-1], "mass_median": statistics.median(masses),
                        "mass_worst": masses[-1]}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a model folder or a model_zoo name")
    ap.add_argument("--layers", required=True, help="scoring layers, e.g. 8,11,14,17")
    ap.add_argument("--lengths", default="7600")
    ap.add_argument("--tasks", default="niah_number,niah_multikey")
    ap.add_argument("--haystacks", default="prose,essay,manual")
    ap.add_argument("--depths", default="0.25,0.5")
    ap.add_argument("--seeds", default="0", help="tuning seeds (tasks.TUNING_SEEDS)")
    ap.add_argument("--windows", default="128,32", help="scoring windows (last N queries)")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--sink-tokens", type=int, default=128)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from uniprefill_sglang.tools.calibrate import DensePass, needle_token_spans
    from uniprefill_sglang.tools.model_zoo import MODELS, prepare_model
    from uniprefill_sglang.tools.tasks import TUNING_SEEDS, make_case

    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    seeds, layers, windows = ints(args.seeds), ints(args.layers), ints(args.windows)
    if not set(seeds) <= set(TUNING_SEEDS):
        raise SystemExit(f"--seeds: tuning seeds only (0-999), got {seeds}")
    torch.set_num_threads(1)
    path = prepare_model(args.model) if args.model in MODELS else args.model
    tokenizer = AutoTokenizer.from_pretrained(path)
    dense = DensePass(path, max(windows))
    eos = {tokenizer.eos_token_id}
    cases = []
    for seed in seeds:
        for length in ints(args.lengths):
            for task in args.tasks.split(","):
                for haystack in args.haystacks.split(","):
                    for depth in (float(d) for d in args.depths.split(",")):
                        case = make_case(tokenizer, task, length, depth, seed, haystack=haystack)
                        text = tokenizer.decode(dense.run(case.input_ids, case.max_new_tokens, eos),
                                                skip_special_tokens=True)
                        offsets = tokenizer(case.prompt, return_offsets_mapping=True)["offset_mapping"]
                        spans = needle_token_spans(case, offsets)
                        cases.append({"case": case.name, "dense_correct": case.check(text),
                                      "ranks": case_ranks(dense.queries, dense.keys,
                                                          dense.sm_scale, layers, windows, spans,
                                                          len(case.input_ids), args.block_size,
                                                          args.sink_tokens)})
                        dense.queries.clear()
                        dense.keys.clear()
                        print(case.name, cases[-1]["dense_correct"], flush=True)
    result = {**result_header(model=Path(path).name), "block_size": args.block_size,
              "sink_tokens": args.sink_tokens, "summary": summary(cases), "cases": cases}
    Path(args.out).write_text(json.dumps(result, indent=1))
    for key, row in result["summary"].items():
        print(f"{key:18s} rank median {row['rank_median']:.2f} worst {row['rank_worst']:.2f}  "
              f"mass median {row['mass_median']:.3f} worst {row['mass_worst']:.3f}")
    return result


if __name__ == "__main__":
    main()
