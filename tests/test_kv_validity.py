"""Per-stage KV bookkeeping (kv_validity.py, backends/common.py) on fresh random inputs, against
plain Python loops: the device counts, the compacted views, and the host lengths that decode
plans with."""

import random
from types import SimpleNamespace

import pytest
import torch

from uniprefill_sglang.backends.common import decode_stage_kv_lens, prefix_view
from uniprefill_sglang.context import Survivors
from uniprefill_sglang.errors import CheckFailed
from uniprefill_sglang.kv_validity import ForwardKV, KVGaps, RequestStageKV, SlotStages, \
    check_kv_lens, compact, gather_seq_slots, stage_views, window_views

NUM_DROPS = 4


def _random_pool(seed: int, bs: int, max_len: int):
    """A slot-stage map and a req_to_token table with `bs` requests of random lengths (some 0)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_slots = (bs + 2) * max_len + 8
    stages = SlotStages(num_slots, NUM_DROPS, "cpu")
    stages.slot_stage.copy_(torch.randint(0, NUM_DROPS + 1, (num_slots,), dtype=torch.int8))
    perm = torch.randperm(num_slots)
    req_to_token = perm[: (bs + 2) * max_len].view(bs + 2, max_len).to(torch.int32)
    rows = torch.tensor(rng.sample(range(bs + 2), bs), dtype=torch.int64)
    lens = torch.tensor([rng.choice([0, rng.randint(1, max_len)]) if b else rng.randint(1, max_len)
                         for b in range(bs)], dtype=torch.int64)
    return stages, req_to_token, rows, lens


def _valid_loop(stages, req_to_token, row, n, stage):
    return sum(int(stages.slot_stage[int(req_to_token[row, i])]) >= stage for i in range(n))


@pytest.mark.parametrize("seed", range(4))
def test_valid_counts_match_a_loop(seed):
    stages, req_to_token, rows, lens = _random_pool(seed, bs=5, max_len=37)
    seq = gather_seq_slots(req_to_token, rows, lens, int(lens.sum()))
    got = torch.full((5, NUM_DROPS + 1), -1, dtype=torch.int64)  # poisoned
    got.copy_(stages.valid_counts(seq.slots, seq.row, 5))
    for b, (r, n) in enumerate(zip(rows.tolist(), lens.tolist())):
        assert got[b].tolist() == [_valid_loop(stages, req_to_token, r, n, s)
                                   for s in range(NUM_DROPS + 1)]


@pytest.mark.parametrize("seed", range(4))
def test_decode_views_hold_what_the_host_lengths_say(seed):
    """Host gaps recorded from the slot map give the lengths of the compacted device views (all
    stages in one pass); requests without gaps and CUDA-graph padding rows keep their whole
    sequence."""
    bs, pad = 5, 2
    stages, req_to_token, rows, lens = _random_pool(seed, bs=bs, max_len=41)
    dense = [b % 2 == seed % 2 for b in range(bs)]
    for r, n, is_dense in zip(rows.tolist(), lens.tolist(), dense):
        if is_dense:  # a request that dropped nothing has every slot at FULL
            stages.slot_stage[req_to_token[r, :n].long()] = NUM_DROPS
    gaps = KVGaps(bs + 2, NUM_DROPS)
    for r, n in zip(rows.tolist(), lens.tolist()):
        gaps.set(r, [n - _valid_loop(stages, req_to_token, r, n, s)
                     for s in range(1, NUM_DROPS + 1)])
    # A padded graph batch: two extra rows pointing at a sparse request's row, length 3.
    all_rows = torch.cat([rows, rows[:1].expand(pad)])
    all_lens = torch.cat([lens, torch.full((pad,), 3, dtype=torch.int64)])
    fb = SimpleNamespace(seq_lens_cpu=all_lens.to(torch.int32), seq_lens=all_lens)
    ctx = SimpleNamespace(kv=ForwardKV(gaps=[gaps.get(r) for r in rows.tolist()]))
    host = decode_stage_kv_lens(ctx, fb, bs + pad, NUM_DROPS)
    n = int(all_lens.sum())
    out = torch.full((NUM_DROPS, n + 5), -9, dtype=torch.int64)  # poisoned static buffers
    indptr_out = torch.full((NUM_DROPS, bs + pad + 4), -9, dtype=torch.int32)
    counts, indptr, indices = stage_views(stages, req_to_token, all_rows, all_lens, n,
                                          bs, outs=out, indptr_outs=indptr_out)
    assert indptr.data_ptr() == indptr_out.data_ptr() and indices.data_ptr() == out.data_ptr()
    assert torch.equal(host, counts)
    for k in range(NUM_DROPS):
        assert indptr[k, -1].item() == host[k].sum().item()
        for b in range(bs + pad):
            r, length = int(all_rows[b]), int(all_lens[b])
            seq = req_to_token[r, :length].long()
            keep = stages.slot_stage[seq] >= k + 1 if b < bs else torch.ones(length, dtype=torch.bool)
            assert indices[k, indptr[k, b]:indptr[k, b + 1]].tolist() == seq[keep].tolist()


@pytest.mark.parametrize("seed", range(3))
def test_prefix_views_hold_the_valid_slots_before_each_requests_first_row(seed):
    """Both GPU adapters' prefix view at every stage after the first (all built by the first
    call, cached on the context): in position order, the slots of positions [0, fixed_len)
    whose KV that stage holds, as many as the host counts say (checked inside, as under
    UNIPREFILL_CHECK_KV_LENS, and again here)."""
    bs = 4
    stages, req_to_token, rows, lens = _random_pool(seed, bs=bs, max_len=29)
    rng = random.Random(seed)
    fixed = [rng.randint(0, n) for n in lens.tolist()]  # the rest of each sequence is this step's
    fb = SimpleNamespace(req_pool_indices=rows)
    runtime = SimpleNamespace(slots=stages, check_kv_lens=True)
    host = [[_valid_loop(stages, req_to_token, int(r), f, stage)
             for stage in range(NUM_DROPS + 1)] for r, f in zip(rows.tolist(), fixed)]
    ctx = SimpleNamespace(survivors=Survivors(fixed_lens=fixed), kv=ForwardKV(prefix_valid=host))
    for stage in range(1, NUM_DROPS + 1):
        counts, indptr, indices = prefix_view(runtime, req_to_token, fb, ctx, stage)
        assert counts.tolist() == [h[stage] for h in host]
        for b, (r, f) in enumerate(zip(rows.tolist(), fixed)):
            seq = req_to_token[r, :f].long()
            want = seq[stages.slot_stage[seq] >= stage].tolist()
            assert indices[indptr[b]:indptr[b + 1]].tolist() == want
    # A host count the slot map contradicts is refused.
    ctx = SimpleNamespace(survivors=Survivors(fixed_lens=fixed),
                          kv=ForwardKV(prefix_valid=[[n + 1 for n in h] for h in host]))
    with pytest.raises(CheckFailed, match="extend prefix stage 1"):
        prefix_view(runtime, req_to_token, fb, ctx, 2)


def test_compact_one_view_keeps_order_and_refuses_a_short_buffer():
    slots = torch.tensor([5, 6, 7, 8, 9])
    bounds = torch.tensor([0, 2, 2, 5])  # the middle segment is empty
    keep = torch.tensor([True, False, True, True, False])
    counts, indptr, out = compact(slots, bounds, keep, out=torch.full((6,), -7))
    assert counts.tolist() == [1, 0, 2] and indptr.tolist() == [0, 1, 1, 3]
    assert out[:3].tolist() == [5, 7, 8]
    with pytest.raises(RuntimeError, match="too small"):
        compact(slots, bounds, keep, out=torch.empty(5, dtype=torch.int64))


def test_kv_gaps_reject_negative_gaps_and_track_stale_rows():
    gaps = KVGaps(4, 3)
    gaps.set(1, [0, 2, 5])
    assert gaps.get(1) == (0, 2, 5) and gaps.get(0) == (0, 0, 0)
    with pytest.raises(ValueError, match="negative"):
        gaps.set(2, [1, -1, 0])
    gaps.invalidate(1)
    assert gaps.is_stale(1) and not gaps.is_stale(2)
    gaps.set(1, [0, 0, 0])  # a fresh count clears it
    assert not gaps.is_stale(1) and gaps.get(1) == (0, 0, 0)


def test_check_kv_lens_names_both_sides_on_a_mismatch():
    device = torch.tensor([[3, 2], [5, 5]], dtype=torch.int64)
    check_kv_lens(torch.tensor([[3, 2], [5, 5]], dtype=torch.int32), device, "equal")
    with pytest.raises(CheckFailed, match=r"decode: host KV lengths \[\[3, 2\], \[5, 4\]\]"):
        check_kv_lens(torch.tensor([[3, 2], [5, 4]]), device, "decode")


def test_inconsistent_extend_counts_leave_the_row_stale_and_the_device_recounts_it():
    """RequestStageKV: a negative count (issue 14's symptom) is never stored; the row is read
    back from the device slot map instead, which gives the true gaps."""
    slots = SlotStages(64, 2, "cpu")
    req_to_token = torch.arange(64, dtype=torch.int32).view(4, 16)
    book = RequestStageKV(slots, KVGaps(4, 2), req_to_token)
    slots.mark_dropped(torch.tensor([17, 18, 19]), 1)  # row 1 lost 3 slots after drop 1 ...
    slots.mark_dropped(torch.tensor([20]), 0)  # ... and one more after the first drop
    assert book.record_extend(1, 10, [0, 0, 0], [6, 6])  # consistent: stored
    assert book.gaps.get(1) == (4, 4) and not book.gaps.is_stale(1)
    assert not book.record_extend(1, 10, [0, 0, 0], [6, 6], corrupt=True)
    assert book.gaps.is_stale(1)
    book.refresh_stale([1, 2], torch.tensor([1, 2]), torch.tensor([10, 5]), torch.tensor([10, 5]))
    assert book.gaps.get(1) == (1, 4) and book.gaps.get(2) == (0, 0)
    assert not book.gaps.is_stale(1)


def test_valid_slots_with_a_host_count_equals_the_synchronising_form():
    rng = random.Random(5)
    slots = SlotStages(512, NUM_DROPS, "cpu")
    for _ in range(20):
        req_slots = torch.tensor(rng.sample(range(512), rng.randint(0, 200)))
        slots.mark_written(req_slots)
        for s in range(NUM_DROPS):  # drop a random subset after each drop layer
            slots.mark_dropped(req_slots[torch.rand(req_slots.shape[0]) < 0.2], s)
        for stage in range(NUM_DROPS + 1):
            want_slots, want_pos = slots.valid_slots(req_slots, stage)
            got_slots, got_pos = slots.valid_slots(req_slots, stage, count=want_pos.numel())
            assert torch.equal(got_slots, want_slots) and torch.equal(got_pos, want_pos)


@pytest.mark.parametrize("seed", range(4))
def test_window_views_list_the_positions_a_sliding_window_reaches(seed):
    """With a sliding `window` the views gain 2D + 1 rows: row D + s lists, of stage s's KV
    (stage 0 holds every slot), the positions at most `window` before each sequence's last,
    in position order; `positions` gives each listed slot's position. Against a loop."""
    bs = 5
    stages, req_to_token, rows, lens = _random_pool(seed, bs=bs, max_len=43)
    window = random.Random(seed).choice([1, 6, 17, 100])
    n = int(lens.sum())
    counts, indptr, indices, pos = stage_views(stages, req_to_token, rows, lens, n, bs,
                                               window=window, positions=True)
    assert counts.shape == (2 * NUM_DROPS + 1, bs)
    for row in range(2 * NUM_DROPS + 1):
        windowed, stage = row >= NUM_DROPS, (row - NUM_DROPS if row >= NUM_DROPS else row + 1)
        for b in range(bs):
            r, length = int(rows[b]), int(lens[b])
            want = [(int(req_to_token[r, p]), p) for p in range(length)
                    if int(stages.slot_stage[int(req_to_token[r, p])]) >= stage
                    and (not windowed or p >= length - 1 - window)]
            lo, hi = int(indptr[row, b]), int(indptr[row, b + 1])
            assert int(counts[row, b]) == hi - lo == len(want), (row, b)
            assert list(zip(indices[row, lo:hi].tolist(), pos[row, lo:hi].tolist())) == want


@pytest.mark.parametrize("seed", range(4))
def test_window_views_from_the_span_equal_the_whole_sequence_rows(seed):
    """`window_views` gathers only each sequence's last `window + 1` positions into static
    buffers sized for them, and lists what `stage_views`' windowed rows list for stages 1..D,
    with the positions; CUDA-graph padding rows (past `raw_bs`) keep their whole span."""
    bs, pad = 5, 2
    stages, req_to_token, rows, lens = _random_pool(seed, bs=bs, max_len=43)
    window = random.Random(seed).choice([0, 1, 6, 17, 100])
    all_rows = torch.cat([rows, rows[:1].expand(pad)])
    all_lens = torch.cat([lens, torch.full((pad,), 5, dtype=torch.int64)])
    n = int(all_lens.clamp(max=window + 1).sum())
    outs = torch.full((NUM_DROPS, n + 3), -9, dtype=torch.int32)  # poisoned static buffers
    pos_outs = torch.full((NUM_DROPS, n + 3), -9, dtype=torch.int32)
    indptr_outs = torch.full((NUM_DROPS, bs + pad + 2), -9, dtype=torch.int32)
    counts, indptr, indices, pos = window_views(stages, req_to_token, all_rows, all_lens, window,
                                                n, bs, outs=outs, indptr_outs=indptr_outs,
                                                pos_outs=pos_outs)
    assert indices.data_ptr() == outs.data_ptr() and pos.data_ptr() == pos_outs.data_ptr()
    want = stage_views(stages, req_to_token, rows, lens, int(lens.sum()), bs, window=window,
                       positions=True)
    for k in range(NUM_DROPS):
        row = NUM_DROPS + 1 + k  # stage_views' windowed row of stage k + 1
        for b in range(bs + pad):
            lo, hi = int(indptr[k, b]), int(indptr[k, b + 1])
            assert int(counts[k, b]) == hi - lo
            got = list(zip(indices[k, lo:hi].tolist(), pos[k, lo:hi].tolist()))
            if b >= bs:  # padding: the whole span, unfiltered
                length = int(all_lens[b])
                span = range(max(0, length - 1 - window), length)
                assert got == [(int(req_to_token[int(all_rows[b]), p]), p) for p in span]
                continue
            wlo, whi = int(want[1][row, b]), int(want[1][row, b + 1])
            assert got == list(zip(want[2][row, wlo:whi].tolist(), want[3][row, wlo:whi].tolist()))
