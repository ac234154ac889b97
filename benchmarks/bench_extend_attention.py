"""Why the FlashInfer adapter runs survivors through the ragged wrapper: one extend attention over
n tokens of one request, FlashInfer's ragged kernel on contiguous K/V (upstream's prefill without
a prefix) vs its paged kernel at page size 1 over the same keys scattered in a KV pool (what a
per-stage view over compacted slots reads), same process, CUDA events.

    python benchmarks/bench_extend_attention.py --lengths 8192,32768,131072
"""

from __future__ import annotations

import argparse
import json

import torch
from cuda_timing import median_ms
from result_header import result_header


def main() -> None:
    import flashinfer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="8192,32768,65536,131072")
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    hq, hk, d = args.q_heads, args.kv_heads, args.head_dim
    ws = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
    rows = []
    print("| tokens | ragged ms | paged (page 1) ms | paged / ragged | max abs diff |")
    print("|---|---|---|---|---|")
    for n in [int(x) for x in args.lengths.split(",")]:
        gen = torch.Generator(device=dev).manual_seed(n)
        q = torch.randn(n, hq, d, dtype=dt, device=dev, generator=gen)
        k = torch.randn(n, hk, d, dtype=dt, device=dev, generator=gen)
        v = torch.randn(n, hk, d, dtype=dt, device=dev, generator=gen)
        # The keys live at sorted random slots of a pool twice their size (a compacted view).
        slots = torch.randperm(2 * n, device=dev, generator=gen)[:n].sort().values.to(torch.int32)
        pool = torch.zeros(2 * n, 2, hk, d, dtype=dt, device=dev)  # [slots, K/V, heads, dim]
        pool[slots.long(), 0], pool[slots.long(), 1] = k, v
        indptr = torch.tensor([0, n], dtype=torch.int32)
        ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
        ragged.plan(indptr, indptr, hq, hk, d, causal=True, q_data_type=dt)
        paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        paged.plan(indptr, indptr, slots, torch.ones(1, dtype=torch.int32), hq, hk, d, 1,
                   causal=True, q_data_type=dt, kv_data_type=dt)
        paged_kv = pool.view(2 * n, 2, 1, hk, d)  # page size 1
        diff = (ragged.run(q, k, v).float() - paged.run(q, paged_kv).float()).abs().max().item()
        t_r = median_ms(lambda: ragged.run(q, k, v), args.repeats)
        t_p = median_ms(lambda: paged.run(q, paged_kv), args.repeats)
        rows.append(dict(tokens=n, ragged_ms=t_r, paged_ms=t_p, ratio=t_p / t_r, max_diff=diff))
        print(f"| {n} | {t_r:.2f} | {t_p:.2f} | {t_p / t_r:.2f}x | {diff:.1e} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"header": result_header(model=f"attention only: Hq {hq}, Hkv {hk}, D {d}"),
                       "gpu": torch.cuda.get_device_name(), "flashinfer": flashinfer.__version__,
                       "q_heads": hq, "kv_heads": hk, "head_dim": d, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
