"""benchmarks/fidelity_table.py: agreement and FLOP-ideal per length over recorded cases,
checked against a case-by-case count on fresh random cases."""

from __future__ import annotations

import random

from uniprefill_sglang.architectures import FULL_ATTENTION
from uniprefill_sglang.flops import FlopShape, flop_ideal_speedup

from benchmark_script import load_benchmark

SHAPE = FlopShape(num_heads=4, head_dim=16, attention_params=4 * 64 * 64, mlp_params=3 * 64 * 128,
                  layer_kinds=(FULL_ATTENTION,) * 6)


def _case(rng, i):
    length = rng.choice([2048, 4096])
    n = length - rng.randrange(16)
    first = rng.randrange(n // 2, n + 1)
    return {"name": f"case{i}", "target_tokens": length,
            "dense": {"bench_correct": rng.random() < 0.8},
            "runs": {"uniprefill": {"bench_correct": rng.random() < 0.8,
                                    "kept_tokens": [n, first, rng.randrange(1, first + 1)]}}}


def test_rows_count_each_case_once():
    rng = random.Random()
    cases = [_case(rng, i) for i in range(40)]
    rows = load_benchmark("fidelity_table").rows(cases, "uniprefill", (2, 4), SHAPE)
    rows = {r["length"]: r for r in rows}
    assert sorted(rows, key=str) == sorted([2048, 4096, "all"], key=str)
    for length, row in rows.items():
        group = [c for c in cases if length == "all" or c["target_tokens"] == length]
        right = [c for c in group if c["dense"]["bench_correct"]]
        lost = [c["name"] for c in right if not c["runs"]["uniprefill"]["bench_correct"]]
        assert row["dense_right"] == len(right) and row["agree"] == len(right) - len(lost)
        assert row["lost"] == lost
        kept = [c["runs"]["uniprefill"]["kept_tokens"] for c in group]
        for stage in (1, 2):
            mean = sum(k[stage] / k[0] for k in kept) / len(kept)
            assert abs(row["kept_per_drop"][stage - 1] - mean) < 1e-12
        assert row["flop_ideal"] == flop_ideal_speedup(kept, (2, 4), SHAPE) >= 1.0
