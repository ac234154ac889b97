"""benchmarks/dropped_mass_bound.py replays `--uniprefill-max-dropped-mass` over recorded cases:
checked against a case-by-case count on fresh random cases."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path


def _load():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "dropped_mass_bound.py"
    spec = importlib.util.spec_from_file_location("dropped_mass_bound", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _case(rng):
    n = rng.randrange(1000, 8000)
    return {"dense": {"bench_correct": rng.random() < 0.8},
            "runs": {"uniprefill": {"bench_correct": rng.random() < 0.7,
                                    "dropped_mass": [rng.random() * 0.02],
                                    "kept_tokens": [n, rng.randrange(1, n)]}}}


def test_replay_counts_each_case_once():
    replay = _load().replay_bound
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
