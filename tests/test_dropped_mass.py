"""The attention mass each drop lets go (`meta_info["uniprefill"][i]["dropped_mass"]`) and the
first drop's bound on it (`--uniprefill-max-dropped-mass`, per request
`uniprefill_max_dropped_mass`), in SGLang's CPU engine on the real SmolLM2-135M-Instruct.

One engine whose server bound is 0.0: a request that would drop anything runs dense from its
first drop (and answers as `uniprefill: false` does); requests that lift the bound drop and
report what they let go. The selection's mass itself is checked against its float64 reference
in test_selection.py.
"""

from __future__ import annotations

import os
import random
import re

import pytest

from uniprefill_sglang.tools.cpu_engine import flush_cache, make_cpu_engine, uniprefill_state

pytestmark = pytest.mark.engine

GREEDY = {"temperature": 0.0, "max_new_tokens": 6}
META = "uniprefill"
BOUND_KNOB = "uniprefill_max_dropped_mass"
DROP_LAYERS = "6,14,22"


def _prompt(seed: int, n_sentences: int) -> str:
    rng = random.Random(seed)
    names = ["Ada", "Bruno", "Chen", "Dana", "Emil", "Farah"]
    places = ["the harbour", "the library", "a small farm", "the old mill"]
    things = ["a red kite", "a brass key", "seven apples", "a lantern"]
    story = " ".join(f"{rng.choice(names)} walked to {rng.choice(places)} and found "
                     f"{rng.choice(things)}." for _ in range(n_sentences))
    return (f"Read the story and answer the question.\n\n{story}\n\nThe secret word is "
            "'marmalade'.\n\nQuestion: What is the secret word?\nAnswer:")


PROMPT = _prompt(3, 80)  # about 1.2K tokens

REQUESTS = {
    "bounded": {},  # the server's bound, 0.0
    "off": {"uniprefill": False},
    "keep_all": {"uniprefill_keep_ratio": 1.0},  # lets nothing go: under any bound
    "ratio": {BOUND_KNOB: 1.0, "uniprefill_keep_ratio": 0.5},
    "top_p": {BOUND_KNOB: 1.0, "uniprefill_top_p": 0.9},
    "top_p_per_drop": {BOUND_KNOB: 1.0, "uniprefill_top_p": [1.0, 0.9]},  # the last repeats
    "knob_bound": {BOUND_KNOB: 0.001, "uniprefill_keep_ratio": 0.5},
}


@pytest.fixture(scope="module")
def bound_run(smollm2_path):
    previous = os.environ.get("UNIPREFILL_CHECK_KV_LENS")
    os.environ["UNIPREFILL_CHECK_KV_LENS"] = "1"  # the scheduler inherits it
    try:
        # Three drops (SmolLM2's shipped profile has one), so that later drops are seen too.
        engine = make_cpu_engine(smollm2_path, enable_uniprefill=True,
                                 uniprefill_drop_layers=DROP_LAYERS,
                                 uniprefill_max_dropped_mass=0.0)
    finally:
        if previous is None:
            os.environ.pop("UNIPREFILL_CHECK_KV_LENS")
        else:
            os.environ["UNIPREFILL_CHECK_KV_LENS"] = previous
    try:
        run = {"drop_layers": uniprefill_state(engine)["drop_layers"]}
        for name, knobs in REQUESTS.items():
            flush_cache(engine)  # no request reuses another's cached prompt
            out = engine.generate(PROMPT, dict(GREEDY, custom_params=knobs))
            prefill = [e for e in out["meta_info"][META] if e["reason"] != "decode"]
            run[name] = (out, prefill[-1])
        return run
    finally:
        engine.shutdown()


def test_each_drop_reports_the_mass_it_let_go(bound_run):
    drops = len(bound_run["drop_layers"])
    assert drops == 3, bound_run["drop_layers"]
    for name in ("ratio", "top_p"):
        entry = bound_run[name][1]
        assert entry["enabled"] and entry["reason"] is None, entry
        masses, kept = entry["dropped_mass"], entry["kept_tokens"]
        assert len(masses) == drops == len(kept) - 1, entry
        assert all(isinstance(m, float) and 0.0 <= m <= 1.0 for m in masses), entry
        assert masses[0] > 0.0 and kept[1] < kept[0], entry  # the first drop let some go
        for k, m in enumerate(masses):  # nothing dropped at a drop: nothing let go
            assert (m == 0.0) == (kept[k + 1] == kept[k]), entry
    # Top-p keeps blocks holding at least 0.9 of the mass it scores at each drop.
    assert all(m <= 0.1 + 1e-4 for m in bound_run["top_p"][1]["dropped_mass"])


def test_a_top_p_per_drop_applies_at_its_drop(bound_run):
    """[1.0, 0.9]: the first drop keeps every block, the second and third keep 0.9 of the mass
    (the last value repeats)."""
    entry = bound_run["top_p_per_drop"][1]
    assert entry["enabled"] and entry["reason"] is None, entry
    masses, kept = entry["dropped_mass"], entry["kept_tokens"]
    assert masses[0] == 0.0 and kept[1] == kept[0], entry
    assert masses[1] > 0.0 and kept[2] < kept[1], entry
    assert all(m <= 0.1 + 1e-4 for m in masses[1:]), entry


def test_keeping_every_block_lets_nothing_go_and_passes_a_zero_bound(bound_run):
    entry = bound_run["keep_all"][1]
    assert entry["reason"] is None, entry
    assert entry["dropped_mass"] == [0.0] * len(bound_run["drop_layers"]), entry
    assert set(entry["kept_tokens"]) == {entry["kept_tokens"][0]}, entry
    assert bound_run["keep_all"][0]["output_ids"] == bound_run["off"][0]["output_ids"]


def test_a_request_over_the_bound_runs_dense_and_says_why(bound_run):
    out, entry = bound_run["bounded"]
    drops = len(bound_run["drop_layers"])
    assert entry["enabled"], entry
    assert entry["reason"].startswith("over the dropped-mass bound"), entry
    assert "--uniprefill-max-dropped-mass 0;" in entry["reason"], entry
    assert entry["kept_tokens"] == [out["meta_info"]["prompt_tokens"]] * (drops + 1), entry
    assert entry["dropped_mass"] == [0.0] * drops, entry  # it let nothing go
    off = bound_run["off"]
    assert off[1]["enabled"] is False and off[1]["reason"] == "disabled by the request"
    assert out["output_ids"] == off[0]["output_ids"]
    assert len(out["output_ids"]) == GREEDY["max_new_tokens"]


def test_a_per_request_bound_names_the_knob_and_the_mass_it_measured(bound_run):
    out, entry = bound_run["knob_bound"]
    assert f'custom_params["{BOUND_KNOB}"] 0.001;' in entry["reason"], entry
    # The mass it names is what the same selection let go where the bound was lifted.
    measured = float(re.search(r"would let go ([0-9.e-]+) of", entry["reason"]).group(1))
    free = bound_run["ratio"][1]["dropped_mass"][0]
    assert free > 0.001 and abs(measured - free) <= 1e-3 * free, (entry, free)
    assert set(entry["kept_tokens"]) == {entry["kept_tokens"][0]}, entry
    assert out["output_ids"] == bound_run["off"][0]["output_ids"]
