"""Which KV slots hold valid KV for which layers.

Layers are grouped into stages by the drop schedule: stage 0 is layers 0..d0 (the first drop
layer's own attention still sees every token), stage k is layers d(k-1)+1..dk, and the last stage
runs to the top of the model. A token dropped at drop layer dk has KV in stages 0..k only.

One int8 per KV slot, kept beside the KV pool, records that: `slot_stage[slot] = k` means "valid
for layers of stage <= k"; `FULL` (= number of drops) means valid everywhere. Every forward resets
the slots it writes to FULL before the model runs, so a freed and reused slot never carries stale
validity; slots held by the radix cache keep theirs, so a cached prefix is reused with exactly the
KV its layers hold.
"""

from __future__ import annotations

import bisect
from typing import Sequence

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

    def count_sparse(self, slots: torch.Tensor) -> torch.Tensor:
        return (self.slot_stage[slots] < self.full).sum()

    def valid_slots(self, req_slots: torch.Tensor, stage: int):
        """(slots, positions) of a request's KV that layers of `stage` hold, in position order."""
        valid = self.valid_mask(req_slots, stage)
        positions = torch.nonzero(valid, as_tuple=True)[0]
        return req_slots[positions], positions
