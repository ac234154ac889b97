"""The measured figures the front page (README.md) and the results summary (benchmarks/README.md,
section Summary) state, each tied to the result file its measuring script wrote.

A `Figure` names its page, the text as the page prints it, the result file (under
`benchmarks/results/`) and how that text follows from the file. `tests/test_figures.py` derives
every text again from its file, checks that the file's header was written by the measuring
script (command, date, commit, device, SGLang version), and that neither page states a measured
figure (a ratio, a time, a share, a count of cases) that no `Figure` holds: a figure cannot drift
from its file, and a page cannot carry one without a file.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Callable

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
RESULTS = BENCHMARKS / "results"
FRONT_PAGE = "README.md"
SUMMARY = "benchmarks/README.md#summary"

# What a page's prose may state that is no measurement: definitions of the method and its
# schedules (a depth, a layer fraction).
DEFINITIONS = ("from 60% depth", "7/32 of the depth")
# A measured figure: a ratio (2.5x), a time (1.25 s, 22 ms), a share (98%), cases (47/48).
MEASURED = re.compile(r"\b\d+(?:\.\d+)?x\b|\b\d+(?:\.\d+)? m?s\b|\b\d+(?:\.\d+)?%|\b\d+/\d+\b")


@dataclasses.dataclass(frozen=True)
class Figure:
    page: str
    text: str
    result: str  # path under benchmarks/results/
    derive: Callable[[dict], str]

    def load(self) -> dict:
        return json.loads((RESULTS / self.result).read_text())


def page_text(page: str) -> str:
    """The prose of `page` (code blocks left out); for the summary, its section alone."""
    path, _, section = page.partition("#")
    text = (REPO / path).read_text()
    if section:
        start = text.index(f"\n## {section.capitalize()}\n")
        end = text.find("\n## ", start + 1)
        text = text[start:end if end > 0 else None]
    return re.sub(r"```.*?```", "", text, flags=re.S)


def untied(page: str, figures, text: str | None = None) -> list:
    """The measured figures of `page` (or of `text`, as if it were that page) that no figure
    of `figures` holds."""
    text = page_text(page) if text is None else text
    held = [f.text for f in figures if f.page == page] + list(DEFINITIONS)
    covered = [(m.start(), m.end()) for t in held for m in re.finditer(re.escape(t), text)]
    # Link targets are no figures.
    covered += [(m.start(), m.end()) for m in re.finditer(r"\]\([^)]*\)", text)]
    return [m.group() for m in MEASURED.finditer(text)
            if not any(a <= m.start() and m.end() <= b for a, b in covered)]


# ---- how figures follow from result files

def _fidelity_headline(model: str):
    """(agree, dense-right, FLOP-ideal at the longest length) of the shipped profile of
    `model` on its reporting cases, as plot_fidelity_frontier.py reads them from the result
    files that fidelity/reporting_candidates.json lists for it."""
    import sys

    sys.path.insert(0, str(BENCHMARKS))
    import plot_fidelity_frontier as frontier

    spec = json.loads((frontier.FIDELITY / "reporting_candidates.json").read_text())
    (shipped,) = [c for c in frontier.candidate_rows(model, spec["models"][model])
                  if c["shipped"]]
    whole, longest = frontier.headline(shipped)
    return whole["agree"], whole["dense_right"], longest["flop_ideal"]


def fidelity_text(model: str) -> Callable[[dict], str]:
    def derive(_: dict) -> str:
        agree, right, speedup = _fidelity_headline(model)
        return f"{agree}/{right} dense-right cases ({agree / right:.0%}) at {speedup:.2f}x"
    return derive


FIGURES: list = [
    Figure(SUMMARY, "47/48 dense-right cases (98%) at 1.62x",
           "fidelity/eval_smollm2_two_drops_reporting.json", fidelity_text("smollm2")),
    Figure(SUMMARY, "43/45 dense-right cases (96%) at 1.59x",
           "fidelity/eval_gemma3_270m_top_p_095_099_reporting.json", fidelity_text("gemma3-270m")),
]
