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
