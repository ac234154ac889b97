"""Triton selection kernel: per-segment block top-p / keep-ratio cut, no sort.

One program per segment:

1. block sums of the candidate scores (fixed summation order, so identical
   blocks get bitwise identical sums) into a scratch buffer, plus total and max;
2. threshold search: the kept blocks are exactly those with score > v plus the
   first ``k_eq`` blocks (by index) with score == v, where v is the largest value
   t with F(t) >= target, F(t) = sum over blocks with score >= t of w
   (w = score in top-p mode, target = p * total; w = 1 in keep-ratio mode,
   target = k).  Non-negative fp32 values are ordered like their int32 bit
   patterns, so v is found by a 16-ary search on the bits (8 rounds);
3. block keep flags in index order (ties broken by lower block index first, via
   a running count of ties) -> token keep mask over the candidate rows
   (+ attention sinks by position, + trailing window), and the per-segment count.

The wrapper turns the mask into ascending indices with one ``torch.nonzero``
(the single host sync).  Everything is deterministic (no atomics).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .reference import RATIO_EPS


@triton.jit
def _select_kernel(
    Scores, KPos, KIndptr, CandStart, CandIndptr, TopP, KeepRatio,
    BlockBuf, FlagBuf, Mask, Counts,
    block_size, sink_tokens, last_window, ratio_scale,
    GCH: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_S: tl.constexpr, NT: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    b = tl.program_id(0)
    k0 = tl.load(KIndptr + b).to(tl.int64)
    k1 = tl.load(KIndptr + b + 1).to(tl.int64)
    cs = tl.maximum(tl.load(CandStart + b).to(tl.int64), 0)
    c0 = k0 + cs
    nc = tl.maximum(k1 - c0, 0)
    row0 = tl.load(CandIndptr + b).to(tl.int64)
    G = block_size
    nb = (nc + G - 1) // G

    # ---- 1. block sums (blocks of segment b live at BlockBuf[row0 : row0 + nb]) ----
    tot_vec = tl.zeros([BLOCK_A], dtype=tl.float32)
    max_vec = tl.zeros([BLOCK_A], dtype=tl.float32)
    ga = tl.arange(0, GCH)
    for bb in range(0, nb, BLOCK_A):
        blk = bb + tl.arange(0, BLOCK_A)
        bok = blk < nb
        acc = tl.zeros([BLOCK_A], dtype=tl.float32)
        for g0 in range(0, G, GCH):
            gg = g0 + ga
            loc = blk[:, None] * G + gg[None, :]
            ok = bok[:, None] & (gg[None, :] < G) & (loc < nc)
            acc += tl.sum(tl.load(Scores + c0 + loc, mask=ok, other=0.0), 1)
        acc = tl.where(acc > 0.0, acc, 0.0)  # also maps -0.0 / NaN to +0.0
        tl.store(BlockBuf + row0 + blk, acc, mask=bok)
        tot_vec += acc
        max_vec = tl.maximum(max_vec, acc)
    total = tl.sum(tot_vec, 0)
    max_bits = tl.max(max_vec, 0).to(tl.int32, bitcast=True).to(tl.int64)
    tl.debug_barrier()

    # ---- 2. mode and threshold search ----
    p = tl.load(TopP + b)
    ratio = tl.load(KeepRatio + b)
    use_ratio = ratio > 0.0
    nbf = nb.to(tl.float32)
    k_ratio = tl.ceil(ratio * nbf * ratio_scale)
    k_ratio = tl.minimum(tl.maximum(k_ratio, 1.0), nbf)
    count_mode = use_ratio | (p <= 0.0)
    target = tl.where(count_mode, tl.where(use_ratio, k_ratio, 1.0), p * total)
    keep_all = (nb == 0) | ((~use_ratio) & ((p >= 1.0) | (total <= 0.0)))
    wmul = tl.where(count_mode, 0.0, 1.0)  # w = wmul * s + (1 - wmul)

    # invariant: F(lo) >= target, F(hi) < target   (F(max + 1 bit) = 0 < target)
    lo = tl.where(keep_all, -1, 0).to(tl.int64)
    hi = tl.where(keep_all, 0, max_bits + 1).to(tl.int64)
    jt = tl.arange(0, NT).to(tl.int64) + 1
    while hi - lo > 1:
        t = lo + ((hi - lo) * jt) // (NT + 1)  # [NT], increasing, in [lo, hi)
        t32 = t.to(tl.int32)  # 0 <= t < 0x7F800001
        f_acc = tl.zeros([NT, BLOCK_S], dtype=tl.float32)
        for bb in range(0, nb, BLOCK_S):
            blk = bb + tl.arange(0, BLOCK_S)
            bok = blk < nb
            s = tl.load(BlockBuf + row0 + blk, mask=bok, other=0.0)
            bits = s.to(tl.int32, bitcast=True)
            w = s * wmul + (1.0 - wmul)
            hit = bok[None, :] & (bits[None, :] >= t32[:, None])
            f_acc += tl.where(hit, w[None, :], 0.0)
        f = tl.sum(f_acc, 1)
        pred = f >= target
        lo = tl.maximum(lo, tl.max(tl.where(pred, t, lo), 0))
        hi = tl.minimum(hi, tl.min(tl.where(pred, hi, t), 0))

    # ---- mass / count strictly above v, ties to keep ----
    v_bits = lo
    gt_vec = tl.zeros([BLOCK_S], dtype=tl.float32)
    for bb in range(0, nb, BLOCK_S):
        blk = bb + tl.arange(0, BLOCK_S)
        bok = blk < nb
        s = tl.load(BlockBuf + row0 + blk, mask=bok, other=0.0)
        bits = s.to(tl.int32, bitcast=True).to(tl.int64)
        w = s * wmul + (1.0 - wmul)
        gt_vec += tl.where(bok & (bits > v_bits), w, 0.0)
    w_gt = tl.sum(gt_vec, 0)
    v = tl.maximum(v_bits, 0).to(tl.int32).to(tl.float32, bitcast=True)
    k_eq_p = tl.where(v > 0.0, tl.ceil((target - w_gt) / tl.where(v > 0.0, v, 1.0)), nbf)
    k_eq_p = tl.minimum(tl.maximum(k_eq_p, 1.0), nbf)
    k_eq = tl.where(count_mode, target - w_gt, k_eq_p)
    k_eq = tl.where(keep_all, 0.0, k_eq).to(tl.int64)

    # ---- 3a. block keep flags, ties by lower index first ----
    ties_before = tl.zeros([], dtype=tl.int64)
    for bb in range(0, nb, BLOCK_S):
        blk = bb + tl.arange(0, BLOCK_S)
        bok = blk < nb
        s = tl.load(BlockBuf + row0 + blk, mask=bok, other=0.0)
        bits = s.to(tl.int32, bitcast=True).to(tl.int64)
        eq = (bok & (bits == v_bits)).to(tl.int64)
        rank = ties_before + tl.cumsum(eq, 0) - eq
        keep = bok & ((bits > v_bits) | ((eq != 0) & (rank < k_eq)))
        tl.store(FlagBuf + row0 + blk, keep.to(tl.int8), mask=bok)
        ties_before += tl.sum(eq, 0)
    tl.debug_barrier()

    # ---- 3b. token mask over candidate rows + count ----
    cnt = tl.zeros([BLOCK_T], dtype=tl.int32)
    win_start = nc - last_window
    for t0 in range(0, nc, BLOCK_T):
        loc = t0 + tl.arange(0, BLOCK_T)
        ok = loc < nc
        f = tl.load(FlagBuf + row0 + loc // G, mask=ok, other=0)
        pos = tl.load(KPos + c0 + loc, mask=ok, other=0)
        keep = ok & ((f != 0) | (pos < sink_tokens) | (loc >= win_start))
        tl.store(Mask + row0 + loc, keep.to(tl.int8), mask=ok)
        cnt += keep.to(tl.int32)
    tl.store(Counts + b, tl.sum(cnt, 0))


def _per_segment_tensor(x, n: int, dtype, device) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        x = x.to(device=device, dtype=dtype)
        if x.dim() == 0:
            x = x.expand(n)
        return x.contiguous()
    return torch.full((n,), x, dtype=dtype, device=device)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def select_tokens_triton(*args, **kwargs) -> Tuple[torch.Tensor, torch.Tensor]:
    """Triton implementation of ``select_tokens`` (see kernels/__init__.py): the kept mask's
    indices, with one host sync (torch.nonzero)."""
    mask, counts = select_token_mask_triton(*args, **kwargs)
    return torch.nonzero(mask).squeeze(1), counts


def select_token_mask_triton(
    scores: torch.Tensor,
    k_pos: torch.Tensor,
    k_indptr: torch.Tensor,
    cand_start,
    block_size: int,
    top_p,
    keep_ratio,
    sink_tokens: int,
    last_window: int,
    *,
    block_a: Optional[int] = None,
    block_s: int = 1024,
    block_t: int = 8192,
    nt: int = 16,
    num_warps: int = 16,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Triton implementation of ``select_token_mask`` (see kernels/__init__.py): no host sync."""
    device = scores.device
    nseg = k_indptr.numel() - 1
    nk = scores.numel()
    block_size = int(block_size)
    assert block_size >= 1
    if nseg <= 0:
        return (torch.zeros(nk, dtype=torch.bool, device=device), torch.zeros(0, dtype=torch.int32, device=device))
    scores = scores.contiguous()
    if scores.dtype != torch.float32:
        scores = scores.float()
    k_pos = k_pos.contiguous()
    k_indptr = k_indptr.to(device).contiguous()
    cs = _per_segment_tensor(cand_start, nseg, torch.int64, device).clamp_min(0)
    seg_len = (k_indptr[1:] - k_indptr[:-1]).to(torch.int64)
    nc = (seg_len - cs).clamp_min(0)
    cand_indptr = torch.zeros(nseg + 1, dtype=torch.int64, device=device)
    torch.cumsum(nc, 0, out=cand_indptr[1:])
    tp = _per_segment_tensor(top_p, nseg, torch.float32, device)
    kr = _per_segment_tensor(keep_ratio, nseg, torch.float32, device)

    mask = torch.zeros(max(nk, 1), dtype=torch.int8, device=device)
    counts = torch.empty(nseg, dtype=torch.int32, device=device)
    block_buf = torch.empty(max(nk, 1), dtype=torch.float32, device=device)
    flag_buf = torch.empty(max(nk, 1), dtype=torch.int8, device=device)

    gch = min(_next_pow2(block_size), 128)
    if block_a is None:
        block_a = max(16, 4096 // gch)
    # tiles sized for 16 warps without register spills on sm_90 (checked with ptxas)
    extra = dict(num_warps=num_warps) if device.type == "cuda" else {}
    _select_kernel[(nseg,)](
        scores, k_pos, k_indptr, cs, cand_indptr, tp, kr,
        block_buf, flag_buf, mask, counts,
        block_size, int(sink_tokens), int(last_window), 1.0 - RATIO_EPS,
        GCH=gch, BLOCK_A=block_a, BLOCK_S=block_s, NT=nt, BLOCK_T=block_t, **extra,
    )
    return mask[:nk].bool(), counts
