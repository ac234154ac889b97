"""The per-forward drop context: what the layers after a drop need to know.

One `DropContext` lives for one `ModelRunner` forward. It starts with every token of the batch
and shrinks at each drop layer: `positions` and `out_cache_loc` hold the surviving rows in batch
order, `lens` the surviving rows per request, and `pending_rows` the rows that the hidden states
and residual still have to be gathered to (applied by the layer hooks right after the drop
layer's attention).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch

from uniprefill_sglang.request_plan import BatchPlan


@dataclasses.dataclass
class DropContext:
    plan: Optional[BatchPlan]
    forward_batch: object
    is_extend: bool
    # Current surviving rows (extend only).
    positions: Optional[torch.Tensor] = None
    out_cache_loc: Optional[torch.Tensor] = None
    lens: Optional[List[int]] = None
    # Per request: does it hold KV missing in some layer (sparse prefix or a drop this step)?
    sparse: Optional[List[bool]] = None
    # Rows the hidden states must be gathered to, and the row count they have before it.
    pending_rows: Optional[torch.Tensor] = None
    rows_before_pending: int = 0
    compacted: bool = False
    # kept[k][b]: rows of request b entering stage k (kept[0] = the step's new tokens).
    kept: List[List[int]] = dataclasses.field(default_factory=list)

    @property
    def lens_tensor(self) -> torch.Tensor:
        return torch.tensor(self.lens, dtype=torch.int32, device=self.positions.device)

    def segment_starts(self) -> List[int]:
        starts, acc = [], 0
        for n in self.lens:
            starts.append(acc)
            acc += n
        return starts

    def apply_pending(self, *tensors):
        """Gather rows of tensors that still have the pre-drop row count; others pass through."""
        rows = self.pending_rows
        if rows is None:
            return tensors
        out = tuple(
            t.index_select(0, rows)
            if t is not None and t.shape[0] == self.rows_before_pending
            else t
            for t in tensors
        )
        return out

    def finish_pending(self) -> None:
        self.pending_rows = None


_current: Optional[DropContext] = None


def current() -> Optional[DropContext]:
    return _current


def set_current(ctx: Optional[DropContext]) -> None:
    global _current
    _current = ctx
