"""benchmarks/dropped_mass_bound.py replays `--uniprefill-max-dropped-mass` over recorded cases:
checked against a case-by-case count on fresh random cases."""

from __future__ import annotations

import random

from benchmark_script import load_benchmark


def _case(rng):
    n = rng.randrange(1000, 8000)
    return {"dense": {"bench_correct": rng.random() < 0.8},
            "runs": {"uniprefill": {"bench_correct": rng.random() < 0.7,
                                    "dropped_mass": [rng.random() * 0.02],
                                    "kept_tokens": [n, rng.randrange(1, n)]}}}


def test_replay_counts_each_case_once():
    replay = load_benchmark("dropped_mass_bound").replay_bound
    rng = random.Random()
    cases = [_case(rng) for _ in range(60)]
    for bound in (0.0, rng.random() * 0.02, 1.0):
        got = replay(cases, "uniprefill", bound)
        right = [c for c in cases if c["dense"]["bench_correct"]]
        runs = [c["runs"]["uniprefill"] for c in right]
        over = [r for r in runs if r["dropped_mass"][0] > bound]
        assert got["cases"] == len(right) and got["turned_dense"] == len(over)
        assert got["losses_turned"] == sum(not r["bench_correct"] for r in over)
        # A turned request answers as dense; the others keep their answer.
        assert got["agreement"] == len(over) + sum(
            r["bench_correct"] for r in runs if r["dropped_mass"][0] <= bound)
    assert replay(cases, "uniprefill", 1.0)["turned_dense"] == 0
    assert replay(cases, "uniprefill", -1.0)["agreement"] == replay(cases, "uniprefill", 0)["cases"]


def test_the_bound_read_off_losses_turns_each_of_them_dense():
    module = load_benchmark("dropped_mass_bound")
    rng = random.Random()
    cases = [_case(rng) for _ in range(60)]
    bound = module.bound_below_losses(cases, "uniprefill")
    lost = [c for c in cases if c["dense"]["bench_correct"]
            and not c["runs"]["uniprefill"]["bench_correct"]]
    assert lost and bound is not None
    got = module.replay_bound(cases, "uniprefill", bound)
    assert got["losses_turned"] == len(lost) and got["agreement"] == got["cases"]
    # The largest such bound: the smallest lost mass itself would leave that case sparse.
    smallest = min(c["runs"]["uniprefill"]["dropped_mass"][0] for c in lost)
    assert bound < smallest
    assert module.replay_bound(cases, "uniprefill", smallest)["losses_turned"] == len(lost) - 1
    for c in lost:
        c["runs"]["uniprefill"]["bench_correct"] = True
    assert module.bound_below_losses(cases, "uniprefill") is None
