"""Which KV slots hold valid KV for which layers.

Layers are grouped into stages by the drop schedule: stage 0 is layers 0..d0 (the first drop
layer's own attention still sees every token), stage k is layers d(k-1)+1..dk, and the last stage
runs to the top of the model. A token dropped at drop layer dk has KV in stages 0..k only.

One int8 per KV slot, kept beside the KV pool, records that: `slot_stage[slot] = k` means "valid
for layers of stage <= k"; `FULL` (= number of drops) means valid everywhere. Every forward resets
the slots it writes to FULL before the model runs, so a freed and reused slot never carries stale
validity; slots held by the radix cache keep theirs, so a cached prefix is reused with exactly the
KV its layers hold.

`KVGaps` mirrors, on the host, how many slots each request lacks per stage, so decode steps can
size per-stage views (FlashInfer plans on the host) without reading the device. The functions at
the bottom build per-stage views on the device, shared by the attention-backend adapters.
"""

from __future__ import annotations

import bisect
from typing import List, Optional, Sequence, Tuple

import torch


class LayerStages:
    """The static layer -> stage table of a drop schedule."""

    def __init__(self, drop_layers: Sequence[int], num_layers: int):
        self.drop_layers = tuple(drop_layers)
        self.num_layers = num_layers
        self.num_drops = len(self.drop_layers)
        # stage(l) = number of drop layers strictly before l.
        self.stage_of_layer = [
            bisect.bisect_left(self.drop_layers, l) for l in range(num_layers)
        ]
        self.drop_index = {l: k for k, l in enumerate(self.drop_layers)}

    def stage(self, layer_id: int) -> int:
        return self.stage_of_layer[layer_id]


class SlotStages:
    """Per-slot survival stage beside the token-to-KV pool, plus per-request sparsity flags."""

    def __init__(self, num_slots: int, max_reqs: int, num_drops: int, device):
        if num_drops > 126:
            raise ValueError("at most 126 drop layers fit the int8 stage map")
        self.full = num_drops
        self.slot_stage = torch.full((num_slots,), num_drops, dtype=torch.int8, device=device)
        # True where the request in that req-pool row has KV missing in some layer (it dropped
        # tokens, or reuses a prefix that did). Decode reads it to choose the sparse path.
        self.req_sparse = torch.zeros((max_reqs,), dtype=torch.bool, device=device)

    def mark_written(self, slots: torch.Tensor) -> None:
        """Slots a forward is about to write hold full KV until a drop says otherwise."""
        if slots is not None and slots.numel():
            self.slot_stage[slots] = self.full

    def mark_dropped(self, slots: torch.Tensor, stage: int) -> None:
        if slots.numel():
            self.slot_stage[slots] = stage

    def valid_mask(self, slots: torch.Tensor, stage: int) -> torch.Tensor:
        return self.slot_stage[slots] >= stage

    def valid_counts(self, slots: torch.Tensor, row: torch.Tensor, bs: int) -> torch.Tensor:
        """[bs, full + 1]: per segment (`row` = segment of each slot), the slots valid at each
        stage."""
        st = self.slot_stage[slots.to(torch.int64)].to(torch.int64)
        hist = torch.zeros(bs * (self.full + 1), dtype=torch.int64, device=slots.device)
        if slots.numel():
            hist.index_add_(0, row * (self.full + 1) + st, torch.ones_like(st))
        # Valid at stage s = slots whose stage is >= s: a reversed cumulative sum.
        return hist.view(bs, self.full + 1).flip(1).cumsum(1).flip(1)

    def valid_slots(self, req_slots: torch.Tensor, stage: int):
        """(slots, positions) of a request's KV that layers of `stage` hold, in position order."""
        valid = self.valid_mask(req_slots, stage)
        positions = torch.nonzero(valid, as_tuple=True)[0]
        return req_slots[positions], positions


class KVGaps:
    """Host mirror of the KV each request lacks: per req-pool row, per stage 1..D, the number of
    the request's slots that stage holds no KV for.

    Set when an extend of the row ends (from the host-known kept counts, runtime.py); decode
    tokens have KV in every layer, so a row's gaps hold until its next extend, and a stage's KV
    length in decode is `seq_len - gap`.
    """

    def __init__(self, max_reqs: int, num_drops: int):
        self.none = (0,) * num_drops
        self.by_row: List[Tuple[int, ...]] = [self.none] * max_reqs

    def set(self, row: int, gaps: Sequence[int]) -> None:
        gaps = tuple(int(g) for g in gaps)
        if any(g < 0 for g in gaps):
            raise RuntimeError(f"UniPrefill: negative KV gap {gaps} for request row {row}")
        self.by_row[row] = gaps if any(gaps) else self.none

    def get(self, row: int) -> Tuple[int, ...]:
        return self.by_row[row]


# ---- per-stage views on the device (no host sync) -------------------------------------------
def segment_ids(lens: torch.Tensor, n: int) -> torch.Tensor:
    """[0,0,1,2,2,2,...]: the segment of each of the n = sum(lens) elements."""
    bs = lens.shape[0]
    return torch.repeat_interleave(
        torch.arange(bs, device=lens.device), lens.to(torch.int64), output_size=n
    )


def gather_seq_slots(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     seq_lens: torch.Tensor, n: int):
    """The slots of positions [0, seq_len) of each request, concatenated; and their segment ids."""
    lens = seq_lens[: req_pool_indices.shape[0]].to(torch.int64)
    row = segment_ids(lens, n)
    start = torch.cumsum(lens, 0) - lens
    col = torch.arange(n, device=lens.device) - start[row]
    slots = req_to_token[req_pool_indices.to(torch.int64)[row], col]
    return slots, row


def compact(slots: torch.Tensor, row: torch.Tensor, keep: torch.Tensor, bs: int,
            out: Optional[torch.Tensor] = None, indptr_out: Optional[torch.Tensor] = None,
            dtype: Optional[torch.dtype] = None):
    """Keep `slots[keep]`, segment by segment, without a host sync.

    Returns (counts[bs] int32, indptr[bs + 1] int32, indices). Kept entries land at their
    compacted position; the others are scattered to the buffer's last element (a dump slot),
    so `out` needs at least n + 1 elements.
    """
    device = slots.device
    n = slots.shape[0]
    counts = torch.zeros(bs, dtype=torch.int32, device=device)
    if n:
        counts.index_add_(0, row, keep.to(torch.int32))
    indptr = indptr_out if indptr_out is not None else torch.empty(
        bs + 1, dtype=torch.int32, device=device)
    indptr = indptr[: bs + 1]
    indptr[:1].zero_()
    torch.cumsum(counts, 0, out=indptr[1:])
    if out is None:
        out = torch.empty(n + 1, dtype=dtype or slots.dtype, device=device)
    elif out.numel() < n + 1:
        raise RuntimeError(f"UniPrefill: KV index buffer of {out.numel()} entries is too small "
                           f"for {n} candidate slots")
    if n:
        pos = torch.cumsum(keep, 0) - 1
        dest = torch.where(keep, pos, out.numel() - 1)
        out.scatter_(0, dest, slots.to(out.dtype))
    return counts, indptr, out


def decode_stage_views(slot_stages: SlotStages, req_to_token, req_pool_indices, seq_lens,
                       n: int, raw_bs: int, stages, outs=None, indptr_outs=None, dtype=None):
    """Per stage: the KV list of each decode request. Requests without sparse KV, and the
    padding rows of a CUDA-graph batch (index >= raw_bs), keep their whole sequence."""
    bs = req_pool_indices.shape[0]
    slots, row = gather_seq_slots(req_to_token, req_pool_indices, seq_lens, n)
    full = ~slot_stages.req_sparse[req_pool_indices.to(torch.int64)]
    if raw_bs < bs:
        full[raw_bs:] = True
    full_el = full[row]
    st = slot_stages.slot_stage[slots.to(torch.int64)]
    views = {}
    for s in stages:
        keep = (st >= s) | full_el
        views[s] = compact(slots, row, keep, bs,
                           out=None if outs is None else outs[s],
                           indptr_out=None if indptr_outs is None else indptr_outs[s],
                           dtype=dtype)
    return views


def extend_stage_slots(slot_stages: SlotStages, req_to_token, req_pool_indices, seq_lens,
                       n: int, stage: int):
    """Extend at `stage`: every slot of each request's sequence with its validity at `stage`."""
    slots, row = gather_seq_slots(req_to_token, req_pool_indices, seq_lens, n)
    valid = slot_stages.slot_stage[slots.to(torch.int64)] >= stage
    return slots, row, valid
