"""Tensor parallelism on the CPU: two gloo processes, each scoring with half the heads.

The path under test is the one the runtime takes at every drop with TP > 1: each rank scores its
own head slice (kernels.score_tokens), `TPScoreAgreement.reduce_scores` sums the slices, and
kernels.select_tokens selects. Every rank must keep exactly the same rows, and the same rows a
single process keeps with all heads; the debug check must catch a rank that disagrees.
"""

from __future__ import annotations

import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from uniprefill_sglang import kernels
from uniprefill_sglang.tp_agreement import TPAgreementError, TPScoreAgreement

WORLD = 2
HQ, HKV, D = 8, 4, 32
BLOCK, SINKS, LAST = 16, 16, 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch(seed: int):
    """Two requests of fresh random lengths, keys in a shuffled slot pool, like the runtime's."""
    g = torch.Generator().manual_seed(seed)
    lens = [int(x) for x in torch.randint(300, 700, (2,), generator=g)]
    total = sum(lens)
    k_cache = torch.randn(total + 50, HKV, D, generator=g)
    # A few keys per request attract the last queries, so top-p has something to find.
    k_slots = torch.randperm(total + 50, generator=g)[:total]
    k_pos = torch.cat([torch.arange(n) for n in lens])
    q_parts, q_pos = [], []
    for n in lens:
        q_parts.append(torch.randn(LAST, HQ, D, generator=g))
        q_pos.append(torch.arange(n - LAST, n))
    q = torch.cat(q_parts)
    hot = torch.randint(0, total, (12,), generator=g)
    k_cache[k_slots[hot]] += 2.0 * q.mean(0)[:HKV]
    q_indptr = torch.tensor([0, LAST, 2 * LAST], dtype=torch.int32)
    k_indptr = torch.tensor([0, lens[0], total], dtype=torch.int32)
    return q, torch.cat(q_pos), q_indptr, k_cache, k_slots, k_pos, k_indptr


def _select(scores, k_pos, k_indptr, top_p, keep_ratio):
    return kernels.select_tokens(
        scores, k_pos, k_indptr, torch.zeros(2, dtype=torch.int64), BLOCK,
        torch.tensor([top_p] * 2), torch.tensor([keep_ratio] * 2), SINKS, LAST)


def _drop_on_rank(rank: int, batch, top_p: float, keep_ratio: float, agreement):
    """What one rank does at a drop layer: score its heads, agree on the sum, select."""
    q, q_pos, q_indptr, k_cache, k_slots, k_pos, k_indptr = batch
    hq, hkv = HQ // WORLD, HKV // WORLD
    q_local = q[:, rank * hq:(rank + 1) * hq].contiguous()
    k_local = k_cache[:, rank * hkv:(rank + 1) * hkv].contiguous()
    scores = kernels.score_tokens(q_local, q_pos, q_indptr, k_local, k_slots, k_pos, k_indptr,
                                  D ** -0.5)
    scores = agreement.reduce_scores(scores)
    keep_idx, counts = _select(scores, k_pos, k_indptr, top_p, keep_ratio)
    return scores, keep_idx, counts


def _worker(rank: int, port: int, seeds, results):
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=WORLD)
        agreement = TPScoreAgreement(dist.group.WORLD, range(WORLD))
        out = []
        for seed in seeds:
            batch = _batch(seed)
            for top_p, keep_ratio in ((0.9, 0.0), (0.97, 0.0), (1.0, 0.3)):
                scores, keep_idx, counts = _drop_on_rank(rank, batch, top_p, keep_ratio, agreement)
                agreement.verify(keep_idx, counts)  # the debug check passes on agreeing ranks
                out.append((seed, top_p, keep_ratio, scores, keep_idx, counts))
        # A rank that kept one row fewer must be caught on every rank.
        caught = False
        try:
            agreement.verify(keep_idx[:-1] if rank == 1 else keep_idx, counts)
        except TPAgreementError:
            caught = True
        results[rank] = {"runs": out, "caught": caught}
        dist.destroy_process_group()
    except Exception:
        results[rank] = {"error": traceback.format_exc()}


@pytest.fixture(scope="module")
def two_ranks():
    seeds = [int.from_bytes(os.urandom(2), "little") for _ in range(3)]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(_free_port(), seeds, results), nprocs=WORLD, join=True)
        results = dict(results)
    for rank in range(WORLD):
        assert "error" not in results[rank], results[rank]["error"]
    return seeds, results


def test_ranks_hold_bit_identical_scores_and_keep_identical_rows(two_ranks):
    _, results = two_ranks
    runs0, runs1 = results[0]["runs"], results[1]["runs"]
    assert len(runs0) == len(runs1) == 9
    for r0, r1 in zip(runs0, runs1):
        assert torch.isfinite(r0[3]).all()
        assert torch.equal(r0[3], r1[3])  # the same bits, not merely close
        assert torch.equal(r0[4], r1[4]) and torch.equal(r0[5], r1[5])


def test_split_heads_select_what_all_heads_select(two_ranks):
    seeds, results = two_ranks
    dropped_somewhere = False
    for seed, top_p, keep_ratio, scores, keep_idx, counts in results[0]["runs"]:
        q, q_pos, q_indptr, k_cache, k_slots, k_pos, k_indptr = _batch(seed)
        full = kernels.score_tokens(q, q_pos, q_indptr, k_cache, k_slots, k_pos, k_indptr,
                                    D ** -0.5)
        torch.testing.assert_close(scores, full, rtol=1e-5, atol=1e-6)
        ref_idx, ref_counts = _select(full, k_pos, k_indptr, top_p, keep_ratio)
        assert torch.equal(keep_idx, ref_idx), (seed, top_p, keep_ratio)
        assert torch.equal(counts.to(torch.int64), ref_counts.to(torch.int64))
        dropped_somewhere |= int(counts.sum()) < int(k_indptr[-1])
    assert dropped_somewhere  # the cases exercise a real selection


def test_the_debug_check_catches_a_disagreeing_rank(two_ranks):
    _, results = two_ranks
    assert results[0]["caught"] and results[1]["caught"]
