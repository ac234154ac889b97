"""UniPrefill kernels: token scoring, block top-p selection, attention masked by positions.

Public API (installed as ``uniprefill_sglang.kernels``):

* ``score_tokens(q, q_pos, q_indptr, k_cache, k_slots, k_pos, k_indptr, sm_scale, max_q=None, max_k=None, out=None)``
* ``select_tokens(scores, k_pos, k_indptr, cand_start, block_size, top_p, keep_ratio, sink_tokens, last_window)``
  and ``select_token_mask(...)`` (the same arguments; the kept candidates as a mask, no host sync)
* ``positional_attention(q, q_pos, q_indptr, k_buffer, v_buffer, kv_indptr, kv_indices, kv_pos, sm_scale, window=-1, logit_cap=0.0, max_q_len=None, out=None, sinks=None)``
  (the Triton launcher, ``positional_triton.positional_attention_triton``, reads no device
  tensor on the host: it can be captured in a CUDA graph; the float64 reference is
  ``positional_reference.positional_attention_reference``)
* ``block_sparse_attention(q, k, v, mask, block_size, sm_scale, causal=True, q_offset=None)``:
  one prefill chunk's attention over the key blocks a bool ``mask [Hkv or 1, R, C]`` keeps
  (the Triton kernel is ``block_sparse_triton.block_sparse_attention_triton``, the torch path
  ``block_sparse_reference.block_sparse_attention_gathered`` in float32, which gathers each
  query block's kept key blocks, and the oracle ``block_sparse_attention_reference`` in
  float64, which masks dense attention); the mask comes from
  ``block_mask_reference`` (pooled estimate, or ``last_query_block_mass``'s exact attention of
  the chunk's last queries, or both; top_p or fixed density, sink and local blocks)
  and ``block_density`` is the fraction of causal block pairs it keeps

Dispatch, by each function's ``path`` argument: ``None`` takes Triton when the tensors are on
CUDA and the torch reference otherwise; ``"triton"`` forces Triton (CPU tensors then need
``TRITON_INTERPRET=1`` set before triton is imported); ``"reference"`` forces the reference.
The kernels read no switch themselves: the package's callers pass the one its environment
asks for (``environ.kernel_path()``: ``UNIPREFILL_FORCE_REFERENCE``, ``UNIPREFILL_FORCE_TRITON``).
The Triton modules are imported lazily, on first use.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .block_sparse_reference import (
    ESTIMATES,
    block_density,
    block_lists_from_mask,
    block_mask_reference,
    block_mass_estimate,
    block_rows_from_mask,
    block_sparse_attention_gathered,
    block_sparse_attention_reference,
    last_query_block_mass,
)
from .positional_reference import positional_attention_reference
from .reference import (
    RATIO_EPS,
    block_scores_reference,
    num_blocks_for_ratio,
    num_blocks_for_top_p,
    score_segment_reference,
    score_tokens_reference,
    select_segment_reference,
    select_tokens_reference,
)

__all__ = [
    "score_tokens",
    "select_tokens",
    "select_token_mask",
    "positional_attention",
    "block_sparse_attention",
    "use_triton",
    "PATHS",
    "positional_attention_reference",
    "block_mask_reference",
    "block_mass_estimate",
    "last_query_block_mass",
    "ESTIMATES",
    "block_density",
    "block_lists_from_mask",
    "block_rows_from_mask",
    "block_sparse_attention_gathered",
    "block_sparse_attention_reference",
    "score_tokens_reference",
    "select_tokens_reference",
    "score_segment_reference",
    "select_segment_reference",
    "block_scores_reference",
    "num_blocks_for_ratio",
    "num_blocks_for_top_p",
    "RATIO_EPS",
]


# What a kernel's ``path`` argument may ask for (None: by the tensors' device).
PATHS = ("triton", "reference")


def use_triton(device: torch.device, path: Optional[str] = None) -> bool:
    """Whether the Triton path is used for tensors on ``device`` under ``path``."""
    if path is None:
        return device.type == "cuda"
    if path not in PATHS:
        raise ValueError(f"kernel path {path!r}: expected None or one of {', '.join(PATHS)}")
    return path == "triton"


def score_tokens(
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
    path: Optional[str] = None,
) -> torch.Tensor:
    """Per-key attention mass from each segment's last queries.

    q:        [Nq, Hq, D] bf16/fp16/fp32, post-RoPE scoring queries of B segments, concatenated.
    q_pos:    [Nq] int32/int64, original positions of the queries.
    q_indptr: [B+1] int32/int64, segment b's queries are q[q_indptr[b]:q_indptr[b+1]] (may be empty).
    k_cache:  [S, Hkv, D] key buffer indexed by slot; Hq % Hkv == 0.
    k_slots:  [Nk] int32/int64, k_cache row of each key; segment b's keys are k_indptr[b]:k_indptr[b+1].
    k_pos:    [Nk] int32/int64, key j is visible to query i iff k_pos[j] <= q_pos[i].
    sm_scale: softmax scale (usually 1/sqrt(D)).
    max_q / max_k: optional host ints >= the longest segment's query / key count
              (computed with one .item() sync each when omitted).  Must not be too small.
    out:      optional preallocated fp32 [Nk] output (contiguous).
    path:     None, "triton" or "reference" (the module's docstring).
    Returns fp32 [Nk]: scores[j] = sum over the queries of j's segment and all Hq heads of
    softmax over the visible keys of that segment, evaluated at j.  Rows with no visible key
    contribute nothing; segments with no query give zeros.
    """
    if use_triton(k_cache.device, path):
        from .score_triton import score_tokens_triton

        return score_tokens_triton(q, q_pos, q_indptr, k_cache, k_slots, k_pos, k_indptr, sm_scale,
                                   max_q=max_q, max_k=max_k, out=out)
    res = score_tokens_reference(q, q_pos, q_indptr, k_cache, k_slots, k_pos, k_indptr, sm_scale,
                                 compute_dtype=torch.float32, kv_head_chunk=1)
    if out is not None:
        out.copy_(res)
        return out
    return res


def select_tokens(
    scores: torch.Tensor,
    k_pos: torch.Tensor,
    k_indptr: torch.Tensor,
    cand_start,
    block_size: int,
    top_p,
    keep_ratio,
    sink_tokens: int,
    last_window: int,
    path: Optional[str] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Choose which candidate keys survive, per segment.

    scores: fp32 [Nk] from score_tokens; k_pos, k_indptr as in score_tokens.
    cand_start: [B] int tensor (or int): per segment, offset relative to k_indptr[b] where the
        droppable candidates start; earlier keys (cached prefix) are neither candidates nor returned.
    block_size: candidates are grouped in consecutive blocks of this size from the first candidate
        (the last block may be partial).
    top_p, keep_ratio: fp32 [B] tensors (or floats).  keep_ratio[b] > 0: keep the
        ceil(keep_ratio * num_blocks) highest blocks (clamped to [1, num_blocks]; a relative slack of
        RATIO_EPS absorbs fp32 rounding of the ratio).  Else top-p: blocks sorted by score descending
        (ties: lower block index first), keep the smallest prefix whose normalised mass reaches p
        (crossing block kept, top block always kept); p >= 1, or a segment whose blocks all score 0,
        keeps every block.
    sink_tokens: candidates with k_pos < sink_tokens are always kept.
    last_window: the last `last_window` candidates of each segment are always kept.
    path: None, "triton" or "reference" (the module's docstring).
    Returns (keep_idx int64 [K_total]: ascending indices into the candidate rows enumerated across
    the batch (segment 0's candidates first); new_counts int32 [B]: kept candidates per segment).
    The Triton path does one host sync (torch.nonzero); `select_token_mask` does none.
    """
    if use_triton(scores.device, path):
        from .select_triton import select_tokens_triton

        return select_tokens_triton(scores, k_pos, k_indptr, cand_start, block_size, top_p, keep_ratio,
                                    sink_tokens, last_window)
    return select_tokens_reference(scores, k_pos, k_indptr, cand_start, block_size, top_p, keep_ratio,
                                   sink_tokens, last_window)


def select_token_mask(scores: torch.Tensor, k_pos: torch.Tensor, k_indptr: torch.Tensor, cand_start,
                      block_size: int, top_p, keep_ratio, sink_tokens: int, last_window: int,
                      path: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """`select_tokens` as a mask, without a host sync: (keep bool [Nk], entry c for candidate c
    enumerated across the batch as `select_tokens` numbers them, False past the last candidate;
    new_counts int32 [B])."""
    if use_triton(scores.device, path):
        from .select_triton import select_token_mask_triton

        return select_token_mask_triton(scores, k_pos, k_indptr, cand_start, block_size, top_p,
                                        keep_ratio, sink_tokens, last_window)
    keep_idx, counts = select_tokens_reference(scores, k_pos, k_indptr, cand_start, block_size, top_p,
                                               keep_ratio, sink_tokens, last_window)
    mask = torch.zeros(scores.numel(), dtype=torch.bool, device=scores.device)
    mask[keep_idx.to(scores.device)] = True
    return mask, counts.to(scores.device)


def positional_attention(
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
    max_q_len: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
    kv_sorted: bool = False,
    path: Optional[str] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of each request's queries over its keys, masked by original positions.

    q:          [Nq, Hq, D] bf16/fp16/fp32; request b owns the rows q_indptr[b]:q_indptr[b+1].
    q_pos:      [Nq] int32/int64, original positions of the query rows.
    q_indptr:   [B+1] int32/int64.
    k_buffer:   [S, Hkv, D], v_buffer [S, Hkv, Dv] in q's dtype: the KV pool by slot; Hq % Hkv == 0.
    kv_indptr:  [B+1] int32/int64; request b's keys are entries kv_indptr[b]:kv_indptr[b+1] of
    kv_indices: [Nk] int32/int64 (pool slots) and of
    kv_pos:     [Nk] int32/int64 (original positions, indexed like kv_indices).
    Key j is visible to query i iff kv_pos[j] <= q_pos[i] and (window < 0 or
    kv_pos[j] >= q_pos[i] - window).  logits = (q . k) * sm_scale, then
    logit_cap * tanh(logits / logit_cap) when logit_cap > 0; softmax over the visible keys.
    max_q_len:  host int >= every request's query rows; the Triton path computes it with one
                host sync when omitted (pass it to stay sync-free, e.g. under a CUDA graph).
    out:        optional preallocated [Nq, Hq, Dv] output in q's dtype.
    kv_sorted:  a promise that each request's kv_pos ascend: the Triton path then visits only
                the keys a query tile may see (the answer is the same).
    sinks:      optional [Hq] attention-sink logits (gpt-oss): each joins its head's softmax
                denominator, unscaled, with no value.
    path:       None, "triton" or "reference" (the module's docstring).
    Returns [Nq, Hq, Dv] in q's dtype; a row with no visible key is zero.
    """
    if use_triton(q.device, path):
        from .positional_triton import positional_attention_triton

        if max_q_len is None:
            max_q_len = int((q_indptr[1:] - q_indptr[:-1]).max().item()) if q_indptr.numel() > 1 else 0
        return positional_attention_triton(q, q_pos, q_indptr, k_buffer, v_buffer, kv_indptr, kv_indices,
                                           kv_pos, sm_scale, window, logit_cap, max_q_len=max_q_len,
                                           out=out, kv_sorted=kv_sorted, sinks=sinks)
    res = positional_attention_reference(q, q_pos, q_indptr, k_buffer, v_buffer, kv_indptr, kv_indices,
                                         kv_pos, sm_scale, window, logit_cap, sinks=sinks)
    if out is not None:
        out.copy_(res)
        return out
    return res


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    block_size: int,
    sm_scale: float,
    causal: bool = True,
    q_offset: Optional[int] = None,
    path: Optional[str] = None,
) -> torch.Tensor:
    """One request's prefill chunk attending only to the key blocks ``mask`` keeps.

    q [n_q, Hq, D], k [n_k, Hkv, D], v [n_k, Hkv, Dv]; query i sits at key position
    q_offset + i (default n_k - n_q); mask bool [Hkv or 1, R, C] over blocks of block_size
    aligned on key positions (see block_sparse_reference.py).  Returns [n_q, Hq, Dv] in q's
    dtype.  The Triton path needs a power-of-two block_size >= 16.  path: None, "triton" or
    "reference" (the module's docstring).
    """
    if use_triton(q.device, path):
        from .block_sparse_triton import block_sparse_attention_triton

        return block_sparse_attention_triton(q, k, v, mask, block_size, sm_scale, causal=causal, q_offset=q_offset)
    return block_sparse_attention_gathered(q, k, v, mask, block_size, sm_scale, causal=causal, q_offset=q_offset,
                                           compute_dtype=torch.float32).to(q.dtype)
