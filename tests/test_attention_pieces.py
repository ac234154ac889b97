"""An attention layer run over the survivors in pieces (backends/common.py: `row_piece`,
`stage_keys`) sees, piece by piece, the keys the whole layer would: the stage's valid prefix,
its request's rows ahead of the piece, and the piece's own rows causally. Checked on fresh
random batches (cached prefixes with KV missing at later stages, survivors of a drop, pieces
cutting through requests) against readable references; and the drop's gather in place
(context.py) against an ordinary gather."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from uniprefill_sglang import kernels
from uniprefill_sglang.backends.common import row_piece, stage_keys
from uniprefill_sglang.context import (DropContext, Survivors, gather_from_sources,
                                       gather_in_place)
from uniprefill_sglang.kv_validity import ForwardKV, SlotStages
from uniprefill_sglang.pieces import RowPieces

DROPS = 3
HEADS, KV_HEADS, DIM = 4, 2, 16


def _batch(rng: random.Random):
    """A random extend after a drop: per request a cached prefix whose slots hold KV up to a
    random stage, then new rows of which a random subset survived; the drop context over the
    survivors, the runtime's slot stages and the request table."""
    bs = rng.randint(1, 4)
    num_slots = 4096
    slots = SlotStages(num_slots, DROPS, "cpu")
    free = list(range(num_slots))
    rng.shuffle(free)
    req_to_token = torch.zeros(bs, 512, dtype=torch.int32)
    positions, survivors, lens, fixed, prefix_valid = [], [], [], [], []
    for b in range(bs):
        prefix, new = rng.choice((0, rng.randint(1, 60))), rng.randint(1, 120)
        seq = torch.tensor([free.pop() for _ in range(prefix + new)], dtype=torch.int32)
        req_to_token[b, : prefix + new] = seq
        stage = torch.tensor([rng.randint(0, DROPS) for _ in range(prefix)], dtype=torch.int8)
        slots.slot_stage[seq[:prefix].to(torch.int64)] = stage
        kept = sorted(rng.sample(range(prefix, prefix + new), rng.randint(1, new)))
        positions += kept
        survivors.append(seq[torch.tensor(kept)])
        lens.append(len(kept))
        fixed.append(prefix)
        prefix_valid.append([prefix] + [int((stage >= s).sum()) for s in range(1, DROPS + 1)])
    fb = SimpleNamespace(req_pool_indices=torch.arange(bs))
    ctx = DropContext(plan=None, forward_batch=fb, is_extend=True,
                      survivors=Survivors(positions=torch.tensor(positions),
                                          out_cache_loc=torch.cat(survivors), lens=lens,
                                          fixed_lens=fixed, compacted=True),
                      kv=ForwardKV(prefix_valid=prefix_valid))
    runtime = SimpleNamespace(slots=slots, check_kv_lens=True)
    return runtime, ctx, req_to_token


def _pieces(rng: random.Random, total: int):
    size = rng.randint(1, max(1, total // 2))
    return [(start, min(total, start + size)) for start in range(0, total, size)]


def _reference_keys(runtime, ctx, req_to_token, stage: int, through):
    """Per request: (slots, positions) of its prefix valid at `stage`, then of its first
    `through[b]` survivors, read one request at a time."""
    out, start = [], 0
    for b, n in enumerate(ctx.survivors.lens):
        prefix = req_to_token[b, : ctx.survivors.fixed_lens[b]].to(torch.int64)
        valid = runtime.slots.slot_stage[prefix] >= stage
        rows = slice(start, start + through[b])
        out.append((torch.cat([prefix[valid], ctx.survivors.out_cache_loc[rows].to(torch.int64)]),
                    torch.cat([torch.nonzero(valid).flatten(), ctx.survivors.positions[rows]])))
        start += n
    return out


def test_row_piece_names_each_requests_rows_in_and_ahead_of_the_piece():
    rng = random.Random()
    for _ in range(200):
        lens = [rng.randint(0, 9) for _ in range(rng.randint(1, 5))]
        total = sum(lens)
        if not total:
            continue
        start = rng.randrange(total)
        end = rng.randint(start + 1, total)
        ctx = SimpleNamespace(survivors=Survivors(lens=lens), pieces=RowPieces((start, end)))
        piece = row_piece(ctx)
        owner = [b for b, n in enumerate(lens) for _ in range(n)]  # each row's request
        assert piece.rows == slice(start, end)
        assert piece.lens == [owner[start:end].count(b) for b in range(len(lens))]
        assert piece.ahead == [owner[:start].count(b) if piece.lens[b] else 0
                               for b in range(len(lens))]
        whole = row_piece(SimpleNamespace(survivors=Survivors(lens=lens), pieces=RowPieces()))
        assert (whole.rows, whole.lens, whole.ahead) == (slice(0, total), lens, [0] * len(lens))


def test_stage_keys_list_the_valid_prefix_then_the_first_survivors():
    rng = random.Random()
    for _ in range(50):
        runtime, ctx, req_to_token = _batch(rng)
        ctx.kv.views.clear()
        stage = rng.randint(1, DROPS)
        through = [rng.randint(0, n) for n in ctx.survivors.lens]
        kv_indptr, kv_indices, kv_pos = stage_keys(runtime, req_to_token, ctx, stage, through,
                                                   positions=True)
        for b, (ref_slots, ref_pos) in enumerate(
                _reference_keys(runtime, ctx, req_to_token, stage, through)):
            seg = slice(int(kv_indptr[b]), int(kv_indptr[b + 1]))
            assert torch.equal(kv_indices[seg], ref_slots)
            assert torch.equal(kv_pos[seg], ref_pos)


def _attention(q, q_pos, q_lens, keys, k_buf, v_buf, window):
    kv_indptr, kv_indices, kv_pos = keys
    q_indptr = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
    torch.cumsum(torch.tensor(q_lens), 0, out=q_indptr[1:])
    return kernels.positional_attention(q, q_pos, q_indptr, k_buf, v_buf, kv_indptr, kv_indices,
                                        kv_pos, DIM ** -0.5, window=window)


def _dense_reference(q, ctx, req_to_token, runtime, stage, k_buf, v_buf, window):
    """Each survivor's attention over the keys visible to it, in float64, one query at a time."""
    keys = _reference_keys(runtime, ctx, req_to_token, stage, ctx.survivors.lens)
    out, start = [], 0
    for b, n in enumerate(ctx.survivors.lens):
        slots, pos = keys[b]
        k = k_buf[slots].double().repeat_interleave(HEADS // KV_HEADS, 1)
        v = v_buf[slots].double().repeat_interleave(HEADS // KV_HEADS, 1)
        for i in range(start, start + n):
            p = ctx.survivors.positions[i]
            seen = (pos <= p) & ((pos >= p - window) if window >= 0 else True)
            logits = torch.einsum("hd,khd->hk", q[i].double(), k[seen]) * DIM ** -0.5
            out.append(torch.einsum("hk,khd->hd", torch.softmax(logits, -1), v[seen]))
        start += n
    return torch.stack(out)


def test_pieces_attend_as_the_whole_layer_would():
    """Per piece: keys through the piece's end (`stage_keys` over its rows ahead and its own),
    the piece's queries masked by position, as the window and positional layers run; the
    prefix of the Triton and FlashInfer pieces (valid prefix and rows ahead) lies before every
    row of the piece, so attending to it without a causal mask is exact."""
    rng = random.Random()
    for _ in range(12):
        runtime, ctx, req_to_token = _batch(rng)
        stage = rng.randint(1, DROPS)
        window = rng.choice((-1, -1, rng.randint(0, 80)))
        total = sum(ctx.survivors.lens)
        q = torch.randn(total, HEADS, DIM)
        k_buf = torch.randn(runtime.slots.num_slots, KV_HEADS, DIM)
        v_buf = torch.randn(runtime.slots.num_slots, KV_HEADS, DIM)
        ctx.kv.views.clear()
        survivors = ctx.survivors
        whole = _attention(q, survivors.positions, survivors.lens,
                           stage_keys(runtime, req_to_token, ctx, stage, survivors.lens, True),
                           k_buf, v_buf, window)
        pieced = torch.empty_like(whole)
        for start, end in _pieces(rng, total):
            ctx.pieces.span = (start, end)
            piece = row_piece(ctx)
            through = [a + n for a, n in zip(piece.ahead, piece.lens)]
            keys = stage_keys(runtime, req_to_token, ctx, stage, through, True)
            pieced[start:end] = _attention(q[start:end], survivors.positions[start:end],
                                           piece.lens, keys, k_buf, v_buf, window)
            prefix_indptr, _, prefix_pos = stage_keys(runtime, req_to_token, ctx, stage,
                                                      piece.ahead, True)
            first = start
            for b, n in enumerate(piece.lens):
                if n:
                    seg = prefix_pos[int(prefix_indptr[b]):int(prefix_indptr[b + 1])]
                    assert bool((seg < survivors.positions[first]).all())
                    first += n
        ctx.pieces.span = None
        reference = _dense_reference(q, ctx, req_to_token, runtime, stage, k_buf, v_buf, window)
        for out in (whole, pieced):
            assert not torch.isnan(out).any()
            error = (out.double() - reference).norm() / reference.norm().clamp_min(1e-12)
            assert error < 1e-5, error
        assert torch.allclose(pieced, whole, rtol=1e-5, atol=1e-6)


def test_the_drops_gather_in_place_equals_a_gather():
    rng = random.Random()
    for _ in range(100):
        n, width = rng.randint(2, 300), rng.randint(1, 24)
        x = torch.randn(n, width)
        rows = torch.tensor(sorted(rng.sample(range(n), rng.randint(1, n))))
        expected = x.index_select(0, rows)
        out = gather_in_place(x, rows, step=rng.randint(1, 64))
        assert out.data_ptr() == x.data_ptr()  # the survivors overwrite the first rows
        assert torch.equal(out, expected)
        strided = torch.randn(width + 1, n).T  # not contiguous: gathered to a new tensor
        expected = strided.index_select(0, rows)
        out = gather_in_place(strided, rows)
        assert out.data_ptr() != strided.data_ptr() and torch.equal(out, expected)


def test_a_rejoins_gather_from_its_sources_equals_a_gather_of_their_concatenation():
    """The step's own rows and each request's parked rows, gathered to the survivors in the
    (request, position) order a rejoin leaves them in: any order of rows, some sources unread."""
    rng = random.Random()
    for _ in range(100):
        width = rng.randint(1, 24)
        sources = [torch.randn(rng.randint(0 if i else 1, 80), width)
                   for i in range(rng.randint(1, 5))]
        n = sum(s.shape[0] for s in sources)
        rows = torch.tensor(rng.sample(range(n), rng.randint(1, n)), dtype=torch.int64)
        expected = torch.cat(sources).index_select(0, rows)
        assert torch.equal(gather_from_sources(sources, rows), expected)
