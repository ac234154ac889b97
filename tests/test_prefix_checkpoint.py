"""The per-slot checkpoint at the first drop layer (prefix_checkpoint.py) and rows that rejoin
together (parking.merge_parked), without an engine."""

from __future__ import annotations

import pytest
import torch

from uniprefill_sglang.parking import ParkedRows, merge_parked
from uniprefill_sglang.prefix_checkpoint import PrefixCheckpoint


def test_saved_rows_rejoin_as_their_residual_stream():
    gen = torch.Generator().manual_seed(0)
    ckpt = PrefixCheckpoint(num_slots=64, hidden_size=8, query_size=12, dtype=torch.float32,
                            device="cpu")
    slots = torch.tensor([5, 9, 2, 40])
    hidden, residual = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)
    q = torch.randn(4, 3, 4, generator=gen)
    assert not bool(ckpt.all_valid(slots))
    ckpt.save_queries(slots, q)
    ckpt.save(slots, hidden, residual)
    assert bool(ckpt.all_valid(slots))
    h, r = ckpt.rows(slots[[2, 0]], torch.float32)
    # The post-attention norm adds them: the sum is the residual stream, exactly.
    assert torch.equal(h + r, (hidden + residual)[[2, 0]]) and not r.any()
    assert torch.equal(ckpt.queries(slots[1:3], 3, torch.float32), q[1:3])
    # A slot that holds the same token elsewhere; a slot written again loses its checkpoint.
    ckpt.copy(slots[:2], torch.tensor([60, 61]))
    assert torch.equal(ckpt.rows(torch.tensor([60, 61]), torch.float32)[0], h.new_tensor(
        (hidden + residual)[:2]))
    ckpt.invalidate(torch.tensor([9]))
    assert not bool(ckpt.all_valid(slots)) and bool(ckpt.all_valid(torch.tensor([5, 2, 60])))
    assert ckpt.bytes == 64 * PrefixCheckpoint.bytes_per_slot(8, 12, torch.float32)


def test_merged_rows_keep_position_order_and_the_latest_queries():
    prefix, chunks = ParkedRows(0), ParkedRows(3)
    prefix.append(torch.zeros(3, 2), torch.zeros(3, 2))
    prefix.set_last_queries(torch.zeros(2, 1, 1), torch.tensor([1, 2]))
    chunks.append(torch.ones(2, 2), torch.ones(2, 2))
    merged = merge_parked(prefix, chunks)
    hidden, _ = merged.states()
    assert merged.start_pos == 0 and merged.count == 5
    assert hidden[:, 0].tolist() == [0, 0, 0, 1, 1]
    assert merged.last_q_pos.tolist() == [1, 2]  # the chunks saved none: the prefix's
    chunks.set_last_queries(torch.ones(1, 1, 1), torch.tensor([4]))
    assert merge_parked(prefix, chunks).last_q_pos.tolist() == [4]
    assert merge_parked(prefix, None) is prefix
    with pytest.raises(ValueError, match="not contiguous"):
        merge_parked(prefix, ParkedRows(7))
