"""Per-stage KV bookkeeping (kv_validity.py, backends/common.py) on fresh random inputs, against
plain Python loops: the device counts, the compacted views, and the host lengths that decode
plans with."""

import random
from types import SimpleNamespace

import pytest
import torch

from uniprefill_sglang.backends.common import decode_stage_kv_lens
from uniprefill_sglang.kv_validity import KVGaps, SlotStages, compact, decode_stage_views, \
    gather_seq_slots

NUM_DROPS = 4


def _random_pool(seed: int, bs: int, max_len: int):
    """A slot-stage map and a req_to_token table with `bs` requests of random lengths."""
    rng = random.Random(seed)
    num_slots = (bs + 2) * max_len + 8
    stages = SlotStages(num_slots, bs + 2, NUM_DROPS, "cpu")
    stages.slot_stage.copy_(torch.randint(0, NUM_DROPS + 1, (num_slots,), dtype=torch.int8))
    perm = torch.randperm(num_slots)
    req_to_token = perm[: (bs + 2) * max_len].view(bs + 2, max_len).to(torch.int32)
    rows = torch.tensor(rng.sample(range(bs + 2), bs), dtype=torch.int64)
    lens = torch.tensor([rng.randint(1, max_len) for _ in range(bs)], dtype=torch.int64)
    return stages, req_to_token, rows, lens


def _valid_loop(stages, req_to_token, rows, lens, stage):
    return [sum(int(stages.slot_stage[int(req_to_token[r, i])]) >= stage for i in range(n))
            for r, n in zip(rows.tolist(), lens.tolist())]


@pytest.mark.parametrize("seed", range(4))
def test_valid_counts_match_a_loop(seed):
    stages, req_to_token, rows, lens = _random_pool(seed, bs=5, max_len=37)
    slots, row = gather_seq_slots(req_to_token, rows, lens, int(lens.sum()))
    got = torch.full((5, NUM_DROPS + 1), -1, dtype=torch.int64)  # poisoned
    got.copy_(stages.valid_counts(slots, row, 5))
    for s in range(NUM_DROPS + 1):
        assert got[:, s].tolist() == _valid_loop(stages, req_to_token, rows, lens, s)


@pytest.mark.parametrize("seed", range(4))
def test_decode_views_hold_what_the_host_lengths_say(seed):
    """Host gaps recorded from the slot map give the lengths of the compacted device views;
    dense requests and CUDA-graph padding rows keep their whole sequence."""
    bs, pad = 5, 2
    stages, req_to_token, rows, lens = _random_pool(seed, bs=bs, max_len=41)
    sparse = torch.tensor([seed % 2 == 0, True, False, True, True])
    for r, n, sp in zip(rows.tolist(), lens.tolist(), sparse.tolist()):
        if not sp:  # a dense request's slots all hold full KV
            stages.slot_stage[req_to_token[r, :n].long()] = NUM_DROPS
    stages.req_sparse[rows] = sparse
    gaps = KVGaps(bs + 2, NUM_DROPS)
    for s_idx, (r, n) in enumerate(zip(rows.tolist(), lens.tolist())):
        valid = [_valid_loop(stages, req_to_token, rows[s_idx:s_idx + 1], lens[s_idx:s_idx + 1], s)[0]
                 for s in range(1, NUM_DROPS + 1)]
        gaps.set(r, [n - v for v in valid])
    # A padded graph batch: two extra rows pointing at row 0 with length 1.
    all_rows = torch.cat([rows, torch.zeros(pad, dtype=torch.int64)])
    all_lens = torch.cat([lens, torch.ones(pad, dtype=torch.int64)])
    fb = SimpleNamespace(seq_lens_cpu=all_lens.to(torch.int32), seq_lens=all_lens)
    ctx = SimpleNamespace(kv_gaps=[gaps.get(r) for r in rows.tolist()])
    stage_list = list(range(1, NUM_DROPS + 1))
    host = decode_stage_kv_lens(ctx, fb, bs + pad, stage_list)
    views = decode_stage_views(stages, req_to_token, all_rows, all_lens, int(all_lens.sum()), bs,
                               stage_list)
    for s in stage_list:
        counts, indptr, indices = views[s]
        assert host[s].tolist() == counts.tolist()
        assert indptr[-1].item() == host[s].sum().item()
        for b in range(bs + pad):
            r, n = int(all_rows[b]), int(all_lens[b])
            seq = req_to_token[r, :n].long()
            keep = stages.slot_stage[seq] >= s if (b < bs and sparse[b]) else torch.ones(n, dtype=torch.bool)
            want = seq[keep].tolist()
            assert indices[indptr[b]:indptr[b + 1]].tolist() == want


def test_compact_refuses_a_short_buffer_and_keeps_order():
    slots = torch.tensor([5, 6, 7, 8, 9])
    row = torch.tensor([0, 0, 1, 1, 1])
    keep = torch.tensor([True, False, True, True, False])
    counts, indptr, out = compact(slots, row, keep, 2, out=torch.full((6,), -7))
    assert counts.tolist() == [1, 2] and indptr.tolist() == [0, 1, 3]
    assert out[:3].tolist() == [5, 7, 8]
    with pytest.raises(RuntimeError, match="too small"):
        compact(slots, row, keep, 2, out=torch.empty(5, dtype=torch.int64))


def test_kv_gaps_reject_negative_gaps():
    gaps = KVGaps(4, 3)
    gaps.set(1, [0, 2, 5])
    assert gaps.get(1) == (0, 2, 5) and gaps.get(0) == (0, 0, 0)
    with pytest.raises(RuntimeError, match="negative"):
        gaps.set(2, [1, -1, 0])
