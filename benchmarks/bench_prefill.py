"""Static prefill latency: dense SGLang vs UniPrefill, side by side in one engine.

One `sglang.Engine` with `--enable-uniprefill` serves every measurement; the dense baseline is
the same engine with UniPrefill switched off per request (`custom_params={"uniprefill": False}`),
so weights, kernels, memory pool and process are identical. Each measurement is one request of
`length` random token ids (distinct per request, radix cache off) with `max_new_tokens=1`, so
its latency is the prefill (time to first token) plus one sampling step.

Random (`--load-format dummy`) weights give near-uniform attention, where top-p keeps almost
every block, so speed is measured with fixed keep-ratio schedules (one ratio per drop layer).
Beside each measured speedup the script prints the FLOP-ideal speedup for the tokens actually
kept (from the per-stage kept counts the request reports).

    python benchmarks/bench_prefill.py --model-path /path/llama31-8b-config \\
        --lengths 8192,32768,65536,131072 --schedules 0.3 0.5 0.7 0.9 0.5,0.8 --out results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def layer_flops(n_tokens: int, cfg: dict) -> float:
    """FLOPs of one decoder layer on n tokens of one request (causal attention over them).

    Linear layers: 2 * params * n. Attention: QK^T and PV over a causal n x n triangle,
    2 * 2 * Hq * D * n^2 / 2.
    """
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hq = cfg["num_attention_heads"]
    hkv = cfg.get("num_key_value_heads", hq)
    d = cfg.get("head_dim") or h // hq
    params = h * (hq * d + 2 * hkv * d) + hq * d * h + 3 * h * inter
    return 2.0 * params * n_tokens + 2.0 * hq * d * n_tokens * n_tokens


def flop_ideal_speedup(kept: list, drop_layers: list, cfg: dict) -> float:
    """Dense FLOPs / UniPrefill FLOPs, layer by layer with the tokens each stage holds."""
    n_layers = cfg["num_hidden_layers"]
    dense = n_layers * layer_flops(kept[0], cfg)
    sparse, stage = 0.0, 0
    for layer in range(n_layers):
        sparse += layer_flops(kept[stage], cfg)
        if stage < len(drop_layers) and layer == drop_layers[stage]:
            stage += 1
    return dense / sparse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--lengths", default="8192,32768,65536,131072")
    ap.add_argument("--schedules", nargs="+", default=["0.3", "0.5", "0.7", "0.9", "0.5,0.8"],
                    help="keep-ratio schedules, one ratio per drop (the last repeats)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--attention-backend", default="flashinfer")
    ap.add_argument("--chunked-prefill-size", type=int, default=-1,
                    help="-1: one prefill step per prompt (static latency)")
    ap.add_argument("--drop-layers", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import os

    # A 131072-token prompt plus its output exceeds Llama-3.1's 131072 positions by a few.
    os.environ.setdefault("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "1")
    import sglang

    lengths = [int(x) for x in args.lengths.split(",")]
    cfg = json.load(open(f"{args.model_path}/config.json"))
    engine_kwargs = dict(
        model_path=args.model_path, load_format="dummy", enable_uniprefill=True,
        attention_backend=args.attention_backend, disable_radix_cache=True,
        chunked_prefill_size=args.chunked_prefill_size, context_length=max(lengths) + 64,
        max_prefill_tokens=max(lengths) + 64, mem_fraction_static=0.8,
        cuda_graph_backend_prefill="disabled", log_level="error", random_seed=0,
        skip_tokenizer_init=True,  # token ids in, token ids out: the folder needs no tokenizer
    )
    if args.drop_layers:
        engine_kwargs["uniprefill_drop_layers"] = args.drop_layers
    engine = sglang.Engine(**engine_kwargs)
    info = engine.get_server_info()["internal_states"][0]["uniprefill"]
    drop_layers = info["drop_layers"]
    vocab = cfg["vocab_size"]
    gen = torch.Generator().manual_seed(0)

    def run(length: int, custom: dict):
        ids = torch.randint(100, vocab - 100, (length,), generator=gen).tolist()
        start = time.perf_counter()
        out = engine.generate(input_ids=ids, sampling_params={
            "max_new_tokens": 1, "temperature": 0.0, "custom_params": custom})
        return time.perf_counter() - start, out["meta_info"].get("uniprefill", [{}])[-1]

    rows = []
    print(f"drop layers {drop_layers}, backend {args.attention_backend}, "
          f"GPU {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
    print("| length | schedule | dense s | UniPrefill s | speedup | FLOP-ideal | of ideal | kept after last drop |")
    print("|---|---|---|---|---|---|---|---|")
    for length in lengths:
        run(length, {"uniprefill": False})  # warm-up for this shape
        dense_times = []
        for schedule in args.schedules:
            custom = {"uniprefill_keep_ratio": schedule}
            run(length, custom)  # warm-up
            up_times, kept = [], None
            for _ in range(args.repeats):  # alternate so drift hits both alike
                dense_times.append(run(length, {"uniprefill": False})[0])
                t, meta = run(length, custom)
                up_times.append(t)
                kept = meta.get("kept_tokens")
            dense = statistics.median(dense_times)
            up = statistics.median(up_times)
            ideal = flop_ideal_speedup(kept, drop_layers, cfg)
            row = dict(length=length, schedule=schedule, dense_s=dense, uniprefill_s=up,
                       speedup=dense / up, flop_ideal=ideal, kept=kept,
                       kept_fraction=kept[-1] / kept[0])
            rows.append(row)
            print(f"| {length} | {schedule} | {dense:.3f} | {up:.3f} | {dense / up:.2f}x | "
                  f"{ideal:.2f}x | {dense / up / ideal:.0%} | {kept[-1] / kept[0]:.0%} |",
                  flush=True)
            if args.out:  # keep what was measured even if a later length does not finish
                with open(args.out, "w") as f:
                    json.dump({"drop_layers": drop_layers, "backend": args.attention_backend,
                               "rows": rows}, f, indent=1)
    engine.shutdown()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"drop_layers": drop_layers, "backend": args.attention_backend,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
