"""benchmarks/needle_ranks.py: the needle's rank and mass, and the scores it ranks by."""

from __future__ import annotations

import pytest
import torch

from benchmark_script import load_benchmark
from uniprefill_sglang.kernels.reference import score_segment_reference

ranks = load_benchmark("needle_ranks")


def test_rank_and_mass_of_the_needles_lowest_block():
    scores = torch.tensor([9.0, 4.0, 1.0, 3.0, 2.0, 7.0])
    droppable = torch.tensor([False, True, True, True, True, False])
    # droppable scores 4, 1, 3, 2 (total 10); block 3 ranks second, block 2 last
    assert ranks.needle_rank(scores, droppable, [3]) == pytest.approx({"rank": 0.25, "mass": 0.7})
    assert ranks.needle_rank(scores, droppable, [3, 2]) == pytest.approx({"rank": 0.75, "mass": 1.0})
    assert ranks.needle_rank(scores, droppable, [0, 5]) == {"rank": None, "mass": None}


@pytest.mark.parametrize("seed", range(3))
def test_head_scores_sum_to_the_selections_scores(seed):
    g = torch.Generator().manual_seed(seed)
    m, window, hq, hkv, d = 90, 12, 4, 2, 8
    q = torch.randn(20, hq, d, generator=g)
    k = torch.randn(m, hkv, d, generator=g)
    per_head = ranks.head_scores(q, k, 0.3, window)
    expected = score_segment_reference(q[-window:], torch.arange(m - window, m), k,
                                       torch.arange(m), 0.3)
    assert not per_head.isnan().any()
    torch.testing.assert_close(per_head.sum(0), expected, rtol=1e-5, atol=1e-6)
    droppable = torch.ones(m, dtype=torch.bool)
    normalised = ranks.variants(per_head, droppable)["headnorm"]
    torch.testing.assert_close(normalised.sum(), torch.tensor(float(hq)), rtol=1e-5, atol=1e-5)
