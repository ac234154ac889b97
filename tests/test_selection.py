"""The drop's selection on its own: `select_survivors` (the kernels) against its plain reference,
on fresh random batches: several requests, cached prefixes that are scored but never candidates,
GQA, top-p and keep ratios, blocks cut short at the end of a request; the attention mass each
request's selection lets go, against the reference and the rule's own bounds."""

from __future__ import annotations

import random

import pytest
import torch

from uniprefill_sglang.selection import (
    DropCandidates,
    SelectionRule,
    prefix_coverage,
    prefix_coverage_reference,
    select_by_position,
    keep_top_neighbors,
    keep_top_neighbors_reference,
    select_survivors,
    select_survivors_reference,
)


def random_batch(seed: int, heads=(4, 2), dim=16, num_slots=4096, neighbor_blocks=0):
    """A batch of 1-4 requests with random keys in a slot pool and random queries."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    key_buffer = torch.randn(num_slots, hkv, dim, generator=gen) * rng.choice([0.5, 2.0, 4.0])
    free = torch.randperm(num_slots, generator=gen).tolist()
    c = DropCandidates(None, None, [], None, None, [], [], [], [])
    queries, query_pos, slots, positions = [], [], [], []
    for _ in range(rng.randint(1, 4)):
        prefix, new = rng.choice([0, 0, 7, 150]), rng.randint(1, 700)
        n = prefix + new
        # A prefix whose earlier tokens were dropped: its positions have holes.
        pos = sorted(rng.sample(range(prefix + rng.randint(0, 40)), prefix)) + list(
            range(prefix + 40, prefix + 40 + new))
        num_q = min(rng.choice([1, 16, 64]), new)
        slots.append(torch.tensor([free.pop() for _ in range(n)]))
        positions.append(torch.tensor(pos))
        queries.append(torch.randn(num_q, hq, dim, generator=gen))
        query_pos.append(torch.tensor(pos[-num_q:]))
        c.query_counts.append(num_q)
        c.key_counts.append(n)
        c.prefix_counts.append(prefix)
        ratio = rng.choice([0.0, 0.0, 0.3, 0.5, 1.0])
        c.keep_ratio.append(ratio)
        c.top_p.append(rng.choice([0.5, 0.9, 0.99, 1.0]))
    c.queries, c.query_pos = torch.cat(queries), torch.cat(query_pos)
    c.key_slots, c.key_pos = torch.cat(slots), torch.cat(positions)
    rule = SelectionRule(block_size=rng.choice([8, 32, 64]), sink_tokens=rng.choice([0, 16]),
                         last_window=rng.choice([0, 8]), neighbor_blocks=neighbor_blocks)
    return c, key_buffer, dim ** -0.5, rule


@pytest.mark.parametrize("seed,neighbor_blocks", [(s, 0) for s in range(12)]
                         + [(s, n) for s in range(200, 206) for n in (1, 4)])
def test_select_survivors_matches_the_reference(seed, neighbor_blocks, monkeypatch):
    monkeypatch.delenv("UNIPREFILL_FORCE_TRITON", raising=False)
    cands, key_buffer, scale, rule = random_batch(seed, neighbor_blocks=neighbor_blocks)
    got, want = (fn(cands, key_buffer, scale, rule)
                 for fn in (select_survivors, select_survivors_reference))
    keep_idx, counts, want_idx, want_counts = got.keep_idx, got.counts, want.keep_idx, want.counts
    assert counts.tolist() == want_counts.tolist()
    assert keep_idx.tolist() == want_idx.tolist()
    num_candidates = sum(k - p for k, p in zip(cands.key_counts, cands.prefix_counts))
    assert 0 < len(want_idx) <= num_candidates
    assert all(0 < c for c in want_counts.tolist())  # the top block always survives


def attending_to(*spans, top_p=0.9, keep_ratio=0.0, dim=8, n=256):
    """One request of `n` keys and one query that aligns with the keys in `spans` only: (its
    candidates, the key buffer, the softmax scale)."""
    key_buffer = torch.zeros(n, 1, dim)
    for span in spans:
        key_buffer[span, 0, 0] = 50.0
    q = torch.zeros(1, 1, dim)
    q[0, 0, 0] = 1.0
    cands = DropCandidates(q, torch.tensor([n - 1]), [1], torch.arange(n), torch.arange(n), [n],
                           [0], [top_p], [keep_ratio])
    return cands, key_buffer, dim ** -0.5


def test_reference_keeps_the_attended_block():
    """One query that attends to one block only: top-p keeps that block (and the sinks)."""
    cands, key_buffer, scale = attending_to(slice(100, 108))
    rule = SelectionRule(block_size=32, sink_tokens=4, last_window=0)
    want = select_survivors_reference(cands, key_buffer, scale, rule)
    keep_idx, counts = want.keep_idx, want.counts
    assert keep_idx.tolist() == list(range(4)) + list(range(96, 128))
    got = select_survivors(cands, key_buffer, scale, rule)
    got_idx, got_counts = got.keep_idx, got.counts
    assert got_idx.tolist() == keep_idx.tolist() and got_counts.tolist() == counts.tolist()


# ---- the neighbours of the top blocks --------------------------------------------------------
@pytest.mark.parametrize("seed", range(300, 312))
def test_top_neighbors_match_their_reference(seed):
    """On fresh random scores, keep masks and batches (positions with holes, blocks cut short):
    the vectorised step equals its plain reference, adds only blocks next to top blocks, and
    with N = 0 changes nothing."""
    cands, _, _, rule = random_batch(seed)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(cands.key_pos.shape[0], generator=gen, dtype=torch.float64) ** 4
    num_cands = sum(k - p for k, p in zip(cands.key_counts, cands.prefix_counts))
    keep = torch.rand(num_cands, generator=gen) < rng.choice([0.0, 0.2, 0.6])
    for n in (0, 1, 3):
        rule_n = SelectionRule(rule.block_size, rule.sink_tokens, rule.last_window, n)
        got, counts = keep_top_neighbors(cands, scores, keep, rule_n)
        assert got.tolist() == keep_top_neighbors_reference(cands, scores, keep, rule_n), (seed, n)
        assert (got | ~keep).all()  # nothing kept before is dropped
        assert counts.tolist() == _segment_sums(got, cands)
        if n == 0:
            assert got.tolist() == keep.tolist()


def _segment_sums(mask, cands):
    out, start = [], 0
    for k, p in zip(cands.key_counts, cands.prefix_counts):
        out.append(int(mask[start:start + k - p].sum()))
        start += k - p
    return out


def test_top_neighbors_keep_both_halves_of_a_cut_needle():
    """A query attends to keys 88-95 only, the end of block 2 (block size 32), and not to the
    needle's continuation at 96-99 (block 3); top-p 0.9 keeps block 2 alone. With one neighbour
    block, blocks 1 and 3 come back, the continuation among them; the mass let go shrinks."""
    cands, key_buffer, scale = attending_to(slice(88, 96))
    for fn in (select_survivors, select_survivors_reference):
        alone = fn(cands, key_buffer, scale, SelectionRule(32, 0, 0))
        assert alone.keep_idx.tolist() == list(range(64, 96))
        both = fn(cands, key_buffer, scale, SelectionRule(32, 0, 0, neighbor_blocks=1))
        assert both.keep_idx.tolist() == list(range(32, 128))
        assert both.counts.tolist() == [96]
        assert float(both.dropped_mass[0]) < float(alone.dropped_mass[0])


# ---- the attention mass a selection lets go ---------------------------------------------------
@pytest.mark.parametrize("seed", range(100, 116))
def test_dropped_mass_matches_the_reference(seed, monkeypatch):
    monkeypatch.delenv("UNIPREFILL_FORCE_TRITON", raising=False)
    cands, key_buffer, scale, rule = random_batch(seed)
    got = select_survivors(cands, key_buffer, scale, rule).dropped_mass
    want = select_survivors_reference(cands, key_buffer, scale, rule).dropped_mass
    assert got.shape == want.shape == (cands.num_segments,)
    assert got.dtype == torch.float64 and not torch.isnan(got).any(), got
    assert ((0 <= got) & (got <= 1)).all() and ((0 <= want) & (want <= 1)).all(), (got, want)
    # float32 scores against float64 ones: a relative bound, exact where nothing is dropped.
    assert ((got - want).abs() <= 1e-4 * want + 1e-12).all(), (got, want)
    for b in range(cands.num_segments):
        if cands.keep_ratio[b] == 1.0 or (cands.keep_ratio[b] == 0 and cands.top_p[b] == 1.0):
            assert float(got[b]) == 0.0 == float(want[b])  # keeps every block
        elif cands.keep_ratio[b] == 0:  # top-p keeps blocks holding at least p of the mass
            assert float(want[b]) <= 1 - cands.top_p[b] + 1e-12, (b, want, cands.top_p[b])


def _two_needles(keep_ratio: float, top_p: float = 1.0):
    """One query that attends equally to two blocks of eight (keys 100-107 and 200-207)."""
    cands, key_buffer, scale = attending_to(slice(100, 108), slice(200, 208), top_p=top_p,
                                            keep_ratio=keep_ratio)
    return cands, key_buffer, scale, SelectionRule(block_size=32, sink_tokens=0, last_window=0)


def test_dropped_mass_is_the_share_on_the_dropped_blocks():
    # One block of eight kept, one of the two needles': half of the mass is let go.
    for fn in (select_survivors, select_survivors_reference):
        sel = fn(*_two_needles(keep_ratio=1 / 8))
        assert sel.keep_idx.tolist() in (list(range(96, 128)), list(range(192, 224)))
        assert abs(float(sel.dropped_mass[0]) - 0.5) < 1e-4, sel.dropped_mass
        # Both needles kept: what is let go is the unaligned keys' share, almost nothing.
        sel = fn(*_two_needles(keep_ratio=0.0, top_p=0.9))
        assert sorted(set(sel.keep_idx.tolist()) & {100, 200}) == [100, 200]
        assert 0.0 < float(sel.dropped_mass[0]) < 1e-4, sel.dropped_mass


def test_prefix_keys_are_scored_but_count_in_no_share():
    """Three equal needles, one in a cached prefix (keys 0-127, scored, never candidates) and
    two among the candidates: keeping one candidate block of four lets go half of the
    candidates' mass (a third of all the keys' mass)."""
    dim, n = 8, 256
    key_buffer = torch.zeros(n, 1, dim)
    for start in (100, 150, 200):
        key_buffer[start:start + 8, 0, 0] = 50.0
    q = torch.zeros(1, 1, dim)
    q[0, 0, 0] = 1.0
    cands = DropCandidates(q, torch.tensor([n - 1]), [1], torch.arange(n), torch.arange(n), [n],
                           [128], [1.0], [0.25])
    rule = SelectionRule(block_size=32, sink_tokens=0, last_window=0)
    for fn in (select_survivors, select_survivors_reference):
        sel = fn(cands, key_buffer, dim ** -0.5, rule)
        # candidates 128-159 or 192-223: one needle's block
        assert sel.keep_idx.tolist() in (list(range(0, 32)), list(range(64, 96)))
        assert abs(float(sel.dropped_mass[0]) - 0.5) < 1e-4, sel.dropped_mass


# ---- prefix reuse: does a cached selection cover a new question? ---------------------------
def _as_coverage_batch(cands: DropCandidates, seed: int):
    """The same batch with every key a candidate (a cached prefix is scored with the rest) and a
    random half of each request's prefix missing from the cache."""
    gen = torch.Generator().manual_seed(seed + 1000)
    cached = []
    for n, prefix in zip(cands.key_counts, cands.prefix_counts):
        held = torch.rand(prefix, generator=gen) < 0.5
        cached += [held, torch.ones(n - prefix, dtype=torch.bool)]
    full = DropCandidates(cands.queries, cands.query_pos, cands.query_counts, cands.key_slots,
                          cands.key_pos, cands.key_counts, [0] * cands.num_segments, cands.top_p,
                          cands.keep_ratio)
    return full, torch.cat(cached)


@pytest.mark.parametrize("seed", range(8))
def test_prefix_coverage_matches_the_reference(seed, monkeypatch):
    monkeypatch.delenv("UNIPREFILL_FORCE_TRITON", raising=False)
    cands, key_buffer, scale, rule = random_batch(seed)
    full, cached = _as_coverage_batch(cands, seed)
    got = prefix_coverage(full, key_buffer, scale, rule, cached)
    want = prefix_coverage_reference(full, key_buffer, scale, rule, cached)
    for g, w in ((got.missing, want.missing), (got.dropped, want.dropped)):
        assert not torch.isnan(g).any()
        assert torch.allclose(g.double(), w, rtol=1e-4, atol=1e-6), (g, w)
        assert ((0 <= w) & (w <= 1 + 1e-9)).all()
    assert got.covered(0.05).tolist() == want.covered(0.05).tolist()


def test_a_cache_that_holds_everything_covers_any_question():
    cands, key_buffer, scale, rule = random_batch(3)
    full, cached = _as_coverage_batch(cands, 3)
    cov = prefix_coverage(full, key_buffer, scale, rule, torch.ones_like(cached))
    assert cov.missing.tolist() == [0.0] * full.num_segments
    assert cov.covered(0.0).all()


def test_a_cache_that_lost_the_attended_block_does_not_cover():
    """One query attends to one block of a cached prefix; the cache dropped it."""
    cands, key_buffer, scale = attending_to(slice(100, 108))
    rule = SelectionRule(block_size=32, sink_tokens=4, last_window=0)
    cached = torch.ones(key_buffer.shape[0], dtype=torch.bool)
    cached[96:128] = False
    for fn in (prefix_coverage, prefix_coverage_reference):
        cov = fn(cands, key_buffer, scale, rule, cached)
        assert float(cov.missing[0]) > 0.9 and not bool(cov.covered(0.01)[0])


@pytest.mark.parametrize("seed", range(4))
def test_coverage_and_selection_agree_on_what_is_dropped(seed, monkeypatch):
    """With every key a candidate, prefix coverage's `dropped` is the selection's own mass."""
    monkeypatch.delenv("UNIPREFILL_FORCE_TRITON", raising=False)
    cands, key_buffer, scale, rule = random_batch(seed)
    full, cached = _as_coverage_batch(cands, seed)
    coverage = prefix_coverage(full, key_buffer, scale, rule, cached)
    mass = select_survivors(full, key_buffer, scale, rule).dropped_mass
    assert ((coverage.dropped - mass).abs() <= 1e-9 + 1e-9 * mass).all(), (coverage.dropped, mass)


@pytest.mark.parametrize("seed", range(6))
def test_positional_selection_keeps_every_other_block_sinks_and_last_window(seed):
    """UNIPREFILL_TEST_SELECTION=positional against a plain loop over each request's
    candidates."""
    cands, _, _, rule = random_batch(seed)
    got = select_by_position(cands, rule)
    want_keep, want_counts = [], []
    k_ptr = 0
    for n_keys, n_prefix in zip(cands.key_counts, cands.prefix_counts):
        pos = cands.key_pos[k_ptr + n_prefix:k_ptr + n_keys].tolist()
        keep = [p < rule.sink_tokens or i >= len(pos) - rule.last_window
                or (p // rule.block_size) % 2 == 0 for i, p in enumerate(pos)]
        want_keep += keep
        want_counts.append(sum(keep))
        k_ptr += n_keys
    assert got.keep_mask.tolist() == want_keep
    assert got.counts.tolist() == want_counts
    assert got.dropped_mass.tolist() == [0.0] * cands.num_segments
