"""Triton attention whose causal and sliding-window mask is by original token positions.

One program per (request, query head, tile of BLOCK_M query rows) runs a flash-attention loop
over the request's keys in tiles of BLOCK_N: logits in fp32, an online softmax in base 2 with
a guarded running max (a tile in which a row sees nothing leaves it unchanged, no NaN), the
output accumulated in fp32 and written in q's dtype.  Keys and values are gathered through
``kv_indices`` from a paged pool; the mask reads ``q_pos`` and ``kv_pos`` only (see
positional_reference.py), so it stays right however many entries a drop removed.

Every length is read on the device (``q_indptr`` and ``kv_indptr`` are loaded by the kernel,
and its loops run to their bounds); the grid depends on host ints only (B, Hq and
``max_q_len``), so a call can be captured in a CUDA graph and replayed after the index tensors'
contents change.  A tile of keys none of which a tile's rows may see (beyond the window, or
after every query) skips its loads and products.  With ``kv_sorted`` (each request's keys in
ascending position, as the plugin's views list them) the loop does not visit such tiles at all:
two binary searches bound it to the keys from the tile's first row's window start to its last
row, so a sliding-window layer costs the window, not the prompt.  Sink logits (one per query
head, gpt-oss) join each row's denominator after the loop, with no value.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

@triton.jit
def _lower_bound(Pos, lo, hi, target):
    """The first index in [lo, hi) whose position is >= target (hi if none); Pos ascends
    there. 32 halvings cover any int32 range."""
    for _ in range(32):
        active = lo < hi
        mid = (lo + hi) // 2
        pos = tl.load(Pos + mid, mask=active, other=0).to(tl.int64)
        right = active & (pos < target)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(active & ~right, mid, hi)
    return lo


@triton.jit
def _positional_attention_kernel(
    Q, QPos, QIndptr, K, V, KVIndptr, KVIndices, KVPos, Sinks, Out,
    stride_qn, stride_qh, stride_qd,
    stride_ks, stride_kh, stride_kd,
    stride_vs, stride_vh, stride_vd,
    stride_on, stride_oh, stride_od,
    sm_scale, window, logit_cap,
    GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_CAP: tl.constexpr, KV_SORTED: tl.constexpr,
    HAS_SINK: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, ROUND_BF16: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    m_tile = tl.program_id(2)
    kvh = h // GROUP

    q_start = tl.load(QIndptr + b).to(tl.int32)
    q_end = tl.load(QIndptr + b + 1).to(tl.int32)
    row0 = q_start + m_tile * BLOCK_M
    if row0 >= q_end:
        return
    k_start = tl.load(KVIndptr + b).to(tl.int32)
    k_end = tl.load(KVIndptr + b + 1).to(tl.int32)

    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < q_end
    rows64 = rows.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < DV

    q = tl.load(
        Q + rows64[:, None] * stride_qn + h * stride_qh + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    qpos = tl.load(QPos + rows, mask=row_ok, other=0).to(tl.int64)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    if KV_SORTED:
        # Keys after the tile's last row, or before its first row's window, are seen by none.
        q_last = tl.max(tl.where(row_ok, qpos, -1))
        k_end = _lower_bound(KVPos, k_start, k_end, q_last + 1)
        if USE_WINDOW:
            q_first = tl.min(tl.where(row_ok, qpos, q_last))
            k_start = _lower_bound(KVPos, k_start, k_end, q_first - window)

    for n0 in range(k_start, k_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < k_end
        kpos = tl.load(KVPos + offs_n, mask=n_ok, other=0).to(tl.int64)
        vis = row_ok[:, None] & n_ok[None, :] & (kpos[None, :] <= qpos[:, None])
        if USE_WINDOW:
            vis = vis & (kpos[None, :] >= qpos[:, None] - window)
        if tl.max(vis.to(tl.int32)) > 0:
            slot = tl.load(KVIndices + offs_n, mask=n_ok, other=0).to(tl.int64)
            k = tl.load(
                K + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :] * stride_kd,
                mask=n_ok[:, None] & d_ok[None, :], other=0.0,
            )
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PREC) * sm_scale
            if USE_CAP:
                # cap * tanh(s / cap), tanh(x) = 1 - 2 / (exp(2x) + 1): saturates without NaN
                s = logit_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / logit_cap) + 1.0))
            s = tl.where(vis, s * 1.4426950408889634, float("-inf"))  # log2(e): base-2 softmax
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                V + slot[:, None] * stride_vs + kvh * stride_vh + offs_dv[None, :] * stride_vd,
                mask=n_ok[:, None] & dv_ok[None, :], other=0.0,
            )
            if UPCAST:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m_i = m_new

    if HAS_SINK:
        # the head's sink logit joins the denominator (base 2, like the running max); a row
        # that saw no key keeps acc = 0
        sink = tl.load(Sinks + h).to(tl.float32) * 1.4426950408889634
        m_fin = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_fin)
        l_i = l_i * alpha + tl.exp2(sink - m_fin)
        acc = acc * alpha[:, None]
    # a row that saw no key has l = 0 (without a sink) and acc = 0: it is written as zeros
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if ROUND_BF16:
        # the interpreter narrows fp32 to bf16 by truncation: pre-round to nearest even
        bits = acc.to(tl.uint32, bitcast=True)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))).to(tl.float32, bitcast=True)
        acc = tl.where(tl.abs(acc) >= 1.1754943508222875e-38, rounded, acc)  # normal numbers only
    tl.store(
        Out + rows64[:, None] * stride_on + h * stride_oh + offs_dv[None, :] * stride_od,
        acc.to(Out.dtype.element_ty),
        mask=row_ok[:, None] & dv_ok[None, :],
    )


# True when this module was imported with TRITON_INTERPRET=1 (kernels run on CPU).
INTERPRETED = type(_positional_attention_kernel).__name__ == "InterpretedFunction"


def positional_attention_triton(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    q_indptr: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_pos: torch.Tensor,
    sm_scale: float,
    window: int = -1,
    logit_cap: float = 0.0,
    *,
    max_q_len: int,
    out: Optional[torch.Tensor] = None,
    block_m: Optional[int] = None,
    block_n: Optional[int] = None,
    num_warps: int = 4,
    num_stages: int = 2,
    kv_sorted: bool = False,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Triton implementation of ``positional_attention`` (see kernels/__init__.py).

    max_q_len: host int >= the query rows of every request (rows past it are not computed).
    out:       optional preallocated [Nq, Hq, Dv] output in q's dtype; rows no request owns are
               left as they are (zeros when the output is allocated here).
    block_m, block_n, num_warps, num_stages: tiling knobs for tests and tuning.
    kv_sorted: each request's kv_pos ascend; the loop then visits only the key tiles in reach.
    sinks:     optional [Hq] sink logits (any float dtype), read as float32.
    No host read of a device tensor: safe to capture in a CUDA graph.
    """
    assert q.dim() == 3 and k_buffer.dim() == 3 and v_buffer.dim() == 3, (
        q.shape, k_buffer.shape, v_buffer.shape)
    nq, hq, d = q.shape
    slots, hkv, dk = k_buffer.shape
    assert dk == d, (q.shape, k_buffer.shape)
    assert v_buffer.shape[:2] == (slots, hkv), (k_buffer.shape, v_buffer.shape)
    assert hq % hkv == 0, (hq, hkv)
    assert q.dtype == k_buffer.dtype == v_buffer.dtype, (q.dtype, k_buffer.dtype, v_buffer.dtype)
    dv = v_buffer.shape[2]
    nreq = q_indptr.numel() - 1
    assert kv_indptr.numel() == nreq + 1, (q_indptr.shape, kv_indptr.shape)
    assert kv_pos.numel() == kv_indices.numel(), (kv_pos.shape, kv_indices.shape)
    assert q_pos.numel() == nq, (q_pos.shape, q.shape)

    if out is None:
        out = torch.zeros((nq, hq, dv), dtype=q.dtype, device=q.device)
    else:
        assert out.shape == (nq, hq, dv) and out.dtype == q.dtype, (out.shape, out.dtype)
    max_q_len = int(max_q_len)
    if nreq <= 0 or nq == 0 or max_q_len <= 0:
        return out

    if sinks is not None:
        assert sinks.numel() == hq, (sinks.shape, q.shape)
        sinks = sinks.contiguous()
    q_pos = q_pos.contiguous()
    q_indptr = q_indptr.contiguous()
    kv_indptr = kv_indptr.contiguous()
    kv_indices = kv_indices.contiguous()
    kv_pos = kv_pos.contiguous()
    # The interpreter multiplies bf16 tiles as their raw 16-bit patterns: upcast to fp32 there
    # (and it narrows fp32 to bf16 by truncation: ROUND_BF16 rounds first).
    upcast = INTERPRETED and q.dtype == torch.bfloat16
    prec = "ieee" if (upcast or q.dtype == torch.float32) else "tf32"
    on_gpu = q.device.type == "cuda"
    if block_m is None:
        block_m = 64 if on_gpu else 16
    if block_n is None:
        block_n = (64 if max(d, dv) <= 128 else 32) if on_gpu else 32

    use_cap = float(logit_cap) > 0
    grid = (nreq, hq, triton.cdiv(max_q_len, block_m))
    extra = dict(num_warps=num_warps, num_stages=num_stages) if on_gpu else {}
    _positional_attention_kernel[grid](
        q, q_pos, q_indptr, k_buffer, v_buffer, kv_indptr, kv_indices, kv_pos,
        sinks if sinks is not None else q_pos, out,  # any pointer when there is no sink
        q.stride(0), q.stride(1), q.stride(2),
        k_buffer.stride(0), k_buffer.stride(1), k_buffer.stride(2),
        v_buffer.stride(0), v_buffer.stride(1), v_buffer.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        float(sm_scale), int(window) if window >= 0 else 0, float(logit_cap) if use_cap else 1.0,
        GROUP=hq // hkv, D=d, DV=dv,
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        BLOCK_M=block_m, BLOCK_N=block_n,
        USE_WINDOW=window >= 0, USE_CAP=use_cap, KV_SORTED=bool(kv_sorted),
        HAS_SINK=sinks is not None, UPCAST=upcast, PREC=prec,
        ROUND_BF16=INTERPRETED and out.dtype == torch.bfloat16,
        **extra,
    )
    return out
