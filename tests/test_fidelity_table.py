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


def _result(rng, seeds, engine_kwargs=None, drops=2):
    cases = [_case(rng, i) for i in range(30)]
    for c in cases:
        c["runs"]["uniprefill"]["kept_tokens"] = c["runs"]["uniprefill"]["kept_tokens"][:drops + 1]
    return {"header": {"date": "2026-12-06", "commit": "abc1234", "sglang": "0.5.23"},
            "meta": {"seeds": seeds, "engine_kwargs": engine_kwargs or {}, "tasks": ["passkey"],
                     "depths": [0.5], "case_fingerprint": "f" * 16},
            "configs": [{"name": "uniprefill", "engine": {}, "custom": {}}], "cases": cases}


def test_a_test_seed_figure_is_recorded_in_the_profile_and_nothing_else_changes(tmp_path):
    import json

    import pytest

    ft = load_benchmark("fidelity_table")
    rng = random.Random()
    result = _result(rng, [2000])
    rows = ft.rows(result["cases"], "uniprefill", (2, 4), SHAPE)
    figure = ft.test_seed_figure({"r.json": result}, rows, (2, 4))
    whole = rows[-1]
    assert (figure["agree"], figure["dense_right"]) == (whole["agree"], whole["dense_right"])
    assert figure["agreement"] == round(whole["agree"] / whole["dense_right"], 4)
    assert figure["seeds"] == [2000] and figure["lengths"] == [2048, 4096]
    assert figure["flop_ideal_speedup"]["4096"] == round(rows[1]["flop_ideal"], 3)
    assert figure["meets_bar"] == (whole["agree"] >= 0.95 * whole["dense_right"]
                                   and rows[1]["flop_ideal"] >= 1.5)
    assert figure["results"] == ["r.json"] and figure["commits"] == ["abc1234"]

    profile = tmp_path / "p.json"
    original = {"format": "uniprefill-profile/1", "schedule": {"drop_layers": [2, 4],
                "top_p": [0.99], "block_size": 32}, "note": "é"}
    profile.write_text(json.dumps(original, indent=1) + "\n")
    ft.record_test_seed(profile, figure)
    written = json.loads(profile.read_text())
    assert written.pop("test_seed") == figure and written == original

    for bad in (_result(rng, [1000]), _result(rng, [2000, 5]), _result(rng, []),
                _result(rng, [2000], {"uniprefill_top_p": 0.9}), _result(rng, [2000], drops=1)):
        with pytest.raises(ValueError):
            ft.test_seed_figure({"r.json": bad}, ft.rows(bad["cases"], "uniprefill", (2, 4),
                                                          SHAPE), (2, 4))
