"""Where block-sparse prefill attention's time goes: one chunk of a chunked prefill (8,192 queries,
the last of n keys) through the block-sparse Triton kernel at several densities and block sizes,
the estimate that picks its blocks (``block_mask_reference``), and dense attention on sgl_kernel's
FA3 (what SGLang runs on Hopper) over the same chunk; same process, CUDA events, bf16.

    python benchmarks/bench_block_sparse.py --keys 32768,65536,131072 --out result.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from result_header import result_header


def time_ms(fn, repeats: int) -> float:
    fn()  # warm-up (and compilation)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def fa3_dense(q, k, v, sm_scale):
    """sgl_kernel's FA3 varlen attention, causal bottom-right; None where it is not installed."""
    try:
        from sgl_kernel.flash_attn import flash_attn_varlen_func
    except Exception:  # noqa: BLE001 - a bundle without the FA3 kernels
        return None
    cu_q = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
    cu_k = torch.tensor([0, k.shape[0]], dtype=torch.int32, device=q.device)

    def run():
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, q.shape[0], k.shape[0],
                                     softmax_scale=sm_scale, causal=True)
        return out[0] if isinstance(out, tuple) else out

    return run


def main() -> None:
    from uniprefill_sglang.kernels.block_sparse_reference import (block_lists_from_mask,
                                                                 block_mask_reference,
                                                                 causal_block_pairs)
    from uniprefill_sglang.kernels.block_sparse_triton import block_sparse_attention_from_lists

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", default="32768,65536,131072")
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--densities", default="1.0,0.3,0.1")
    ap.add_argument("--block-sizes", default="64,128")
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--heads-per-tile", default="0,1",
                    help="query heads per kernel program to time (0: the kernel's default)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    hq, hk, d = args.q_heads, args.kv_heads, args.head_dim
    scale = d ** -0.5
    rows = []
    print("| keys | path | block | density | ms | dense FA3 over it | estimate ms |")
    print("|---|---|---|---|---|---|---|")
    for n_k in [int(x) for x in args.keys.split(",")]:
        n_q = min(args.chunk, n_k)
        gen = torch.Generator(device=dev).manual_seed(n_k)
        q = torch.randn(n_q, hq, d, generator=gen, device=dev, dtype=dt)
        k = torch.randn(n_k, hk, d, generator=gen, device=dev, dtype=dt)
        v = torch.randn(n_k, hk, d, generator=gen, device=dev, dtype=dt)
        fa3 = fa3_dense(q, k, v, scale)
        fa3_ms = time_ms(fa3, args.repeats) if fa3 is not None else None
        rows.append({"keys": n_k, "queries": n_q, "path": "fa3 dense", "ms": fa3_ms})
        print(f"| {n_k} | fa3 dense | - | 1.0 | {fa3_ms} | 1.00 | - |")
        for bs in [int(x) for x in args.block_sizes.split(",")]:
            for density in [float(x) for x in args.densities.split(",")]:
                if density >= 1.0:
                    mask, est_ms = causal_block_pairs(n_q, n_k, bs)[None].to(dev), 0.0
                else:
                    def estimate():
                        return block_mask_reference(q, k, bs, density=density, sink_blocks=1,
                                                    local_blocks=1, sm_scale=scale)
                    est_ms = time_ms(estimate, args.repeats)
                    mask = estimate().to(dev)
                indptr, indices = block_lists_from_mask(mask)
                realised = indices.numel() / (float(causal_block_pairs(n_q, n_k, bs).sum())
                                              * mask.shape[0])
                out = torch.empty_like(q)
                for heads in [int(x) for x in args.heads_per_tile.split(",")]:
                    ms = time_ms(lambda: block_sparse_attention_from_lists(
                        q, k, v, indptr, indices, mask.shape[0], bs, scale, out=out,
                        heads_per_tile=heads or None), args.repeats)
                    over = round(fa3_ms / ms, 3) if fa3_ms else None
                    rows.append({"keys": n_k, "queries": n_q, "path": "triton block-sparse",
                                 "block_size": bs, "heads_per_tile": heads or "default",
                                 "density_asked": density, "density_realised": round(realised, 4),
                                 "ms": round(ms, 3), "fa3_dense_over_it": over,
                                 "estimate_ms": round(est_ms, 3)})
                    print(f"| {n_k} | triton x{heads or 'd'} | {bs} | {realised:.3f} | {ms:.3f} | "
                          f"{over} | {est_ms:.3f} |")
    result = {"header": result_header(note=f"{torch.cuda.get_device_name()}, bf16, "
                                           f"Hq={hq} Hkv={hk} D={d}"), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
