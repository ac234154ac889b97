"""The drop's selection as one pure function: a batch's candidates in, its survivors out.

For each request that selects at a drop layer (a segment): its last queries attend causally to
its keys (the valid prefix, which is never dropped, then the candidates); a key's score is the
attention mass the queries pay it, summed over queries and heads; candidates are grouped into
blocks of `block_size`, and the top blocks are kept (the smallest set holding `top_p` of the
mass, or a fixed `keep_ratio` of the blocks), plus the attention sinks (positions below
`sink_tokens`) and the last `last_window` candidates; with `neighbor_blocks` N > 0 also the
candidate blocks on either side of the segment's N highest-scoring blocks, so that a needle cut
by a block boundary keeps both halves (off by default). What the drop lets go is measured the
same way: per segment, the share of its candidates' scores that falls on the candidates it drops
(`Selection.dropped_mass`; prefix keys are scored but are not candidates, so they count in
neither part).

`select_survivors` runs the kernels (Triton on CUDA, their torch references elsewhere) on the
whole batch; `select_survivors_reference`, for tests, runs the per-segment torch references in
float64 one request at a time (kernels/reference.py, where the rule is written once).
`select_by_position` (tests only, UNIPREFILL_TEST_SELECTION) keeps positions by a fixed rule
instead, so that attention backends can be compared over the same survivors.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, NamedTuple, Optional

import torch

from uniprefill_sglang import environ, kernels
from uniprefill_sglang.device import to_device


@dataclasses.dataclass
class DropCandidates:
    """One drop's scoring inputs, segment after segment (host lists are per segment)."""
    queries: torch.Tensor       # [Nq, Hq, D] post-RoPE queries
    query_pos: torch.Tensor     # [Nq] their original positions
    query_counts: List[int]
    key_slots: torch.Tensor     # [Nk] rows of the layer's key buffer
    key_pos: torch.Tensor       # [Nk] original positions
    key_counts: List[int]
    prefix_counts: List[int]    # leading keys of each segment that are not candidates
    top_p: List[float]
    keep_ratio: List[float]     # > 0: keep this fraction of the blocks; 0: top-p

    @property
    def num_segments(self) -> int:
        return len(self.key_counts)


@dataclasses.dataclass(frozen=True)
class SelectionRule:
    block_size: int
    sink_tokens: int
    last_window: int
    neighbor_blocks: int = 0


class Selection(NamedTuple):
    """One drop's selection, every tensor on the candidates' device."""
    keep_mask: torch.Tensor     # [C] bool: kept or not, per candidate numbered across the batch
    counts: torch.Tensor        # [B] int32: kept candidates per segment
    dropped_mass: torch.Tensor  # [B] float64 in [0, 1]: share of the segment's candidate
    # scores on the candidates it drops (0 when it drops none, or its candidates score 0)

    @property
    def keep_idx(self) -> torch.Tensor:
        """[K] int64: the kept candidates, ascending (one host sync on a GPU)."""
        return torch.nonzero(self.keep_mask).squeeze(1)


def _indptr(counts: List[int]) -> List[int]:
    out = [0]
    for n in counts:
        out.append(out[-1] + n)
    return out


def select_survivors(cands: DropCandidates, key_buffer: torch.Tensor, sm_scale: float,
                     rule: SelectionRule,
                     reduce_scores: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                     ) -> Selection:
    """Which candidates are kept (numbered across the batch, segment 0's candidates first,
    prefix keys not counted), kept candidates per segment, and the mass each segment lets go;
    no host sync. `reduce_scores` sums the per-token scores over tensor-parallel ranks, each of
    which scored with its own heads."""
    scores, keep, counts, rows = _score_and_select(cands, key_buffer, sm_scale, rule,
                                                   reduce_scores)
    return Selection(keep, counts, _dropped_mass(cands, scores, keep, rows))


def _candidate_rows(cands: DropCandidates, device):
    """(each candidate's segment, its key row, its index within its segment, the candidates
    per segment), numbered across the batch, from host-known counts only (no host sync)."""
    num = cands.num_segments
    cand_counts = [k - p for k, p in zip(cands.key_counts, cands.prefix_counts)]
    num_cands = sum(cand_counts)
    counts = to_device(cand_counts, torch.int64, device)
    segment = torch.repeat_interleave(torch.arange(num, device=device), counts,
                                      output_size=num_cands)
    # Candidate c of segment b is key row c + (prefix keys of segments 0..b).
    lead = to_device(_indptr(cands.prefix_counts)[1:], torch.int64, device)
    first = to_device(_indptr(cand_counts)[:-1], torch.int64, device)
    index = torch.arange(num_cands, device=device)
    return (segment, index + lead.index_select(0, segment),
            index - first.index_select(0, segment), counts)


def _dropped_mass(cands: DropCandidates, scores: torch.Tensor, keep: torch.Tensor,
                  candidate_rows=None):
    """Per segment: the candidates' scores on dropped candidates over all its candidates'
    scores, in float64, from host-known counts only (no host sync); `candidate_rows` is
    `_candidate_rows`' answer where the caller has it already."""
    sums = torch.zeros(2, cands.num_segments, dtype=torch.float64, device=scores.device)
    if keep.numel() == 0:
        return sums[0]
    segment, rows, _, _ = candidate_rows or _candidate_rows(cands, scores.device)
    cand_scores = scores.index_select(0, rows).to(torch.float64)
    cand_scores = torch.where(cand_scores > 0, cand_scores, 0.0)  # NaN counts as 0, as in select
    sums[0].index_add_(0, segment, cand_scores)
    sums[1].index_add_(0, segment, cand_scores * ~keep)
    total = sums[0].clamp_min(torch.finfo(torch.float64).tiny)
    return (sums[1] / total).clamp_(0.0, 1.0)


def select_by_position(cands: DropCandidates, rule: SelectionRule, stride: int = 2) -> Selection:
    """Test only (UNIPREFILL_TEST_SELECTION=positional): per segment, keep the candidates in
    every `stride`-th block of original positions (block k holds positions k * block_size ..),
    the sinks and the last `last_window` candidates, whatever the attention says. Every attention
    backend then keeps the same positions, so that what they compute after a drop can be
    compared exactly; the mass let go is reported as 0. No host sync."""
    device = cands.key_pos.device
    num = cands.num_segments
    segment, rows, index, cand_counts = _candidate_rows(cands, device)
    pos = cands.key_pos.index_select(0, rows)
    from_end = cand_counts.index_select(0, segment) - index  # 1 for a segment's last candidate
    keep = ((pos < rule.sink_tokens) | (from_end <= rule.last_window)
            | ((pos // rule.block_size) % stride == 0))
    counts = torch.zeros(num, dtype=torch.int32, device=device).index_add_(
        0, segment, keep.to(torch.int32))
    return Selection(keep, counts, torch.zeros(num, dtype=torch.float64, device=device))


def keep_top_neighbors(cands: DropCandidates, scores: torch.Tensor, keep: torch.Tensor,
                       rule: SelectionRule, candidate_rows=None):
    """`keep` [C] with the candidate blocks on either side of each segment's
    `rule.neighbor_blocks` highest-scoring candidate blocks added (blocks by original position,
    neighbours at the next lower and higher block number), and the kept counts per segment. A
    block's score is the sum of its candidates' scores outside the sinks and the last window
    (kept anyway, they would take the top places); blocks that score nothing are never top.
    Vectorised over the batch from host-known counts (no host sync): candidates are in position
    order within a segment, so a block's candidates are one run. `candidate_rows`: as in
    `_dropped_mass`."""
    device, num = keep.device, cands.num_segments
    segment, rows, index, cand_counts = candidate_rows or _candidate_rows(cands, device)
    pos = cands.key_pos.index_select(0, rows).to(torch.int64)
    block = pos // rule.block_size
    always = (pos < rule.sink_tokens) | (
        cand_counts.index_select(0, segment) - index <= rule.last_window)
    c = keep.shape[0]
    starts = torch.ones(c, dtype=torch.bool, device=device)
    starts[1:] = (block[1:] != block[:-1]) | (segment[1:] != segment[:-1])
    run = torch.cumsum(starts, 0) - 1  # each candidate's block run; runs past the last are empty
    cand_scores = scores.index_select(0, rows).to(torch.float64)
    cand_scores = torch.where((cand_scores > 0) & ~always, cand_scores, 0.0)  # NaN counts as 0
    run_score = torch.zeros(c, dtype=torch.float64, device=device).index_add_(0, run, cand_scores)
    run_segment = torch.full((c,), num, dtype=torch.int64, device=device).index_put_(
        (run,), segment)
    run_block = torch.zeros(c, dtype=torch.int64, device=device).index_put_((run,), block)
    # Runs by segment, highest score first (ties: the lower block), and each one's rank.
    order = torch.argsort(run_score, descending=True, stable=True)
    order = order[torch.argsort(run_segment.index_select(0, order), stable=True)]
    sorted_segment = run_segment.index_select(0, order)
    rank = torch.arange(c, device=device) - torch.searchsorted(sorted_segment, sorted_segment)
    top = torch.zeros(c, dtype=torch.bool, device=device).index_put_(
        (order,), (rank < rule.neighbor_blocks) & (sorted_segment < num)
        & (run_score.index_select(0, order) > 0))
    adjacent = (run_segment[1:] == run_segment[:-1]) & (run_block[1:] - run_block[:-1] == 1)
    protect = top.clone()
    protect[:-1] |= top[1:] & adjacent
    protect[1:] |= top[:-1] & adjacent
    keep = keep | protect.index_select(0, run)
    counts = torch.zeros(num, dtype=torch.int32, device=device).index_add_(
        0, segment, keep.to(torch.int32))
    return keep, counts


def _score_and_select(cands, key_buffer, sm_scale, rule, reduce_scores):
    """(per-key scores [Nk] fp32, the kept mask [C] over the candidates, kept counts,
    `_candidate_rows` where it was needed, else None): the kernels' two steps, and the
    neighbours of the top blocks where the rule asks for them."""
    device = cands.key_slots.device
    q_indptr = to_device(_indptr(cands.query_counts), torch.int32, device)
    k_indptr = to_device(_indptr(cands.key_counts), torch.int32, device)
    path = environ.kernel_path()
    scores = kernels.score_tokens(
        cands.queries, cands.query_pos, q_indptr, key_buffer, cands.key_slots, cands.key_pos,
        k_indptr, sm_scale, max_q=max(cands.query_counts), max_k=max(cands.key_counts), path=path)
    if reduce_scores is not None:
        scores = reduce_scores(scores)
    keep, counts = kernels.select_token_mask(
        scores, cands.key_pos, k_indptr, to_device(cands.prefix_counts, torch.int64, device),
        rule.block_size, to_device(cands.top_p, torch.float32, device),
        to_device(cands.keep_ratio, torch.float32, device), rule.sink_tokens, rule.last_window,
        path=path)
    keep = keep[:sum(cands.key_counts) - sum(cands.prefix_counts)]
    rows = None
    if rule.neighbor_blocks > 0 and keep.numel():
        rows = _candidate_rows(cands, device)
        keep, counts = keep_top_neighbors(cands, scores, keep, rule, rows)
    return scores, keep, counts, rows


def select_survivors_reference(cands: DropCandidates, key_buffer: torch.Tensor, sm_scale: float,
                               rule: SelectionRule) -> Selection:
    """`select_survivors` in float64, one request at a time."""
    keep_mask, counts, masses = [], [], []
    for scores, keep in _reference_segments(cands, key_buffer, sm_scale, rule):
        keep = [bool(k) for k in keep]
        keep_mask += keep
        counts.append(sum(keep))
        total = sum(max(0.0, float(s)) for s in scores)
        dropped = sum(max(0.0, float(s)) for s, k in zip(scores, keep) if not k)
        masses.append(dropped / total if total > 0 else 0.0)
    return Selection(torch.tensor(keep_mask, dtype=torch.bool),
                     torch.tensor(counts, dtype=torch.int32),
                     torch.tensor(masses, dtype=torch.float64))


def _reference_segments(cands: DropCandidates, key_buffer: torch.Tensor, sm_scale: float,
                        rule: SelectionRule):
    """Per segment: (the candidates' scores in float64, which candidates the rule keeps)."""
    q_ptr, k_ptr = _indptr(cands.query_counts), _indptr(cands.key_counts)
    for b in range(cands.num_segments):
        queries, keys = slice(q_ptr[b], q_ptr[b + 1]), slice(k_ptr[b], k_ptr[b + 1])
        key_pos = cands.key_pos[keys]
        scores = kernels.score_segment_reference(
            cands.queries[queries], cands.query_pos[queries],
            key_buffer[cands.key_slots[keys].long()], key_pos, sm_scale,
            compute_dtype=torch.float64)
        first = cands.prefix_counts[b]
        yield scores[first:], segment_keep_reference(
            scores[first:], key_pos[first:], rule, cands.top_p[b], cands.keep_ratio[b],
            compute_dtype=torch.float64)


def segment_keep_reference(scores: torch.Tensor, positions: torch.Tensor, rule: SelectionRule,
                           top_p: float, keep_ratio: float,
                           compute_dtype: torch.dtype = torch.float32) -> list:
    """Which of one request's candidates (`scores` and original `positions`, [C]) the whole
    rule keeps, as a list of bools: the kernels' reference selection, then the neighbours of
    the top blocks where the rule asks for them (calibrate's replay selects with this too)."""
    keep = kernels.select_segment_reference(scores, positions, rule.block_size, top_p,
                                            keep_ratio, rule.sink_tokens, rule.last_window,
                                            compute_dtype=compute_dtype)
    return _top_neighbors_of_segment(scores.tolist(), positions.tolist(), keep.tolist(), rule)


def keep_top_neighbors_reference(cands: DropCandidates, scores: torch.Tensor, keep: torch.Tensor,
                                 rule: SelectionRule) -> list:
    """`keep_top_neighbors`' mask as a list, one request at a time in plain Python."""
    out, start, key_start = [], 0, 0
    for k, p in zip(cands.key_counts, cands.prefix_counts):
        candidates = slice(key_start + p, key_start + k)
        out += _top_neighbors_of_segment(scores[candidates].tolist(),
                                         cands.key_pos[candidates].tolist(),
                                         keep[start:start + k - p].tolist(), rule)
        start, key_start = start + k - p, key_start + k
    return out


def _top_neighbors_of_segment(scores, positions, keep, rule: SelectionRule) -> list:
    """One request's candidates: the blocks next to the `rule.neighbor_blocks` blocks whose
    candidates outside the sinks and the last window score most (ties: the lower block) are
    kept too."""
    if rule.neighbor_blocks <= 0:
        return list(keep)
    members, totals, n = {}, {}, len(scores)
    for i, (score, pos) in enumerate(zip(scores, positions)):
        b = int(pos) // rule.block_size
        members.setdefault(b, []).append(i)
        counted = score > 0 and pos >= rule.sink_tokens and n - i > rule.last_window
        totals[b] = totals.get(b, 0.0) + (score if counted else 0.0)
    top = sorted((b for b in totals if totals[b] > 0),
                 key=lambda b: (-totals[b], b))[:rule.neighbor_blocks]
    keep = list(keep)
    for b in top:
        for near in (b - 1, b, b + 1):
            for i in members.get(near, ()):
                keep[i] = True
    return keep


# ---- prefix reuse: does a cached selection cover a new request's question? ------------------
@dataclasses.dataclass
class PrefixCoverage:
    """Per segment, as fractions of the attention mass the new request's queries pay its keys:
    `missing`, kept by the new selection but absent from the cached KV; `dropped`, left out by
    the new selection itself. The cache covers the request when it misses at most `tolerance`
    of the mass (prefix_reuse.py uses 1 - top-p: what a top-p selection itself lets go)."""
    missing: torch.Tensor  # [B] float
    dropped: torch.Tensor  # [B] float

    def covered(self, tolerance) -> torch.Tensor:
        return self.missing <= tolerance


def prefix_coverage(cands: DropCandidates, key_buffer: torch.Tensor, sm_scale: float,
                    rule: SelectionRule, cached: torch.Tensor,
                    reduce_scores: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                    ) -> PrefixCoverage:
    """Score each request's cached prefix and new tokens as one candidate set (`cands`, with no
    prefix keys: `prefix_counts` all 0), select as if nothing were cached, and measure what the
    cached KV lacks (`cached` [Nk] bool: the cache holds key j beyond the first drop; True for
    the request's own new tokens)."""
    if any(cands.prefix_counts):
        raise ValueError("prefix_coverage scores every key as a candidate: prefix_counts must be 0")
    device = cands.key_slots.device
    scores, keep, _, _ = _score_and_select(cands, key_buffer, sm_scale, rule, reduce_scores)
    segment = torch.repeat_interleave(
        torch.arange(cands.num_segments, device=device),
        to_device(cands.key_counts, torch.int64, device), output_size=scores.shape[0])
    sums = torch.zeros(3, cands.num_segments, dtype=torch.float64, device=device)
    scores = scores.to(torch.float64)
    sums[0].index_add_(0, segment, scores)
    sums[1].index_add_(0, segment, scores * (keep & ~cached))
    sums[2].index_add_(0, segment, scores * ~keep)
    total = sums[0].clamp_min(torch.finfo(torch.float64).tiny)
    return PrefixCoverage(missing=sums[1] / total, dropped=sums[2] / total)


def prefix_coverage_reference(cands: DropCandidates, key_buffer: torch.Tensor, sm_scale: float,
                              rule: SelectionRule, cached: torch.Tensor) -> PrefixCoverage:
    """`prefix_coverage` in float64, one request at a time."""
    missing, dropped, start = [], [], 0
    for scores, keep in _reference_segments(cands, key_buffer, sm_scale, rule):
        n = len(keep)
        seg_cached = cached[start:start + n].tolist()
        total = float(scores.sum()) or 1.0
        missing.append(sum(float(scores[i]) for i in range(n) if keep[i] and not seg_cached[i])
                       / total)
        dropped.append(sum(float(scores[i]) for i in range(n) if not keep[i]) / total)
        start += n
    return PrefixCoverage(torch.tensor(missing, dtype=torch.float64),
                          torch.tensor(dropped, dtype=torch.float64))
