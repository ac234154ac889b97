#!/usr/bin/env python
"""Benchmark of the UniPrefill selection kernels on one CUDA GPU (torch + triton only).

Shape: Llama-3.1-8B attention (Hq=32, Hkv=8, D=128, bf16), n=128 scoring queries
(the last n tokens of each segment), segment lengths 8K/32K/64K/128K, batch 1 and 8.

For every (length, batch) it times, with CUDA events (warmup, median of iters):
  * Triton: score_tokens (pass 1 + combine + pass 2) and select_tokens (one kernel + nonzero);
  * the materialising torch reference (score_tokens_reference with all heads at once,
    fp32, + select_tokens_reference);
and reports peak extra memory of both, FLOPs and ideal bytes of the scoring pass
(2 QK^T passes: 2 * 2 * n * L * Hq * D FLOPs per segment; K read once per pass:
2 * L * Hkv * D * 2 bytes, + Q and the fp32 scores), achieved TFLOP/s and GB/s,
and their fraction of the H200 ceilings (~790 TFLOP/s dense bf16, ~4.8 TB/s).

    python benchmarks/bench_selection.py --out bench_selection.json
    python benchmarks/bench_selection.py --lengths 131072 --batches 1 --sweep   # tile configs

Prints a markdown table to stdout; JSON to --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import torch
from cuda_timing import median_ms
from result_header import result_header

H200_TFLOPS = 790.0
H200_TBPS = 4.8


def load_kernels():
    """uniprefill_sglang.kernels if installed, else the repo's kernels/ folder as a package."""
    try:
        from uniprefill_sglang import kernels  # noqa: F401

        return kernels
    except ImportError:
        pass
    here = os.path.dirname(os.path.abspath(__file__))
    kdir = os.path.join(os.path.dirname(here), "kernels")
    name = "_uniprefill_kernels_bench"
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(kdir, "__init__.py"), submodule_search_locations=[kdir]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def make_inputs(L, B, n, hq, hkv, d, dtype, shuffle_slots, seed=0):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    nk = L * B
    q = torch.randn(n * B, hq, d, generator=g, device=dev, dtype=torch.float32).to(dtype)
    k_cache = torch.randn(nk, hkv, d, generator=g, device=dev, dtype=torch.float32).to(dtype)
    if shuffle_slots:
        k_slots = torch.randperm(nk, generator=g, device=dev)
    else:
        k_slots = torch.arange(nk, device=dev)
    k_pos = torch.arange(L, device=dev, dtype=torch.int32).repeat(B)
    q_pos = torch.arange(L - n, L, device=dev, dtype=torch.int64).repeat(B)
    q_indptr = torch.arange(0, B + 1, device=dev, dtype=torch.int32) * n
    k_indptr = torch.arange(0, B + 1, device=dev, dtype=torch.int32) * L
    return dict(q=q, q_pos=q_pos, q_indptr=q_indptr, k_cache=k_cache, k_slots=k_slots, k_pos=k_pos,
                k_indptr=k_indptr, sm_scale=d ** -0.5)


def peak_extra_bytes(fn):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    res = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del res
    return peak


# score_tokens tile configurations timed by --sweep.
TILE_CONFIGS = [
    dict(rows=64, block_n=64, rows2=64, block_n2=64, num_warps=8, num_warps2=8),
    dict(rows=128, block_n=64, rows2=64, block_n2=64, num_warps=8, num_warps2=8),
    dict(rows=64, block_n=128, rows2=64, block_n2=128, num_warps=8, num_warps2=8),
    dict(rows=128, block_n=32, rows2=128, block_n2=64, num_warps=8, num_warps2=8),
    dict(rows=64, block_n=64, rows2=32, block_n2=64, num_warps=4, num_warps2=4),
    dict(rows=64, block_n=64, rows2=64, block_n2=64, num_warps=4, num_warps2=8, num_stages=3),
    dict(rows=64, block_n=64, rows2=64, block_n2=32, num_warps=8, num_warps2=4),
]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="8192,32768,65536,131072")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--n", type=int, default=128, help="scoring queries per segment")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--ref-iters", type=int, default=3)
    ap.add_argument("--ref-max-total", type=int, default=8 * 131072,
                    help="skip the reference above this many keys in the batch")
    ap.add_argument("--shuffle-slots", action="store_true", help="random KV slots instead of contiguous")
    ap.add_argument("--no-check", dest="check", action="store_false",
                    help="skip comparing Triton scores with the reference")
    ap.add_argument("--sweep", action="store_true", help="also time a few score-kernel tile configs")
    ap.add_argument("--out", default=None, help="JSON output path")
    return ap.parse_args(argv)


class Shape:
    """One (length, batch) point: its inputs, the selection's arguments and a scores buffer."""

    def __init__(self, K, L: int, B: int, args, dtype):
        self.K, self.L, self.B, self.n = K, L, B, args.n
        self.inp = make_inputs(L, B, args.n, args.hq, args.hkv, args.head_dim, dtype,
                               args.shuffle_slots)
        self.sel_args = (self.inp["k_pos"], self.inp["k_indptr"],
                         torch.zeros(B, dtype=torch.int64, device="cuda"), args.block_size,
                         torch.full((B,), args.top_p, device="cuda"), torch.zeros(B, device="cuda"),
                         args.sink, args.window)
        self.scores_buf = torch.empty(L * B, dtype=torch.float32, device="cuda")

    def tri_score(self):
        return self.K.score_tokens(**self.inp, max_q=self.n, max_k=self.L, out=self.scores_buf)

    def tri_select(self):
        return self.K.select_tokens(self.scores_buf, *self.sel_args)

    def tri_all(self):
        s = self.K.score_tokens(**self.inp, max_q=self.n, max_k=self.L)
        return self.K.select_tokens(s, *self.sel_args)

    def ref_all(self):
        s = self.K.score_tokens_reference(**self.inp, compute_dtype=torch.float32,
                                          kv_head_chunk=None)
        return self.K.select_tokens_reference(s, *self.sel_args)


def time_triton(shape: Shape, row: dict, args) -> None:
    row["triton_score_ms"] = median_ms(shape.tri_score, args.iters, warmup=args.warmup)
    row["triton_select_ms"] = median_ms(shape.tri_select, args.iters, warmup=args.warmup)
    row["triton_total_ms"] = median_ms(shape.tri_all, args.iters, warmup=args.warmup)
    row["triton_peak_extra_mib"] = peak_extra_bytes(shape.tri_all) / 2**20
    kept = int(shape.tri_select()[1].sum())
    row["kept_fraction"] = kept / (shape.L * shape.B)


def score_roofline(row: dict, dtype) -> None:
    """The scoring pass's FLOPs and ideal bytes (see the docstring), and their achieved rates."""
    L, B, n, hq, hkv, d = (row[k] for k in ("L", "B", "n", "hq", "hkv", "d"))
    flops = 2 * 2 * n * L * hq * d * B
    esz = torch.finfo(dtype).bits // 8
    bytes_ = B * (2 * L * hkv * d * esz + n * hq * d * esz * 2 + L * 4)
    t = row["triton_score_ms"] * 1e-3
    row["score_flops"] = flops
    row["score_bytes_ideal"] = bytes_
    row["score_tflops"] = flops / t / 1e12
    row["score_gbps"] = bytes_ / t / 1e9
    row["score_frac_peak_flops"] = row["score_tflops"] / H200_TFLOPS
    row["score_frac_peak_bw"] = row["score_gbps"] / (H200_TBPS * 1e3)


def time_reference(shape: Shape, row: dict, args) -> None:
    """The torch reference's time and memory, and the Triton scores' largest error against it
    (skipped above --ref-max-total keys; "OOM" when it does not fit)."""
    row["ref_total_ms"] = None
    row["ref_peak_extra_mib"] = None
    row["max_rel_err_vs_ref"] = None
    if shape.L * shape.B <= args.ref_max_total:
        try:
            row["ref_total_ms"] = median_ms(shape.ref_all, args.ref_iters, warmup=1)
            row["ref_peak_extra_mib"] = peak_extra_bytes(shape.ref_all) / 2**20
            if args.check:
                ref = shape.K.score_tokens_reference(**shape.inp, compute_dtype=torch.float32,
                                                     kv_head_chunk=1)
                got = shape.tri_score()
                err = ((got - ref).abs() / (ref.abs() + 1e-6 * float(ref.abs().max()))).max()
                row["max_rel_err_vs_ref"] = float(err)
                del ref, got
        except torch.cuda.OutOfMemoryError:
            row["ref_total_ms"] = "OOM"
            torch.cuda.empty_cache()
    if isinstance(row["ref_total_ms"], float):
        row["speedup_vs_ref"] = row["ref_total_ms"] / row["triton_total_ms"]


def sweep_tiles(st, shape: Shape, args) -> list:
    out = []
    for cfg in TILE_CONFIGS:
        def f(cfg=cfg):
            return st.score_tokens_triton(**shape.inp, max_q=shape.n, max_k=shape.L,
                                          out=shape.scores_buf, **cfg)
        try:
            ms = median_ms(f, args.iters, warmup=args.warmup)
        except Exception as e:  # noqa: BLE001 (report and continue)
            ms = f"error: {type(e).__name__}: {e}"[:200]
        out.append(dict(cfg=cfg, score_ms=ms))
    return out


def measure(K, st, L: int, B: int, args, dtype) -> dict:
    shape = Shape(K, L, B, args, dtype)
    row = dict(L=L, B=B, n=args.n, hq=args.hq, hkv=args.hkv, d=args.head_dim, dtype=args.dtype,
               block_size=args.block_size, top_p=args.top_p)
    time_triton(shape, row, args)
    score_roofline(row, dtype)
    time_reference(shape, row, args)
    if args.sweep:
        row["sweep"] = sweep_tiles(st, shape, args)
    return row


def fmt(x, spec=".3f") -> str:
    """A table cell: "-" for nothing, text as it is, a number in `spec`."""
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return format(x, spec)


def print_tables(results: list, dev_name: str, args) -> None:
    print(f"\n## UniPrefill selection kernels on {dev_name} "
          f"(Hq={args.hq}, Hkv={args.hkv}, D={args.head_dim}, {args.dtype}, n={args.n}, "
          f"block={args.block_size}, top_p={args.top_p})\n")
    print("| L | B | score ms | select ms | total ms | ref ms | speedup | peak MiB (triton) | peak MiB (ref) "
          "| TFLOP/s | % 790 | GB/s (ideal) | % 4.8TB/s | kept | max rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['L']} | {r['B']} | {fmt(r['triton_score_ms'])} | {fmt(r['triton_select_ms'])} | "
              f"{fmt(r['triton_total_ms'])} | {fmt(r['ref_total_ms'], '.2f')} | {fmt(r.get('speedup_vs_ref'), '.1f')} | "
              f"{fmt(r['triton_peak_extra_mib'], '.1f')} | {fmt(r['ref_peak_extra_mib'], '.0f')} | "
              f"{fmt(r['score_tflops'], '.1f')} | {fmt(100 * r['score_frac_peak_flops'], '.1f')} | "
              f"{fmt(r['score_gbps'], '.0f')} | {fmt(100 * r['score_frac_peak_bw'], '.1f')} | "
              f"{fmt(r['kept_fraction'], '.3f')} | {fmt(r['max_rel_err_vs_ref'], '.2e')} |")
    if args.sweep:
        print("\n### score_tokens tile sweep (ms)\n")
        for r in results:
            for s in r.get("sweep", []):
                print(f"- L={r['L']} B={r['B']} {s['cfg']}: {fmt(s['score_ms'])}")


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("CUDA is required", file=sys.stderr)
        return 2
    K = load_kernels()
    from importlib import import_module

    st = import_module(K.__name__ + ".score_triton")
    dtype = getattr(torch, args.dtype)
    dev_name = torch.cuda.get_device_name()
    results = []
    for L in [int(x) for x in args.lengths.split(",")]:
        for B in [int(x) for x in args.batches.split(",")]:
            row = measure(K, st, L, B, args, dtype)
            results.append(row)
            torch.cuda.empty_cache()  # the shape's tensors are freed with it
            print(f"done L={L} B={B}: triton {row['triton_total_ms']:.3f} ms", file=sys.stderr)
    print_tables(results, dev_name, args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(header=result_header(model=f"selection only: Hq {args.hq}, Hkv {args.hkv}, "
                                                      f"D {args.head_dim}"),
                           device=dev_name, torch=torch.__version__, time=time.time(), args=vars(args),
                           results=results), f, indent=2)
        print(f"\nJSON written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
