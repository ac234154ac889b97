"""Readable torch reference implementations of the UniPrefill selection ops.

These run on any device.  They are the production path on CPU and the oracle
for the Triton kernels in tests (call them with ``compute_dtype=torch.float64``).

Semantics (shared with the Triton path, see ``kernels/__init__.py``):

* ``score_tokens_reference``: per key, the attention mass paid to it by the
  scoring queries of its segment, summed over queries and all query heads.
* ``select_tokens_reference``: per segment, block top-p / keep-ratio selection
  over the candidate keys plus attention sinks and a trailing window.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

# Relative slack used when turning a keep ratio into a block count, so that a
# ratio given in fp32 (e.g. 0.3 -> 0.30000001192...) does not round up one block
# too many: k = ceil(ratio * num_blocks * (1 - RATIO_EPS)).  fp32 relative error
# is < 1.2e-7, well inside this slack.
RATIO_EPS = 1e-6


def _as_list(x) -> list:
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return list(x)


def _per_segment(x, n: int, dtype=float) -> list:
    """Broadcast a scalar or a length-n tensor/sequence to a python list."""
    if isinstance(x, torch.Tensor):
        if x.dim() == 0:
            return [dtype(x.item())] * n
        return [dtype(v) for v in x.tolist()]
    if isinstance(x, (int, float)):
        return [dtype(x)] * n
    return [dtype(v) for v in x]


# ---------------------------------------------------------------------------
# Scoring
# ---------------------------------------------------------------------------


def score_segment_reference(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    k_pos: torch.Tensor,
    sm_scale: float,
    compute_dtype: torch.dtype = torch.float32,
    kv_head_chunk: Optional[int] = None,
) -> torch.Tensor:
    """Scores of one segment.

    q: [n, Hq, D], q_pos: [n], k: [m, Hkv, D], k_pos: [m].
    Returns ``compute_dtype`` [m]: sum over queries and query heads of the causal
    softmax (keys with k_pos <= q_pos visible) evaluated at each key.
    ``kv_head_chunk`` bounds memory by materialising the [heads, n, m] score
    matrix for that many KV heads at a time (None: all heads at once).
    """
    n, hq, d = q.shape
    m, hkv, _ = k.shape
    out = torch.zeros(m, dtype=compute_dtype, device=k.device)
    if n == 0 or m == 0:
        return out
    assert hq % hkv == 0, (hq, hkv)
    group = hq // hkv
    qf = q.to(compute_dtype)
    kf = k.to(compute_dtype)
    visible = k_pos.view(1, m).to(torch.int64) <= q_pos.view(n, 1).to(torch.int64)  # [n, m]
    chunk = hkv if kv_head_chunk is None else max(1, int(kv_head_chunk))
    for h0 in range(0, hkv, chunk):
        h1 = min(hkv, h0 + chunk)
        # query head h reads kv head h // group
        qh = qf[:, h0 * group:h1 * group].permute(1, 0, 2)  # [c*G, n, D]
        kh = kf[:, h0:h1].permute(1, 0, 2).repeat_interleave(group, dim=0)  # [c*G, m, D]
        logits = torch.matmul(qh, kh.transpose(1, 2)) * sm_scale  # [c*G, n, m]
        logits = logits.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        # rows with no visible key are all -inf -> NaN after softmax: contribute 0
        probs = torch.where(visible.unsqueeze(0), probs, torch.zeros((), dtype=probs.dtype, device=probs.device))
        out += probs.sum(dim=(0, 1))
    return out


def score_tokens_reference(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    q_indptr: torch.Tensor,
    k_cache: torch.Tensor,
    k_slots: torch.Tensor,
    k_pos: torch.Tensor,
    k_indptr: torch.Tensor,
    sm_scale: float,
    compute_dtype: torch.dtype = torch.float32,
    kv_head_chunk: Optional[int] = None,
) -> torch.Tensor:
    """Batched reference of ``score_tokens`` (python loop over segments).

    Returns fp32 [Nk] (or ``compute_dtype`` if it is float64).
    """
    nk = k_slots.shape[0]
    out_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
    out = torch.zeros(nk, dtype=out_dtype, device=k_cache.device)
    qi = _as_list(q_indptr)
    ki = _as_list(k_indptr)
    for b in range(len(qi) - 1):
        q0, q1, k0, k1 = qi[b], qi[b + 1], ki[b], ki[b + 1]
        if q1 <= q0 or k1 <= k0:
            continue
        k = k_cache.index_select(0, k_slots[k0:k1].to(torch.int64))
        out[k0:k1] = score_segment_reference(
            q[q0:q1], q_pos[q0:q1], k, k_pos[k0:k1], sm_scale, compute_dtype, kv_head_chunk
        ).to(out_dtype)
    return out


# ---------------------------------------------------------------------------
# Selection
# ---------------------------------------------------------------------------


def block_scores_reference(cand_scores: torch.Tensor, block_size: int) -> torch.Tensor:
    """Sum consecutive runs of ``block_size`` candidate scores (last block may be partial)."""
    nc = cand_scores.shape[0]
    nb = (nc + block_size - 1) // block_size
    padded = torch.zeros(nb * block_size, dtype=cand_scores.dtype, device=cand_scores.device)
    padded[:nc] = cand_scores
    return padded.view(nb, block_size).sum(dim=1)


def num_blocks_for_ratio(keep_ratio: float, num_blocks: int) -> int:
    """ceil(keep_ratio * num_blocks), clamped to [1, num_blocks] (0 if there are no blocks)."""
    if num_blocks <= 0:
        return 0
    k = math.ceil(float(keep_ratio) * num_blocks * (1.0 - RATIO_EPS))
    return max(1, min(num_blocks, k))


def num_blocks_for_top_p(block_scores: torch.Tensor, top_p: float) -> Tuple[int, torch.Tensor]:
    """Top-p cut on one segment's block scores.

    Returns (k, order): ``order`` is the stable descending order of the blocks
    (ties: lower block index first) and the first ``k`` of them are kept: the
    smallest prefix whose cumulative normalised mass reaches ``top_p`` (the block
    crossing ``top_p`` is kept; the top block always is).  ``top_p >= 1`` or a
    segment with zero total mass keeps every block.
    """
    nb = block_scores.shape[0]
    order = torch.sort(block_scores, descending=True, stable=True).indices
    if nb == 0:
        return 0, order
    s = block_scores.to(torch.float64).clamp_min(0.0)
    total = s.sum().item()
    if top_p >= 1.0 or not (total > 0.0):
        return nb, order
    probs = s[order] / total
    exclusive = torch.cumsum(probs, 0) - probs  # mass strictly before each sorted block
    k = int((exclusive < top_p).sum().item())
    return max(1, min(nb, k)), order


def select_segment_reference(
    cand_scores: torch.Tensor,
    cand_pos: torch.Tensor,
    block_size: int,
    top_p: float,
    keep_ratio: float,
    sink_tokens: int,
    last_window: int,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Boolean keep mask over one segment's candidates; block scores summed in ``compute_dtype``
    (float32 as the Triton kernel does, float64 for a reference of the whole selection)."""
    nc = cand_scores.shape[0]
    keep = torch.zeros(nc, dtype=torch.bool, device=cand_scores.device)
    if nc == 0:
        return keep
    blocks = block_scores_reference(cand_scores.to(compute_dtype), block_size)
    nb = blocks.shape[0]
    if keep_ratio > 0:
        k = num_blocks_for_ratio(keep_ratio, nb)
        order = torch.sort(blocks, descending=True, stable=True).indices
    else:
        k, order = num_blocks_for_top_p(blocks, top_p)
    block_keep = torch.zeros(nb, dtype=torch.bool, device=keep.device)
    block_keep[order[:k]] = True
    keep = block_keep.repeat_interleave(block_size)[:nc]
    keep |= cand_pos.to(torch.int64) < sink_tokens
    if last_window > 0:
        keep[max(0, nc - last_window):] = True
    return keep


def select_tokens_reference(
    scores: torch.Tensor,
    k_pos: torch.Tensor,
    k_indptr: torch.Tensor,
    cand_start,
    block_size: int,
    top_p,
    keep_ratio,
    sink_tokens: int,
    last_window: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``select_tokens`` (python loop over segments).

    Returns (keep_idx int64 [K_total] into the batch-wide candidate rows, ascending;
    new_counts int32 [B]).
    """
    device = scores.device
    ki = _as_list(k_indptr)
    nseg = len(ki) - 1
    cs = _per_segment(cand_start, nseg, int)
    tp = _per_segment(top_p, nseg, float)
    kr = _per_segment(keep_ratio, nseg, float)
    keep_idx = []
    counts = []
    row0 = 0
    for b in range(nseg):
        c0 = ki[b] + max(0, cs[b])
        c1 = ki[b + 1]
        nc = max(0, c1 - c0)
        if nc == 0:
            counts.append(0)
            continue
        keep = select_segment_reference(
            scores[c0:c1], k_pos[c0:c1], int(block_size), tp[b], kr[b], int(sink_tokens), int(last_window)
        )
        idx = torch.nonzero(keep).squeeze(1) + row0
        keep_idx.append(idx)
        counts.append(int(idx.numel()))
        row0 += nc
    if keep_idx:
        keep_idx_t = torch.cat(keep_idx).to(torch.int64)
    else:
        keep_idx_t = torch.zeros(0, dtype=torch.int64, device=device)
    return keep_idx_t, torch.tensor(counts, dtype=torch.int32, device=device)

