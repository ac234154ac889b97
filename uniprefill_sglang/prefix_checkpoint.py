"""What every cached token leaves at the first drop layer, so that a later request can re-select
over a cached prefix without recomputing the layers before it.

A re-selected prefix token rejoins the forward right after the first drop layer's attention, as
a parked chunk's rows do (parking.py). Two things of it are needed there:
* the residual stream at that point, the layer's attention output plus the residual before it,
  which the post-attention norm adds. One vector of hidden_size holds the sum; it rejoins as
  hidden = sum, residual = 0 (the norm's addition gives the sum back exactly);
* its query at the drop layer, when it is among the prompt's last queries that score the
  candidates (a follow-up question shorter than `--uniprefill-last-queries` borrows the
  document's last queries, as the uncached prompt would use them).
For Llama-3.1-8B in bf16 that is 8 + 8 KiB a token beside its 128 KiB of KV (per TP rank: the
whole residual, its share of the query heads); patches/kv_pool.py counts it when SGLang
sizes the pool.

Every eager forward saves the rows of the tokens it writes (model_integration.py); a slot's
checkpoint is valid from then until the slot is written again. Decode steps replayed from a CUDA
graph save too (the save is captured with the graph); prefill CUDA graphs do not, so their slots
stay invalid and a prefix holding one is not re-selected.
"""

from __future__ import annotations

import torch


class PrefixCheckpoint:
    def __init__(self, num_slots: int, hidden_size: int, query_size: int, dtype: torch.dtype,
                 device):
        self.state = torch.zeros(num_slots, hidden_size, dtype=dtype, device=device)
        self.query = torch.zeros(num_slots, query_size, dtype=dtype, device=device)
        self.valid = torch.zeros(num_slots, dtype=torch.bool, device=device)

    @staticmethod
    def bytes_per_slot(hidden_size: int, query_size: int, dtype: torch.dtype) -> int:
        return (hidden_size + query_size) * torch._utils._element_size(dtype) + 1

    @property
    def bytes(self) -> int:
        return self.valid.numel() * self.bytes_per_slot(self.state.shape[1], self.query.shape[1],
                                                        self.state.dtype)

    def invalidate(self, slots: torch.Tensor) -> None:
        """Slots a forward is about to write: their old checkpoint is gone."""
        if slots is not None and slots.numel():
            self.valid.index_fill_(0, slots.to(torch.int64), False)

    def save_queries(self, slots: torch.Tensor, q: torch.Tensor) -> None:
        """The first drop layer's queries of the rows of `slots` (saved before the residual)."""
        self.query.index_copy_(0, slots.to(torch.int64),
                               q.reshape(q.shape[0], -1).to(self.query.dtype))

    def save(self, slots: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """The rows of `slots` right after the first drop layer's attention (before its norm)."""
        idx = slots.to(torch.int64)
        self.state.index_copy_(0, idx, (hidden + residual).to(self.state.dtype))
        self.valid.index_fill_(0, idx, True)

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Slot `dst[i]` holds the same token as `src[i]` now."""
        src, dst = src.to(torch.int64), dst.to(torch.int64)
        for buf in (self.state, self.query):
            buf.index_copy_(0, dst, buf.index_select(0, src))
        self.valid.index_copy_(0, dst, self.valid.index_select(0, src))

    def rows(self, slots: torch.Tensor, dtype: torch.dtype):
        """(hidden, residual) that rejoin `slots`' tokens after the first drop layer's attention."""
        hidden = self.state.index_select(0, slots.to(torch.int64)).to(dtype)
        return hidden, torch.zeros_like(hidden)

    def queries(self, slots: torch.Tensor, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
        """[n, num_heads, head_dim]: the saved queries of `slots`."""
        q = self.query.index_select(0, slots.to(torch.int64)).to(dtype)
        return q.view(q.shape[0], num_heads, -1)

    def all_valid(self, slots: torch.Tensor) -> torch.Tensor:
        """A device bool: does every slot hold a checkpoint?"""
        return self.valid.index_select(0, slots.to(torch.int64)).all()
