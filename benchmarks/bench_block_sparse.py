"""Where block-sparse prefill attention's time goes: one chunk of a chunked prefill (8,192 queries,
the last of n keys) through the block-sparse Triton kernel at several densities and block sizes,
the estimate that picks its blocks (``block_mask_reference``), and dense attention on sgl_kernel's
FA3 (what SGLang runs on Hopper; FlashInfer's where FA3 is not installed) over the same chunk;
same process, CUDA events, bf16.

    python benchmarks/bench_block_sparse.py --keys 32768,65536,131072 --out result.json
"""

from __future__ import annotations

import argparse
import json

import torch
from cuda_timing import median_ms
from result_header import result_header


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


def flashinfer_bsr(q, k, v, indptr, indices, block_size, sm_scale):
    """FlashInfer's BSR wrapper over the first mask head's lists for every head (its pattern is
    shared by the heads), no in-block causal mask: a timing of the maintained kernel at the
    same density, not a drop-in (returns a runner, or the reason there is none)."""
    try:
        import flashinfer

        n_rows = -(-q.shape[0] // block_size)
        ws = torch.empty(256 << 20, dtype=torch.uint8, device=q.device)
        wrapper = flashinfer.BlockSparseAttentionWrapper(ws)
        first = indptr[:n_rows + 1]
        wrapper.plan(first, indices[:int(first[-1])], n_rows * block_size,
                     -(-k.shape[0] // block_size) * block_size, block_size, block_size,
                     q.shape[1], k.shape[1], q.shape[2], sm_scale=sm_scale,
                     q_data_type=q.dtype)
        pad_q = n_rows * block_size - q.shape[0]
        pad_k = -(-k.shape[0] // block_size) * block_size - k.shape[0]
        qp = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, pad_q))
        kp = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad_k))
        vp = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad_k))
        return lambda: wrapper.run(qp, kp, vp)
    except Exception as e:  # noqa: BLE001 - recorded in the result
        return f"{type(e).__name__}: {e}"[:300]


def flashinfer_dense(q, k, v, sm_scale):
    """FlashInfer's single-request prefill, causal bottom-right (the dense baseline where the
    FA3 kernels are not installed); None where FlashInfer is not."""
    try:
        import flashinfer
    except Exception:  # noqa: BLE001
        return None
    return lambda: flashinfer.single_prefill_with_kv_cache(q, k, v, causal=True, sm_scale=sm_scale)


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
    ap.add_argument("--flashinfer", choices=("on", "off"), default="on",
                    help="also time FlashInfer's BSR wrapper at the smallest block size")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    hq, hk, d = args.q_heads, args.kv_heads, args.head_dim
    scale = d ** -0.5
    rows = []
    print("| keys | path | block | density | ms | dense over it | estimate ms |")
    print("|---|---|---|---|---|---|---|")
    for n_k in [int(x) for x in args.keys.split(",")]:
        n_q = min(args.chunk, n_k)
        gen = torch.Generator(device=dev).manual_seed(n_k)
        q = torch.randn(n_q, hq, d, generator=gen, device=dev, dtype=dt)
        k = torch.randn(n_k, hk, d, generator=gen, device=dev, dtype=dt)
        v = torch.randn(n_k, hk, d, generator=gen, device=dev, dtype=dt)
        dense, dense_path = fa3_dense(q, k, v, scale), "fa3 dense"
        if dense is None:
            dense, dense_path = flashinfer_dense(q, k, v, scale), "flashinfer dense (no FA3 here)"
        dense_ms = round(median_ms(dense, args.repeats), 3) if dense is not None else None
        rows.append({"keys": n_k, "queries": n_q, "path": dense_path, "ms": dense_ms})
        print(f"| {n_k} | {dense_path} | - | 1.0 | {dense_ms} | 1.00 | - |")
        save(args.out, rows, hq, hk, d)
        block_sizes = [int(x) for x in args.block_sizes.split(",")]
        for bs in block_sizes:
            for density in [float(x) for x in args.densities.split(",")]:
                if density >= 1.0:
                    mask, est_ms = causal_block_pairs(n_q, n_k, bs)[None].to(dev), 0.0
                else:
                    def estimate():
                        return block_mask_reference(q, k, bs, density=density, sink_blocks=1,
                                                    local_blocks=1, sm_scale=scale)
                    est_ms = median_ms(estimate, args.repeats)
                    mask = estimate().to(dev)
                indptr, indices = block_lists_from_mask(mask)
                realised = indices.numel() / (float(causal_block_pairs(n_q, n_k, bs).sum())
                                              * mask.shape[0])
                out = torch.empty_like(q)
                for heads in [int(x) for x in args.heads_per_tile.split(",")]:
                    ms = median_ms(lambda: block_sparse_attention_from_lists(
                        q, k, v, indptr, indices, mask.shape[0], bs, scale, out=out,
                        heads_per_tile=heads or None), args.repeats)
                    over = round(dense_ms / ms, 3) if dense_ms else None
                    rows.append({"keys": n_k, "queries": n_q, "path": "triton block-sparse",
                                 "block_size": bs, "heads_per_tile": heads or "default",
                                 "density_asked": density, "density_realised": round(realised, 4),
                                 "ms": round(ms, 3), "dense_over_it": over,
                                 "estimate_ms": round(est_ms, 3)})
                    print(f"| {n_k} | triton x{heads or 'd'} | {bs} | {realised:.3f} | {ms:.3f} | "
                          f"{over} | {est_ms:.3f} |")
                    save(args.out, rows, hq, hk, d)
                if args.flashinfer == "on" and bs == min(block_sizes):
                    run = flashinfer_bsr(q, k, v, indptr, indices, bs, scale)
                    row = {"keys": n_k, "queries": n_q, "path": "flashinfer BSR (one pattern)",
                           "block_size": bs, "density_asked": density}
                    try:
                        if isinstance(run, str):
                            raise RuntimeError(run)
                        row["ms"] = round(median_ms(run, args.repeats), 3)
                        row["dense_over_it"] = round(dense_ms / row["ms"], 3) if dense_ms else None
                    except Exception as e:  # noqa: BLE001 - recorded in the result
                        row["error"] = f"{type(e).__name__}: {e}"[:300]
                    rows.append(row)
                    print(f"| {n_k} | flashinfer BSR | {bs} | {density} | {row.get('ms')} | "
                          f"{row.get('dense_over_it', row.get('error'))} | - |")
                save(args.out, rows, hq, hk, d)
    save(args.out, rows, hq, hk, d)


def save(path, rows, hq, hk, d) -> None:
    """The result so far (written after each row: a run cut short keeps its rows)."""
    if path:
        note = f"{torch.cuda.get_device_name()}, bf16, Hq={hq} Hkv={hk} D={d}"
        with open(path, "w") as f:
            json.dump({"header": result_header(note=note), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
