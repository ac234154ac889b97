"""Triton scoring kernels: per-key attention mass of each segment's last queries.

Nothing of size [queries x keys x heads] is materialised:

* pass 1 (``_score_stats_kernel``): per (segment, tile of ROWS (query, head) rows,
  kv head, key split) an online softmax over the visible keys of the split gives a
  partial row max ``m`` and sum-of-exp ``l`` (base 2, fp32).  A (query, head) row
  flattening ``row = qi * G + h_in_group`` lets one tl.dot serve all the query
  heads that share a kv head (GQA) and works for any group size.
* combine (``_score_combine_kernel``): merges the splits into one log-sum-exp per
  (query, head) (``+inf`` when the row sees no key, so it contributes nothing).
* pass 2 (``_score_accum_kernel``): one program per (segment, key tile) loops over
  kv heads and tiles of rows, recomputes the logits with tl.dot and accumulates
  ``exp2(s - lse)`` over rows into per-key fp32 scores.  Each key is written by
  exactly one program (no atomics, deterministic).

Key rows are loaded indirectly through ``k_slots``; the causal mask is by
positions (key j visible to query i iff k_pos[j] <= q_pos[i]).

Any head dim works (e.g. 576 for DeepSeek MLA): the logits of a tile are summed over
chunks of DC (a power of two <= 128) columns of the head dim (``_tile_logits``); for a
power-of-two head dim <= 128 there is one chunk and q / k are loaded as whole rows.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634

# Debug aid for tests: fill internal scratch buffers with NaN before launching so
# an element the kernels forget to write poisons the result.
POISON_SCRATCH = False


@triton.jit
def _load_chunk(RowPtr, ok, stride_d, c, D: tl.constexpr, DC: tl.constexpr):
    """Columns [c * DC, (c + 1) * DC) of the rows at ``RowPtr`` ([R, 1] pointers); rows
    with ``ok`` false and columns >= D read as 0."""
    d = c * DC + tl.arange(0, DC)
    ptrs = RowPtr + d[None, :] * stride_d
    mask = ok[:, None]
    if D % DC != 0:
        mask = mask & (d[None, :] < D)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _tile_logits(
    q, k, QRow, KRow, row_ok, k_ok, stride_qd, stride_kd,
    D: tl.constexpr, DC: tl.constexpr, NUM_DC: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """Unscaled logits [ROWS, BLOCK_N] of a tile.  ``q`` / ``k``: chunk 0 of the rows,
    loaded by the caller (hoisted out of its loop); the other chunks of the head dim
    (only when NUM_DC > 1) are loaded here from the row pointers QRow / KRow."""
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PREC)
    if NUM_DC > 1:
        for c in range(1, NUM_DC):
            qc = _load_chunk(QRow, row_ok, stride_qd, c, D, DC)
            if UPCAST:
                qc = qc.to(tl.float32)
            kc = _load_chunk(KRow, k_ok, stride_kd, c, D, DC)
            s = tl.dot(qc, tl.trans(kc.to(qc.dtype)), s, input_precision=PREC)
    return s


@triton.jit
def _score_stats_kernel(
    Q, QPos, QIndptr, K, KSlots, KPos, KIndptr, MPart, LPart,
    stride_qn, stride_qh, stride_qd,
    stride_ks, stride_kh, stride_kd,
    stride_ps, stride_pn,
    qk_scale, split_len, n_splits, n_kv_heads,
    G: tl.constexpr, D: tl.constexpr, DC: tl.constexpr, NUM_DC: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    b = tl.program_id(1)
    split = pid % n_splits
    tmp = pid // n_splits
    kvh = tmp % n_kv_heads
    row_tile = tmp // n_kv_heads

    q_start = tl.load(QIndptr + b).to(tl.int32)
    q_end = tl.load(QIndptr + b + 1).to(tl.int32)
    n_rows = (q_end - q_start) * G
    k_start = tl.load(KIndptr + b).to(tl.int32)
    k_end = tl.load(KIndptr + b + 1).to(tl.int32)

    rows = row_tile * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    qi = q_start + rows // G
    hq = kvh * G + rows % G
    q_row = Q + qi[:, None].to(tl.int64) * stride_qn + hq[:, None] * stride_qh
    q = _load_chunk(q_row, row_ok, stride_qd, 0, D, DC)
    if UPCAST:
        q = q.to(tl.float32)
    qpos = tl.load(QPos + qi, mask=row_ok, other=0)

    lo = k_start + split * split_len
    hi = tl.minimum(lo + split_len, k_end)
    # a tile with no valid row has nothing to do: empty loop
    hi = tl.where(row_tile * ROWS < n_rows, hi, lo)

    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        k_ok = offs < hi
        slot = tl.load(KSlots + offs, mask=k_ok, other=0).to(tl.int64)
        kpos = tl.load(KPos + offs, mask=k_ok, other=0)
        k_row = K + slot[:, None] * stride_ks + kvh * stride_kh
        k = _load_chunk(k_row, k_ok, stride_kd, 0, D, DC)
        s = _tile_logits(q, k, q_row, k_row, row_ok, k_ok, stride_qd, stride_kd,
                         D, DC, NUM_DC, PREC, UPCAST) * qk_scale
        vis = row_ok[:, None] & k_ok[None, :] & (kpos[None, :] <= qpos[:, None])
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    out = split * stride_ps + qi.to(tl.int64) * stride_pn + hq
    tl.store(MPart + out, m_i, mask=row_ok)
    tl.store(LPart + out, l_i, mask=row_ok)


@triton.jit
def _score_combine_kernel(MPart, LPart, Lse, n_elems, n_splits, stride_ps, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_elems
    m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    for s in range(n_splits):
        m = tl.maximum(m, tl.load(MPart + s * stride_ps + offs, mask=ok, other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    l = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(n_splits):
        ms = tl.load(MPart + s * stride_ps + offs, mask=ok, other=float("-inf"))
        ls = tl.load(LPart + s * stride_ps + offs, mask=ok, other=0.0)
        l += tl.where(ms == float("-inf"), 0.0, ls * tl.exp2(ms - m_safe))
    lse = tl.where(l > 0, m_safe + tl.log2(tl.where(l > 0, l, 1.0)), float("inf"))
    tl.store(Lse + offs, lse, mask=ok)


@triton.jit
def _score_accum_kernel(
    Q, QPos, QIndptr, K, KSlots, KPos, KIndptr, Lse, Out,
    stride_qn, stride_qh, stride_qd,
    stride_ks, stride_kh, stride_kd,
    stride_ln,
    qk_scale, n_kv_heads,
    G: tl.constexpr, D: tl.constexpr, DC: tl.constexpr, NUM_DC: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    b = tl.program_id(1)
    k_start = tl.load(KIndptr + b).to(tl.int32)
    k_end = tl.load(KIndptr + b + 1).to(tl.int32)
    q_start = tl.load(QIndptr + b).to(tl.int32)
    q_end = tl.load(QIndptr + b + 1).to(tl.int32)
    n_rows = (q_end - q_start) * G
    # a key tile past the segment's end has nothing to do: empty row loop
    n_rows = tl.where(k_start + tile * BLOCK_N < k_end, n_rows, 0)

    offs = k_start + tile * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = offs < k_end
    slot = tl.load(KSlots + offs, mask=k_ok, other=0).to(tl.int64)
    kpos = tl.load(KPos + offs, mask=k_ok, other=0)
    r = tl.arange(0, ROWS)

    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for kvh in range(n_kv_heads):
        k_row = K + slot[:, None] * stride_ks + kvh * stride_kh
        k = _load_chunk(k_row, k_ok, stride_kd, 0, D, DC)
        for r0 in range(0, n_rows, ROWS):
            rows = r0 + r
            row_ok = rows < n_rows
            qi = q_start + rows // G
            hq = kvh * G + rows % G
            q_row = Q + qi[:, None].to(tl.int64) * stride_qn + hq[:, None] * stride_qh
            q = _load_chunk(q_row, row_ok, stride_qd, 0, D, DC)
            if UPCAST:
                q = q.to(tl.float32)
            qpos = tl.load(QPos + qi, mask=row_ok, other=0)
            lse = tl.load(Lse + qi.to(tl.int64) * stride_ln + hq, mask=row_ok, other=float("inf"))
            s = _tile_logits(q, k, q_row, k_row, row_ok, k_ok, stride_qd, stride_kd,
                             D, DC, NUM_DC, PREC, UPCAST) * qk_scale
            vis = row_ok[:, None] & k_ok[None, :] & (kpos[None, :] <= qpos[:, None])
            # masked logits -> -inf first: exp2(-inf - lse) = 0 even for lse = +inf (no NaN/inf)
            s = tl.where(vis, s, float("-inf"))
            acc += tl.sum(tl.exp2(s - lse[:, None]), 0)
    tl.store(Out + offs, acc, mask=k_ok)


# True when this module was imported with TRITON_INTERPRET=1 (kernels run on CPU).
INTERPRETED = type(_score_accum_kernel).__name__ == "InterpretedFunction"


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _head_dim_chunk(d: int) -> int:
    """DC, the width of the head-dim chunks: a power of two in [16, 128].  The largest
    such power of two that divides d (d itself for d = 16..128 a power of two: one
    chunk), else min(128, next_power_of_2(d)) with the columns >= d masked off."""
    dc = 128
    while dc >= 16 and d % dc:
        dc //= 2
    return dc if dc >= 16 else max(16, min(128, triton.next_power_of_2(d)))


def _max_len(indptr: torch.Tensor) -> int:
    if indptr.numel() < 2:
        return 0
    return int((indptr[1:] - indptr[:-1]).max().item())


def score_tokens_triton(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    q_indptr: torch.Tensor,
    k_cache: torch.Tensor,
    k_slots: torch.Tensor,
    k_pos: torch.Tensor,
    k_indptr: torch.Tensor,
    sm_scale: float,
    max_q: Optional[int] = None,
    max_k: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
    *,
    rows: Optional[int] = None,
    block_n: Optional[int] = None,
    rows2: Optional[int] = None,
    block_n2: Optional[int] = None,
    n_splits: Optional[int] = None,
    num_warps: int = 8,
    num_warps2: int = 8,
    num_stages: Optional[int] = None,
) -> torch.Tensor:
    """Triton implementation of ``score_tokens`` (see kernels/__init__.py).

    Keyword-only knobs (tile sizes, number of key splits of pass 1) are for tests
    and tuning; the defaults are chosen for H100/H200-class GPUs.
    """
    assert q.dim() == 3 and k_cache.dim() == 3, (q.shape, k_cache.shape)
    nq, hq, d = q.shape
    _, hkv, dk = k_cache.shape
    assert d == dk, (d, dk)
    assert hq % hkv == 0, (hq, hkv)
    assert d >= 1, d
    group = hq // hkv
    nseg = q_indptr.numel() - 1
    assert k_indptr.numel() == nseg + 1, (q_indptr.shape, k_indptr.shape)
    nk = k_slots.numel()
    device = k_cache.device

    if out is None:
        out = torch.empty(nk, dtype=torch.float32, device=device)
    else:
        assert out.shape == (nk,) and out.dtype == torch.float32 and out.is_contiguous()
    if nk == 0 or nseg <= 0:
        return out
    if max_k is None:
        max_k = _max_len(k_indptr)
    if max_q is None:
        max_q = _max_len(q_indptr)
    max_k = int(max_k)
    max_q = int(max_q)
    if max_k <= 0 or max_q <= 0:
        out.zero_()
        return out

    q_pos = q_pos.contiguous()
    k_pos = k_pos.contiguous()
    k_slots = k_slots.contiguous()
    q_indptr = q_indptr.contiguous()
    k_indptr = k_indptr.contiguous()
    if k_cache.dtype != q.dtype and k_cache.element_size() > q.element_size():
        # keys are cast to q's dtype inside the kernel; fp32 keys with bf16
        # queries would lose precision, so promote q instead.
        q = q.to(k_cache.dtype)
    # The Triton interpreter (CPU) multiplies bf16 tiles as raw uint16 bits
    # (triton 3.6 interpreter create_dot): upcast tiles to fp32 there.
    upcast = q.dtype == torch.bfloat16 and INTERPRETED
    prec = "ieee" if (q.dtype == torch.float32 or upcast) else "tf32"
    qk_scale = float(sm_scale) * LOG2E
    on_gpu = device.type == "cuda"

    dc = _head_dim_chunk(d)
    num_dc = triton.cdiv(d, dc)

    # d > 128 keeps d = 128's tiles: the kernels hold at most DC <= 128 columns of a q or
    # k tile at a time (one hoisted chunk plus the double-buffered loads of the chunk
    # loop), so registers and shared memory per program stay at d = 128's level; fewer
    # rows would only re-read K more often (MLA has 16 query heads per kv head).
    rows = rows or (128 if d <= 64 else 64)
    block_n = block_n or 64
    rows2 = rows2 or 64
    block_n2 = block_n2 or (128 if d <= 64 else 64)
    if num_stages is None:
        num_stages = 2
    n_rows_max = max_q * group
    row_tiles = triton.cdiv(n_rows_max, rows)

    # ---- pass 1: split-K online softmax statistics ----
    if n_splits is None:
        base = nseg * row_tiles * hkv
        target = 2 * _num_sms(device)
        n_splits = max(1, min(triton.cdiv(target, base), triton.cdiv(max_k, 1024), 64))
    n_splits = max(1, min(int(n_splits), triton.cdiv(max_k, block_n)))
    split_len = triton.cdiv(triton.cdiv(max_k, n_splits), block_n) * block_n
    n_splits = triton.cdiv(max_k, split_len)

    if POISON_SCRATCH:
        m_part = torch.full((n_splits, nq, hq), float("nan"), dtype=torch.float32, device=device)
        l_part = torch.full((n_splits, nq, hq), float("nan"), dtype=torch.float32, device=device)
        lse = torch.full((nq, hq), float("nan"), dtype=torch.float32, device=device)
    else:
        m_part = torch.empty((n_splits, nq, hq), dtype=torch.float32, device=device)
        l_part = torch.empty((n_splits, nq, hq), dtype=torch.float32, device=device)
        lse = torch.empty((nq, hq), dtype=torch.float32, device=device)

    extra = dict(num_warps=num_warps, num_stages=num_stages) if on_gpu else {}
    extra2 = dict(num_warps=num_warps2, num_stages=num_stages) if on_gpu else {}
    grid1 = (row_tiles * hkv * n_splits, nseg)
    _score_stats_kernel[grid1](
        q, q_pos, q_indptr, k_cache, k_slots, k_pos, k_indptr, m_part, l_part,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        nq * hq, hq,
        qk_scale, split_len, n_splits, hkv,
        G=group, D=d, DC=dc, NUM_DC=num_dc, ROWS=rows, BLOCK_N=block_n, PREC=prec, UPCAST=upcast,
        **extra,
    )

    # ---- combine splits into a log-sum-exp per (query, head) ----
    n_elems = nq * hq
    cblock = 1024
    _score_combine_kernel[(triton.cdiv(n_elems, cblock),)](
        m_part, l_part, lse, n_elems, n_splits, nq * hq, BLOCK=cblock,
        **(dict(num_warps=4) if on_gpu else {}),
    )

    # ---- pass 2: per-key accumulation ----
    grid2 = (triton.cdiv(max_k, block_n2), nseg)
    _score_accum_kernel[grid2](
        q, q_pos, q_indptr, k_cache, k_slots, k_pos, k_indptr, lse, out,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        hq,
        qk_scale, hkv,
        G=group, D=d, DC=dc, NUM_DC=num_dc, ROWS=rows2, BLOCK_N=block_n2, PREC=prec, UPCAST=upcast,
        **extra2,
    )
    return out
