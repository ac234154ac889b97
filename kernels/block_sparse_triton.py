"""Triton block-sparse prefill attention over compact key-block lists (the portable kernel).

The geometry and the mask are block_sparse_reference's: one request's chunk of ``n_q`` queries,
query ``i`` at key position ``q_offset + i``, blocks of ``block_size`` aligned on key positions,
a bool mask ``[Hkv or 1, R, C]`` turned into key-block lists (row ``h * R + r``: the kept key
blocks of mask head ``h`` for query block ``r``, ascending, at ``indices[starts[row]:ends[row]]``):
``block_rows_from_mask``'s padded lists, built without a host sync, or
``block_lists_from_mask``'s CSR (``starts = indptr[:-1]``, ``ends = indptr[1:]``).

One program per (query block, group of ``HEADS`` query heads of one KV head) loads its
block's queries once, the heads stacked as one tile of ``HEADS * block_size`` rows (each key
block it loads serves every head of the tile: GQA's reuse, and a 128-row tile at block 64), and
runs a flash-attention loop over only the key blocks its list names: logits in fp32, an online softmax
in base 2 with a guarded running max (a block in which a row sees nothing leaves it unchanged,
so no NaN), the output accumulated in fp32 and written in q's dtype.  With ``causal`` the
token-level mask ``key <= query`` applies in every block (it bites in the diagonal one).  A
row that reads no key is written as zeros; the estimate never makes one (the diagonal block is
always kept).  The query block is one tile of ``block_size`` rows, so ``block_size`` is a power
of two >= 16 (tl.dot's smallest tile); the work is proportional to the kept blocks.

On Hopper FlashInfer's block-sparse wrappers are the maintained kernel to prefer; this one
runs wherever Triton does (and on the CPU under ``TRITON_INTERPRET=1`` for the tests).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .block_sparse_reference import (
    block_grid,
    block_rows_from_mask,
    check_block_mask,
    check_qk_shapes,
    check_qkv_shapes,
    resolve_q_offset,
)


@triton.jit
def _block_sparse_attention_kernel(
    Q, K, V, Out, BlockStarts, BlockEnds, BlockIndices,
    stride_qn, stride_qh, stride_qd,
    stride_kn, stride_kh, stride_kd,
    stride_vn, stride_vh, stride_vd,
    stride_on, stride_oh, stride_od,
    n_q, n_k, q_offset, first_block, n_rows, sm_scale,
    GROUP: tl.constexpr, HEADS: tl.constexpr, MASK_PER_KV_HEAD: tl.constexpr,
    CAUSAL: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, ROUND_BF16: tl.constexpr,
):
    r = tl.program_id(0)
    h0 = tl.program_id(1) * HEADS  # the tile's first query head; its HEADS share one KV head
    kvh = h0 // GROUP
    if MASK_PER_KV_HEAD:
        list_row = kvh * n_rows + r
    else:
        list_row = r

    # tile row t: head h0 + t // BLOCK, query at key position (first_block + r) * BLOCK + t % BLOCK
    t = tl.arange(0, HEADS * BLOCK)
    head = h0 + t // BLOCK
    qpos = (first_block + r) * BLOCK + t % BLOCK
    row_ok = (qpos >= q_offset) & (qpos < q_offset + n_q)
    rows64 = (qpos - q_offset).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < DV
    q = tl.load(Q + rows64[:, None] * stride_qn + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([HEADS * BLOCK], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([HEADS * BLOCK], dtype=tl.float32)
    acc = tl.zeros([HEADS * BLOCK, BLOCK_DV], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # log2(e): base-2 softmax

    e0 = tl.load(BlockStarts + list_row)
    e1 = tl.load(BlockEnds + list_row)
    for e in range(e0, e1):
        c = tl.load(BlockIndices + e)
        kpos = c * BLOCK + tl.arange(0, BLOCK)
        n_ok = kpos < n_k
        kpos64 = kpos.to(tl.int64)
        k = tl.load(K + kpos64[:, None] * stride_kn + kvh * stride_kh + offs_d[None, :] * stride_kd,
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PREC) * qk_scale
        vis = row_ok[:, None] & n_ok[None, :]
        if CAUSAL:
            vis = vis & (kpos[None, :] <= qpos[:, None])
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + kpos64[:, None] * stride_vn + kvh * stride_vh + offs_dv[None, :] * stride_vd,
                    mask=n_ok[:, None] & dv_ok[None, :], other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new

    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if ROUND_BF16:
        # the interpreter narrows fp32 to bf16 by truncation: pre-round to nearest even
        bits = acc.to(tl.uint32, bitcast=True)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))).to(tl.float32, bitcast=True)
        acc = tl.where(tl.abs(acc) >= 1.1754943508222875e-38, rounded, acc)
    tl.store(Out + rows64[:, None] * stride_on + head[:, None] * stride_oh + offs_dv[None, :] * stride_od,
             acc.to(Out.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])


# True when this module was imported with TRITON_INTERPRET=1 (kernels run on CPU).
INTERPRETED = type(_block_sparse_attention_kernel).__name__ == "InterpretedFunction"


def block_sparse_attention_from_lists(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indptr: torch.Tensor,
    block_indices: torch.Tensor,
    mask_heads: int,
    block_size: int,
    sm_scale: float,
    **options,
) -> torch.Tensor:
    """Block-sparse attention from CSR key-block lists (``block_lists_from_mask``): block_indptr
    int32 ``[mask_heads * R + 1]``; the other arguments, ``options`` and the answer as
    ``block_sparse_attention_from_rows``.  No host read of a device tensor."""
    block_indptr = block_indptr.to(torch.int32)
    return block_sparse_attention_from_rows(q, k, v, block_indptr[:-1], block_indptr[1:], block_indices,
                                            mask_heads, block_size, sm_scale, **options)


def block_sparse_attention_from_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_starts: torch.Tensor,
    block_ends: torch.Tensor,
    block_indices: torch.Tensor,
    mask_heads: int,
    block_size: int,
    sm_scale: float,
    causal: bool = True,
    q_offset: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
    num_warps: Optional[int] = None,
    num_stages: int = 2,
    heads_per_tile: Optional[int] = None,
) -> torch.Tensor:
    """Block-sparse attention from key-block lists given as each row's slice
    ``block_indices[block_starts[row]:block_ends[row]]`` (``block_rows_from_mask``).

    q ``[n_q, Hq, D]``, k ``[n_k, Hkv, D]``, v ``[n_k, Hkv, Dv]`` of one dtype (fp32, fp16,
    bf16) on one device; ``mask_heads`` is the mask's head count (Hkv or 1); block_starts and
    block_ends int32 ``[mask_heads * R]``, block_indices int32 key-block indices
    < ``ceil(n_k / block_size)`` (not checked on the device).  out: optional ``[n_q, Hq, Dv]``
    in q's dtype.  heads_per_tile: query heads of one KV head per program (a divisor of the
    group; default as many as make a tile of up to 128 rows); num_warps (default 4, 8 from
    128-row tiles) and num_stages are GPU tuning knobs.
    Returns ``[n_q, Hq, Dv]`` in q's dtype.  No host read of a device tensor.
    """
    n_q, n_k, hq, hkv = check_qkv_shapes(q, k, v)
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"q, k, v must share one of fp32/fp16/bf16, got {q.dtype}, {k.dtype}, {v.dtype}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"the Triton kernel needs a power-of-two block_size >= 16, got {block_size}")
    if mask_heads not in (1, hkv):
        raise ValueError(f"mask heads must be 1 or the kv heads ({hkv}), got {mask_heads}")
    a0, nr, _ = block_grid(n_q, n_k, block_size, q_offset)
    q_offset = resolve_q_offset(n_q, n_k, q_offset)
    if block_starts.numel() != mask_heads * nr or block_ends.numel() != mask_heads * nr:
        raise ValueError(f"the lists must have {mask_heads} * {nr} rows, got "
                         f"{block_starts.numel()} starts and {block_ends.numel()} ends")
    dv = v.shape[2]
    if out is None:
        out = torch.empty((n_q, hq, dv), dtype=q.dtype, device=q.device)
    elif out.shape != (n_q, hq, dv) or out.dtype != q.dtype:
        raise ValueError(f"out must be {(n_q, hq, dv)} {q.dtype}, got {tuple(out.shape)} {out.dtype}")
    if n_q == 0:
        return out
    # The interpreter multiplies bf16 tiles as raw 16-bit patterns: upcast there.
    upcast = INTERPRETED and q.dtype == torch.bfloat16
    prec = "ieee" if (upcast or q.dtype == torch.float32) else "tf32"
    group = hq // hkv
    if heads_per_tile is None:
        heads_per_tile = max(x for x in (1, 2, 4, 8) if group % x == 0 and x * block_size <= max(128, block_size))
    if heads_per_tile < 1 or group % heads_per_tile:
        raise ValueError(f"heads_per_tile must divide the group of {group} query heads, got {heads_per_tile}")
    if num_warps is None:
        num_warps = 8 if heads_per_tile * block_size >= 128 else 4
    extra = dict(num_warps=num_warps, num_stages=num_stages) if q.device.type == "cuda" else {}
    d = q.shape[2]

    def int32(x):
        return x.to(torch.int32).contiguous()

    _block_sparse_attention_kernel[(nr, hq // heads_per_tile)](
        q, k, v, out, int32(block_starts), int32(block_ends), int32(block_indices),
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        n_q, n_k, q_offset, a0, nr, float(sm_scale),
        GROUP=group, HEADS=heads_per_tile, MASK_PER_KV_HEAD=mask_heads == hkv and hkv > 1,
        CAUSAL=bool(causal),
        D=d, DV=dv, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        BLOCK=block_size, UPCAST=upcast, PREC=prec, ROUND_BF16=INTERPRETED and q.dtype == torch.bfloat16,
        **extra,
    )
    return out


def block_sparse_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    block_size: int,
    sm_scale: float,
    causal: bool = True,
    q_offset: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``block_sparse_attention_reference``'s answer in q's dtype, from the bool mask
    ``[Hkv or 1, R, C]`` (its padded lists: no host sync)."""
    n_q, n_k, _, hkv = check_qk_shapes(q, k)
    _, nr, nc = block_grid(n_q, n_k, block_size, q_offset)
    check_block_mask(mask, (nr, nc), hkv)
    starts, ends, indices = block_rows_from_mask(mask.to(q.device))
    return block_sparse_attention_from_rows(q, k, v, starts, ends, indices, mask.shape[0], block_size,
                                            sm_scale, causal=causal, q_offset=q_offset, out=out)
