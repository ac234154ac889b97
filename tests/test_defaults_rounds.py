"""benchmarks/defaults.py's summary over rounds (fresh engine processes per configuration):
per configuration, the median over rounds of each round's single-request TTFT and follow-up
median, on hand-made rows of random values."""

import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from defaults import summarize_rounds  # noqa: E402


def test_summary_is_the_median_over_rounds_per_configuration():
    rng = random.Random()
    rows, want = [], {}
    for round_no in range(3):
        for name in ("stock", "defaults"):
            single = {str(n): {"ttft_s": round(rng.uniform(0.1, 2.0), 4)} for n in (8192, 32768)}
            follow = {"32768": {"median_s": round(rng.uniform(0.02, 0.05), 4)}}
            rows.append({"config": name, "round": round_no, "single": single,
                         "follow_ups": follow})
            for n, v in single.items():
                want.setdefault((name, "single", n), []).append(v["ttft_s"])
            want.setdefault((name, "follow_ups", "32768"), []).append(follow["32768"]["median_s"])
    rows.append({"config": "keep", "round": 0, "exit_code": 1})  # a configuration that failed
    summary = summarize_rounds(rows)
    assert summary["keep"] == {"rounds": 1}
    for (name, key, n), values in want.items():
        got = summary[name][key][n]
        assert got["rounds_s"] == values
        assert got["median_s"] == round(statistics.median(values), 4)
    assert summary["stock"]["rounds"] == summary["defaults"]["rounds"] == 3
