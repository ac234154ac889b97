"""Block-sparse prefill attention: the block estimate, the exact restricted attention, the density.

One request's prefill chunk: ``n_q`` queries against ``n_k`` keys, query ``i`` sitting at key
position ``q_offset + i`` (default ``q_offset = n_k - n_q``: the chunk's queries are the last
keys, bottom-right aligned as chunked prefill has them; the keys before are the prefix's).
Causal: query ``i`` sees the keys at positions ``<= q_offset + i``.  GQA: q ``[n_q, Hq, D]``,
k ``[n_k, Hkv, D]``, v ``[n_k, Hkv, Dv]``, query head ``h`` reads kv head ``h // (Hq // Hkv)``.

Blocks.  Keys and queries are cut into blocks of ``block_size`` aligned on key positions: key
block ``c`` holds positions ``[c * B, (c + 1) * B)`` and so does query block ``a``.  A query
block's diagonal key block therefore has its own index, the causal key blocks of query block
``a`` are exactly ``0..a`` (each holds a key some query of the block sees) and every later one
is entirely in its future.  A chunk that starts mid-block (``q_offset % B != 0``) has a
partial first query block; the last blocks may be partial too.  Mask rows are the chunk's
query blocks ``q_offset // B ..``, columns all ``ceil(n_k / B)`` key blocks.

The estimate (as MInference's and FlexPrefill's pooled estimates, with XAttention's
cumulative-mass threshold): each query block's queries and each key block's keys are
mean-pooled; per query head, the logits ``pooled_q . pooled_k * sm_scale`` plus ``log`` of the
number of the block's keys the query block may see (a block's mass is then that of its keys
each scored as the pooled key) go through a softmax over the causal key blocks; the heads of a
KV group average their distributions.  With ``block_size = 1`` it is the exact attention.
The other estimate (``last_query_block_mass``, ``block_mask_reference(estimate=...)``) scores
key blocks by the exact attention of the chunk's last queries instead, or with it.

The mask is per KV head (``[Hkv, R, C]``): the heads of a group read the same K/V, so they
share one key-block list (FlashInfer's variable-block wrapper takes one per KV head too), and
groups attend differently.
``per_kv_head=False`` averages every head instead and returns one shared ``[1, R, C]`` mask.

Selection, per (KV head, query block), among its causal key blocks:

* always kept: the sink blocks (the first ``sink_blocks`` key blocks: attention sinks hold
  much of every row's mass whatever the content), the local blocks (the diagonal block and
  the ``local_blocks - 1`` before it: recent context, and the diagonal holds each query's own
  key, so no row is ever fully masked and the output is never NaN), and, for the chunk's last ``last_blocks`` query blocks, every causal block (the
  prompt's last tokens produce the first output token; pass it only on a request's last chunk);
* ``top_p``: then blocks in descending estimated mass (ties: lower index first) until the kept
  mass reaches ``top_p``: the smallest set holding the always-kept blocks whose mass reaches it
  (the block that crosses ``top_p`` is kept); ``top_p >= 1`` keeps every causal block;
* ``density``: then the highest others until ``ceil(density * n_causal)`` blocks are kept
  (the rounding of keep ratios, ``reference.num_blocks_for_ratio``: at least one, a relative
  slack of ``RATIO_EPS`` absorbs the float error of the ratio), or only the always-kept ones
  when they are more.  This fixed-density mode is the stand-in for speed runs on random
  weights, whose estimate does not concentrate, as keep ratios are for token dropping.

Integration notes (the engine's side, not done here):

* chunked prefill: the prefix's keys are the mask's first columns (``q_offset`` = prefix
  length); the radix cache's prefix KV is complete, so nothing a later request reads is lost;
* the staged layout: a later stage's survivors attend over that stage's KV, whose positions are
  no longer contiguous; blocks are then cut over the stage's entries, not positions (entries
  keep position order, so the causal mask carries over);
* kernels: on Hopper prefer FlashInfer's ``VariableBlockSparseAttentionWrapper`` (a
  ``block_mask_map`` per KV head, row and column block sizes per head, so a partial first
  query block is a shorter row) or ``BlockSparseAttentionWrapper`` (one BSR layout for every
  head, i.e. the shared mask, and rows of one size, i.e. ``q_offset % B == 0``) fed with
  ``block_lists_from_mask``'s CSR; ``block_sparse_triton`` is the portable kernel (it reads
  ``block_rows_from_mask``'s padded lists, which need no host sync).  Those
  wrappers gather each row's kept key blocks and apply ``causal`` bottom-right over the
  gathered keys; with blocks aligned on key positions that is the true mask, since a row's
  last gathered block is its diagonal and ends at its last query (bottom-right chunk).  Check
  a wrapper's answer against ``block_sparse_attention_reference`` before trusting it.
  Sliding-window layers stay dense.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .reference import RATIO_EPS

F64 = torch.float64
# The block estimates `block_mask_reference` takes (its docstring), and how many of the chunk's
# last queries the "last_queries" estimate reads unless told (the drop's default window).
ESTIMATES = ("pooled", "last_queries", "both")
DEFAULT_ESTIMATE_LAST_QUERIES = 128


def _check_int(name: str, value, lowest: int) -> int:
    if isinstance(value, bool) or int(value) != value or value < lowest:
        raise ValueError(f"{name} must be an int >= {lowest}, got {value!r}")
    return int(value)


def resolve_q_offset(n_q: int, n_k: int, q_offset: Optional[int]) -> int:
    """The key position of the first query (``n_k - n_q`` by default), checked to fit."""
    if n_q > n_k:
        raise ValueError(f"more queries than keys: n_q={n_q} > n_k={n_k} (the queries are keys too)")
    if q_offset is None:
        return n_k - n_q
    q_offset = _check_int("q_offset", q_offset, 0)
    if q_offset + n_q > n_k:
        raise ValueError(f"queries past the keys: q_offset={q_offset} + n_q={n_q} > n_k={n_k}")
    return q_offset


def block_grid(n_q: int, n_k: int, block_size: int, q_offset: Optional[int] = None) -> Tuple[int, int, int]:
    """(first query block's key-block index ``a0``, query blocks ``R``, key blocks ``C``) of a chunk."""
    block_size = _check_int("block_size", block_size, 1)
    q_offset = resolve_q_offset(n_q, n_k, q_offset)
    if n_q == 0:
        return q_offset // block_size, 0, -(-n_k // block_size)
    a0 = q_offset // block_size
    a_last = (q_offset + n_q - 1) // block_size
    return a0, a_last - a0 + 1, -(-n_k // block_size)


def causal_block_pairs(n_q: int, n_k: int, block_size: int, q_offset: Optional[int] = None,
                       device: Optional[torch.device] = None) -> torch.Tensor:
    """bool ``[R, C]`` on ``device`` (default the CPU): key block ``c`` is causal for query row
    ``r`` iff ``c <= a0 + r``.  Built where it is used: a host tensor copied to a device waits
    for the device's stream first."""
    a0, nr, nc = block_grid(n_q, n_k, block_size, q_offset)
    diag = a0 + torch.arange(nr, device=device)
    return torch.arange(nc, device=device)[None, :] <= diag[:, None]


def _pool_rows(x: torch.Tensor, first_pos: int, block_size: int, n_blocks: int, first_block: int,
               dtype: torch.dtype = F64) -> torch.Tensor:
    """Mean of the rows of each block: x ``[n, H, D]`` whose row ``i`` sits at ``first_pos + i``;
    block ``b`` (``first_block + b`` absolute) -> ``[H, n_blocks, D]`` in ``dtype``."""
    n, h, d = x.shape
    if first_pos == first_block * block_size and n > 0:
        # Block-aligned rows (the keys, and most chunks): sums over a view, accumulated in
        # `dtype` without a copy of x in it (at 131K keys a float64 one is 1 GB per layer).
        full = n // block_size
        sums = torch.zeros(n_blocks, h, d, dtype=dtype, device=x.device)
        sums[:full] = x[:full * block_size].reshape(full, block_size, h, d).sum(1, dtype=dtype)
        if full * block_size < n:
            sums[full] = x[full * block_size:].sum(0, dtype=dtype)
        counts = (n - torch.arange(n_blocks, device=x.device) * block_size).clamp(1, block_size)
    else:
        blk = (first_pos + torch.arange(n, device=x.device)) // block_size - first_block
        sums = torch.zeros(n_blocks, h, d, dtype=dtype, device=x.device)
        sums.index_add_(0, blk, x.to(dtype))
        counts = torch.bincount(blk, minlength=n_blocks).clamp_min(1)
    return (sums / counts.to(dtype)[:, None, None]).transpose(0, 1)


def check_qk_shapes(q: torch.Tensor, k: torch.Tensor) -> Tuple[int, int, int, int]:
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q and k must be [tokens, heads, dim], got {tuple(q.shape)} and {tuple(k.shape)}")
    n_q, hq, d = q.shape
    n_k, hkv, dk = k.shape
    if dk != d:
        raise ValueError(f"q and k head dims differ: {d} != {dk}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    return n_q, n_k, hq, hkv


def block_mass_estimate(
    q: torch.Tensor,
    k: torch.Tensor,
    block_size: int,
    sm_scale: Optional[float] = None,
    q_offset: Optional[int] = None,
    per_kv_head: bool = True,
    dtype: torch.dtype = F64,
) -> torch.Tensor:
    """Estimated attention mass of each key block for each query block (module docstring).

    Returns ``[Hkv or 1, R, C]`` in ``dtype`` (float64 for an oracle; float32 on a GPU, where
    float64 work runs at a fraction of the rate); each row sums to 1 over its causal blocks, 0
    elsewhere.
    """
    n_q, n_k, hq, hkv = check_qk_shapes(q, k)
    a0, nr, nc = block_grid(n_q, n_k, block_size, q_offset)
    q_offset = resolve_q_offset(n_q, n_k, q_offset)
    if sm_scale is None:
        sm_scale = q.shape[2] ** -0.5
    pq = _pool_rows(q, q_offset, block_size, nr, a0, dtype)  # [Hq, R, D]
    pk = _pool_rows(k, 0, block_size, nc, 0, dtype)  # [Hkv, C, D]
    pk = pk.repeat_interleave(hq // hkv, dim=0)  # [Hq, C, D]
    logits = torch.matmul(pq, pk.transpose(1, 2)) * float(sm_scale)  # [Hq, R, C]

    # keys of block c a query block may see: up to its last query (the diagonal partly)
    dev = logits.device
    last_query = torch.clamp((a0 + torch.arange(nr, device=dev) + 1) * block_size, max=q_offset + n_q) - 1
    key_start = torch.arange(nc, device=dev) * block_size
    key_end = torch.clamp(key_start + block_size, max=n_k)
    seen = (torch.minimum(key_end[None, :], last_query[:, None] + 1) - key_start[None, :]).clamp_min(0)
    causal = causal_block_pairs(n_q, n_k, block_size, q_offset, device=dev)
    logits = logits + torch.log(seen.to(logits.dtype).clamp_min(1.0))
    logits = logits.masked_fill(~causal, float("-inf"))
    probs = torch.softmax(logits, dim=-1) if nr else logits.new_zeros(logits.shape)
    if per_kv_head:
        return probs.reshape(hkv, hq // hkv, nr, nc).mean(dim=1)
    return probs.mean(dim=0, keepdim=True)


def last_query_block_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    block_size: int,
    last_queries: int,
    sm_scale: Optional[float] = None,
    q_offset: Optional[int] = None,
    per_kv_head: bool = True,
    dtype: torch.dtype = F64,
) -> torch.Tensor:
    """The "last_queries" estimate: key blocks scored by the exact attention of the chunk's
    last queries (MInference's and FlexPrefill's vertical pattern: what the prompt's end, the
    question, reads is kept for every query block).

    The last ``min(last_queries, n_q)`` query rows' causal softmax attention over every key,
    in ``dtype`` (float64 for an oracle; float32 on a GPU, where float64 matmuls run at a small
    fraction of the rate), summed per key block and averaged over those queries and the query heads of a
    KV group (of every head with ``per_kv_head=False``); each query block's row is that
    distribution restricted to its causal blocks (``0..a0 + r``) and renormalised to 1 (a row
    whose causal blocks got no mass is uniform over them).  Returns float64 ``[Hkv or 1, R,
    C]``, the layout of ``block_mass_estimate``.  Unlike the pooled estimate, a single key
    holding the last queries' attention keeps its block however diluted among the block's
    other keys; rows far from the end lose what only they attend to (their own local context
    is kept as the local blocks).  Work: ``Hq * last_queries * n_k`` logits, one KV group at a
    time (its query heads' rows in one matmul).
    """
    n_q, n_k, hq, hkv = check_qk_shapes(q, k)
    last_queries = _check_int("last_queries", last_queries, 1)
    a0, nr, nc = block_grid(n_q, n_k, block_size, q_offset)
    q_offset = resolve_q_offset(n_q, n_k, q_offset)
    if sm_scale is None:
        sm_scale = q.shape[2] ** -0.5
    heads = hkv if per_kv_head else 1
    if nr == 0:
        return torch.zeros(heads, 0, nc, dtype=F64, device=q.device)
    m = min(last_queries, n_q)
    qpos = q_offset + torch.arange(n_q - m, n_q, device=q.device)
    key_pos = torch.arange(n_k, device=q.device)
    future = key_pos[None, :] > qpos[:, None]  # [m, n_k]
    key_block = key_pos // block_size
    group = hq // hkv
    col_mass = torch.zeros(hkv, group, nc, dtype=F64, device=q.device)
    for g in range(hkv):
        q_group = q[n_q - m:, g * group:(g + 1) * group].transpose(0, 1).to(dtype)  # [group, m, D]
        logits = torch.matmul(q_group, k[:, g].to(dtype).T) * float(sm_scale)  # [group, m, n_k]
        probs = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)
        col_mass[g].index_add_(1, key_block, probs.sum(1).to(F64))
    col_mass = col_mass.reshape(hq, nc) / m
    col_mass = col_mass.reshape(hkv, group, nc).mean(1) if per_kv_head else col_mass.mean(0, keepdim=True)
    causal = causal_block_pairs(n_q, n_k, block_size, q_offset, device=q.device)  # [R, C]
    rows = col_mass[:, None, :] * causal  # [H, R, C]
    total = rows.sum(-1, keepdim=True)
    uniform = causal.to(F64) / causal.sum(-1, keepdim=True)
    return torch.where(total > 0, rows / total.clamp_min(torch.finfo(F64).tiny), uniform.expand_as(rows))


def forced_blocks(
    n_q: int, n_k: int, block_size: int, sink_blocks: int, local_blocks: int, last_blocks: int = 0,
    q_offset: Optional[int] = None, device: Optional[torch.device] = None,
) -> torch.Tensor:
    """bool ``[R, C]`` on ``device`` (default the CPU): the blocks kept whatever the estimate
    (sinks, local, the last rows)."""
    sink_blocks = _check_int("sink_blocks", sink_blocks, 0)
    local_blocks = _check_int("local_blocks", local_blocks, 1)
    last_blocks = _check_int("last_blocks", last_blocks, 0)
    a0, nr, nc = block_grid(n_q, n_k, block_size, q_offset)
    causal = causal_block_pairs(n_q, n_k, block_size, q_offset, device=device)
    col = torch.arange(nc, device=device)[None, :]
    diag = (a0 + torch.arange(nr, device=device))[:, None]
    forced = (col < sink_blocks) | (col > diag - local_blocks)
    forced |= (torch.arange(nr, device=device) >= nr - last_blocks)[:, None]
    return forced & causal


def select_blocks(
    mass: torch.Tensor,
    forced: torch.Tensor,
    causal: torch.Tensor,
    top_p: Optional[float] = None,
    density: Optional[float] = None,
) -> torch.Tensor:
    """The kept blocks: ``forced`` plus, per row, the top-mass causal blocks by top_p or density.

    mass ``[H, R, C]``, forced and causal bool ``[R, C]``.  Exactly one of top_p (> 0) and
    density (in (0, 1]) is given.  Returns bool ``[H, R, C]`` (module docstring).
    """
    if (top_p is None) == (density is None):
        raise ValueError("give exactly one of top_p and density")
    if top_p is not None and not (float(top_p) > 0.0):
        raise ValueError(f"top_p must be > 0, got {top_p!r}")
    if density is not None and not (0.0 < float(density) <= 1.0):
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    h, nr, nc = mass.shape
    device = mass.device
    causal = causal.to(device).expand(h, nr, nc)
    forced = (forced.to(device) & causal).expand(h, nr, nc)
    if top_p is not None and float(top_p) >= 1.0:
        return causal.clone()
    # sort order: forced blocks first, then causal by descending mass, then the future (in
    # the mass's dtype: a float32 estimate is sorted as float32)
    priority = torch.where(forced, torch.full_like(mass, 3.0),
                           torch.where(causal, mass.clamp(0.0, 1.0), torch.full_like(mass, -1.0)))
    order = torch.sort(priority, dim=-1, descending=True, stable=True).indices
    causal_sorted = torch.gather(causal, -1, order)
    if top_p is not None:
        sorted_mass = torch.gather(mass.to(F64), -1, order) * causal_sorted
        mass_before = torch.cumsum(sorted_mass, -1) - sorted_mass
        keep_sorted = causal_sorted & (mass_before < float(top_p))
    else:
        # reference.num_blocks_for_ratio on every row at once (the same float64 arithmetic)
        n_causal = causal[0].sum(-1).to(F64)
        target = torch.ceil(float(density) * n_causal * (1.0 - RATIO_EPS))
        target = torch.minimum(target.clamp_min(1.0), n_causal).long()
        rank = torch.arange(nc, device=device)
        keep_sorted = causal_sorted & (rank[None, None, :] < target[None, :, None])
    keep = torch.zeros_like(causal)
    keep.scatter_(-1, order, keep_sorted)
    return keep | forced


def block_mask_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    block_size: int,
    *,
    top_p: Optional[float] = None,
    density: Optional[float] = None,
    sink_blocks: int = 1,
    local_blocks: int = 1,
    last_blocks: int = 0,
    sm_scale: Optional[float] = None,
    q_offset: Optional[int] = None,
    per_kv_head: bool = True,
    estimate: str = "pooled",
    last_queries: int = DEFAULT_ESTIMATE_LAST_QUERIES,
    estimate_dtype: torch.dtype = F64,
) -> torch.Tensor:
    """Which key blocks each query block reads: bool ``[Hkv or 1, R, C]`` (module docstring).

    q ``[n_q, Hq, D]`` and k ``[n_k, Hkv, D]`` post-RoPE; sm_scale defaults to ``D ** -0.5``.
    ``estimate`` (one of ``ESTIMATES``) scores the key blocks:

    * ``"pooled"``: ``block_mass_estimate`` (mean-pooled blocks);
    * ``"last_queries"``: ``last_query_block_mass`` over the chunk's last ``last_queries``
      queries;
    * ``"both"``: the union of the blocks each of the two selects under the same rule.  The
      union, not a mean of the two masses: every row then keeps ``top_p`` of each estimate's
      mass, so it is never less faithful than either alone (a block only the last queries
      attend to keeps its full weight instead of half of it, which a mean could let fall under
      the cut); it costs density, at most the sum of the two (twice ``density`` under the
      fixed-density rule).

    Either estimate works in ``estimate_dtype`` (float64 for an oracle, float32 on a GPU), and
    every mask is built on q's device.
    """
    n_q, n_k, _, _ = check_qk_shapes(q, k)
    if estimate not in ESTIMATES:
        raise ValueError(f"estimate must be one of {', '.join(ESTIMATES)}, got {estimate!r}")
    forced = forced_blocks(n_q, n_k, block_size, sink_blocks, local_blocks, last_blocks, q_offset,
                           device=q.device)
    causal = causal_block_pairs(n_q, n_k, block_size, q_offset, device=q.device)
    mask = None
    if estimate in ("pooled", "both"):
        mass = block_mass_estimate(q, k, block_size, sm_scale, q_offset, per_kv_head, estimate_dtype)
        mask = select_blocks(mass, forced, causal, top_p=top_p, density=density)
    if estimate in ("last_queries", "both"):
        mass = last_query_block_mass(q, k, block_size, last_queries, sm_scale, q_offset, per_kv_head,
                                     estimate_dtype)
        picked = select_blocks(mass, forced, causal, top_p=top_p, density=density)
        mask = picked if mask is None else mask | picked
    return mask


def block_density(mask: torch.Tensor, n_q: int, n_k: int, block_size: int,
                  q_offset: Optional[int] = None) -> float:
    """Fraction of the causal (head, query block, key block) pairs the mask keeps (1.0 when
    there are none); what a request reports as its block-sparse density."""
    causal = causal_block_pairs(n_q, n_k, block_size, q_offset)
    check_block_mask(mask, causal.shape)
    total = int(causal.sum()) * mask.shape[0]
    if total == 0:
        return 1.0
    return float((mask.cpu() & causal).sum()) / total


def check_qkv_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Tuple[int, int, int, int]:
    """``check_qk_shapes``, and v ``[n_k, Hkv, Dv]`` like k."""
    shapes = check_qk_shapes(q, k)
    if v.dim() != 3 or v.shape[:2] != k.shape[:2]:
        raise ValueError(f"v must be [n_k, Hkv, Dv] like k, got {tuple(v.shape)} and {tuple(k.shape)}")
    return shapes


def check_block_mask(mask: torch.Tensor, grid: Tuple[int, int], hkv: Optional[int] = None) -> None:
    if mask.dtype != torch.bool or mask.dim() != 3 or tuple(mask.shape[1:]) != tuple(grid):
        raise ValueError(f"mask must be bool [H, {grid[0]}, {grid[1]}], got {mask.dtype} {tuple(mask.shape)}")
    if hkv is not None and mask.shape[0] not in (1, hkv):
        raise ValueError(f"mask heads must be 1 or the kv heads ({hkv}), got {mask.shape[0]}")


def _mask_rows(mask: torch.Tensor) -> torch.Tensor:
    """A bool mask ``[H, R, C]`` as its list rows ``[H * R, C]`` (row ``h * R + r``)."""
    if mask.dtype != torch.bool or mask.dim() != 3:
        raise ValueError(f"mask must be bool [H, R, C], got {mask.dtype} {tuple(mask.shape)}")
    return mask.reshape(mask.shape[0] * mask.shape[1], mask.shape[2])


def block_lists_from_mask(mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The mask as compact key-block lists (CSR, the layout of FlashInfer's BSR ``indptr`` and
    ``indices``): row ``h * R + r`` lists mask head ``h``'s kept key blocks for query block
    ``r`` in ascending order.  Returns (indptr int32 ``[H * R + 1]``, indices int32).
    One host sync (``nonzero``)."""
    rows = _mask_rows(mask)
    indptr = torch.zeros(rows.shape[0] + 1, dtype=torch.int32, device=mask.device)
    indptr[1:] = torch.cumsum(rows.sum(-1), 0)
    indices = rows.nonzero()[:, 1].to(torch.int32)  # row-major: rows in order, columns ascending
    return indptr, indices


def block_rows_from_mask(mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mask as padded key-block lists, built on the device without a host sync (the CSR's
    ``nonzero`` waits for the estimate; in a served forward that stalls every layer).

    Row ``h * R + r`` (mask head ``h``, query block ``r``) owns the slice
    ``indices[starts[row]:ends[row]]``: its kept key blocks, ascending.  Every row is given
    ``C`` entries (``starts = row * C``), the kept ones first, so the size is known before the
    mask is.  Returns (starts, ends int32 ``[H * R]``, indices int32 ``[H * R * C]``)."""
    rows = _mask_rows(mask)
    # a stable ascending sort of "dropped" puts each row's kept columns first, in column order
    order = torch.sort((~rows).to(torch.uint8), dim=-1, stable=True).indices
    starts = torch.arange(rows.shape[0], dtype=torch.int32, device=mask.device) * rows.shape[1]
    ends = starts + rows.sum(-1, dtype=torch.int32)
    return starts, ends, order.to(torch.int32).reshape(-1)


def block_sparse_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    block_size: int,
    sm_scale: float,
    causal: bool = True,
    q_offset: Optional[int] = None,
    row_chunk: int = 256,
    compute_dtype: torch.dtype = F64,
) -> torch.Tensor:
    """Exact attention of the chunk's queries over the key blocks ``mask`` keeps, in float64.

    mask ``[Hkv or 1, R, C]`` bool as ``block_mask_reference`` returns it; query ``i`` reads key
    ``t`` iff its mask row keeps ``t``'s block and, when ``causal``, ``t <= q_offset + i`` (the
    token-level mask inside diagonal blocks).  Returns ``[n_q, Hq, Dv]`` in ``compute_dtype``
    (float64 for an oracle; float32 is the CPU production path's); a row that reads no key is
    zero.  ``row_chunk`` query rows are done at a time (memory ``Hq * row_chunk * n_k`` floats).
    """
    n_q, n_k, hq, hkv = check_qkv_shapes(q, k, v)
    a0, nr, nc = block_grid(n_q, n_k, block_size, q_offset)
    q_offset = resolve_q_offset(n_q, n_k, q_offset)
    check_block_mask(mask, (nr, nc), hkv)
    group = hq // hkv
    mask = mask.to(q.device)
    mask_head = torch.arange(hq, device=q.device) // group if mask.shape[0] == hkv else \
        torch.zeros(hq, dtype=torch.long, device=q.device)
    keys = k.to(compute_dtype).repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, n_k, D]
    values = v.to(compute_dtype).repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, n_k, Dv]
    key_pos = torch.arange(n_k, device=q.device)
    key_block = key_pos // block_size
    out = torch.zeros(n_q, hq, v.shape[2], dtype=compute_dtype, device=q.device)
    for i0 in range(0, n_q, row_chunk):
        i1 = min(n_q, i0 + row_chunk)
        qpos = q_offset + torch.arange(i0, i1, device=q.device)
        rows = mask[:, qpos // block_size - a0][:, :, key_block]  # [Hm, m, n_k]
        allowed = rows[mask_head]  # [Hq, m, n_k]
        if causal:
            allowed = allowed & (key_pos[None, :] <= qpos[:, None])[None]
        logits = torch.matmul(q[i0:i1].to(compute_dtype).transpose(0, 1), keys.transpose(1, 2)) * float(sm_scale)
        logits = logits.masked_fill(~allowed, float("-inf"))
        row_max = logits.amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        weights = torch.exp(logits - row_max)
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / torch.where(total > 0, total, torch.ones_like(total))
        out[i0:i1] = torch.matmul(weights, values).transpose(0, 1)
    return out


def block_sparse_attention_gathered(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    block_size: int,
    sm_scale: float,
    causal: bool = True,
    q_offset: Optional[int] = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """What ``block_sparse_attention_reference`` computes, with work in proportion to the
    density: the torch path of ``kernels.block_sparse_attention`` (the CPU engine's).

    Per query block, each mask head's kept key blocks are gathered (padded to the head that
    keeps most) and the block's queries attend over them in one ``scaled_dot_product_attention``
    whose bool mask covers the padding and, when ``causal``, the keys past each query; a row
    that reads no key is zero.  The reference instead scores every key of every row and masks
    afterwards (its cost is dense attention's whatever the mask, several times over on a CPU:
    15 s against 2.6 s here for one 7.6K-token layer of SmolLM2's shape on one core).
    Returns ``[n_q, Hq, Dv]`` in ``compute_dtype``.
    """
    n_q, n_k, hq, hkv = check_qkv_shapes(q, k, v)
    a0, nr, nc = block_grid(n_q, n_k, block_size, q_offset)
    q_offset = resolve_q_offset(n_q, n_k, q_offset)
    check_block_mask(mask, (nr, nc), hkv)
    hm, group = mask.shape[0], hq // hkv
    mask = mask.to(q.device)
    out = torch.zeros(n_q, hq, v.shape[2], dtype=compute_dtype, device=q.device)
    within = torch.arange(block_size, device=q.device)
    kv_heads = torch.arange(hkv, device=q.device)[:, None]
    counts = mask.sum(-1)  # [Hm, R]
    widths = counts.amax(0).tolist() if nr else []  # one host read
    # each (mask head, query block)'s kept key blocks first, ascending: a stable sort of "not kept"
    order = torch.sort((~mask).to(torch.int8), dim=-1, stable=True).indices
    for r in range(nr):
        i0 = max(0, (a0 + r) * block_size - q_offset)
        i1 = min(n_q, (a0 + r + 1) * block_size - q_offset)
        width = widths[r]
        if i1 <= i0 or width == 0:
            continue  # no query here, or no key read: zeros
        pos = (order[:, r, :width, None] * block_size + within).reshape(hm, -1)  # [Hm, W*B]
        ok = torch.arange(width, device=q.device)[None, :] < counts[:, r, None]
        ok = ok[:, :, None].expand(hm, width, block_size).reshape(hm, -1) & (pos < n_k)
        pos = pos.clamp(max=n_k - 1)
        if hm == hkv:
            keys, values = k[pos, kv_heads], v[pos, kv_heads]  # [Hkv, W*B, D]
        else:  # one mask for every head
            keys, values = k[pos[0]].transpose(0, 1), v[pos[0]].transpose(0, 1)
        allowed = ok[:, None, :]  # [Hm, m, W*B]
        if causal:
            qpos = q_offset + torch.arange(i0, i1, device=q.device)
            allowed = allowed & (pos[:, None, :] <= qpos[None, :, None])
        queries = q[i0:i1].to(compute_dtype).transpose(0, 1).reshape(hkv, group, i1 - i0, -1)
        o = torch.nn.functional.scaled_dot_product_attention(
            queries, keys.to(compute_dtype)[:, None], values.to(compute_dtype)[:, None],
            attn_mask=allowed[:, None], scale=float(sm_scale))  # [Hkv, group, m, Dv]
        o = torch.where(allowed.any(-1)[:, None, :, None], o, o.new_zeros(()))  # no NaN rows
        out[i0:i1] = o.reshape(hq, i1 - i0, -1).transpose(0, 1)
    return out
