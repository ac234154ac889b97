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
import functools
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
# schedules (a depth, a layer fraction), and the bar fidelity is held to.
DEFINITIONS = ("from 60% depth", "7/32 of the depth",
               "at least 95% agreement with at least 1.5x FLOP-ideal at 8K")
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

def _validation_figure(model: str):
    """(agree, dense-right, FLOP-ideal at the longest length) of the shipped profile of
    `model` on its reporting (validation) cases, the seed it was chosen on, as
    plot_fidelity_frontier.py reads them from the result files that
    fidelity/reporting_candidates.json lists for it."""
    import sys

    sys.path.insert(0, str(BENCHMARKS))
    import plot_fidelity_frontier as frontier

    spec = json.loads((frontier.FIDELITY / "reporting_candidates.json").read_text())
    (shipped,) = [c for c in frontier.candidate_rows(model, spec["models"][model])
                  if c["shipped"]]
    whole, longest = frontier.headline(shipped)
    return whole["agree"], whole["dense_right"], longest["flop_ideal"]


def validation_text(model: str) -> Callable[[dict], str]:
    def derive(_: dict) -> str:
        agree, right, speedup = _validation_figure(model)
        return f"{agree}/{right} dense-right cases ({agree / right:.0%}) at {speedup:.2f}x"
    return derive


# The shipped profiles (uniprefill_sglang/profiles/) by model_zoo name.
SHIPPED_PROFILES = {"smollm2": "smollm2-135m-instruct.json", "gemma3-270m": "gemma-3-270m.json"}


def shipped_profile(model: str) -> dict:
    return json.loads((REPO / "uniprefill_sglang" / "profiles" / SHIPPED_PROFILES[model])
                      .read_text())


@functools.lru_cache(maxsize=None)
def test_seed_evaluation(model: str) -> tuple[dict, dict]:
    """The shipped profile's recorded ``test_seed`` figure and the same figure derived again by
    fidelity_table.py from the result files it names, with the profile's drop layers."""
    import sys

    sys.path.insert(0, str(BENCHMARKS))
    import fidelity_table
    from transformers import AutoConfig

    from uniprefill_sglang.flops import FlopShape
    from uniprefill_sglang.tools.model_zoo import prepare_model

    profile = shipped_profile(model)
    recorded = profile["test_seed"]
    results = {path: json.loads((REPO / path).read_text()) for path in recorded["results"]}
    drop_layers = profile["schedule"]["drop_layers"]
    shape = FlopShape.from_config(AutoConfig.from_pretrained(prepare_model(model)))
    cases = [c for r in results.values() for c in r["cases"]]
    derived = fidelity_table.test_seed_figure(
        results, fidelity_table.rows(cases, "uniprefill", drop_layers, shape), drop_layers)
    return recorded, derived


def headline_text(model: str) -> Callable[[dict], str]:
    """The headline: the shipped profile on its test seed, agreement over all lengths and the
    FLOP-ideal speed-up at the longest."""
    def derive(result: dict) -> str:
        _, figure = test_seed_evaluation(model)
        if result["meta"]["case_fingerprint"] not in figure["case_fingerprints"]:
            raise ValueError(f"the result is none of the profile's test-seed results "
                             f"{figure['results']}")
        speedup = figure["flop_ideal_speedup"][str(max(figure["lengths"]))]
        return (f"{figure['agree']}/{figure['dense_right']} dense-right cases "
                f"({figure['agree'] / figure['dense_right']:.0%}) at {speedup:.2f}x")
    return derive


LENGTHS = ("8192", "32768", "65536", "131000")
# One run of benchmarks/defaults.py: every configuration and workload, one machine.
DEFAULTS_FILE = "defaults/defaults_item4_h100.json"


def _row(result: dict, config: str) -> dict:
    (row,) = [r for r in result["rows"] if r["config"] == config]
    return row


def _backends(chose: dict) -> str:
    """Prefill backend, and the decode backend where it differs."""
    decode = chose.get("decode_attention_backend")
    prefill = chose["attention_backend"]
    return prefill if decode in (None, prefill) else f"{prefill} / {decode}"


def defaults_row(config: str, label: str) -> Callable[[dict], str]:
    """One row of the summary's single-request table: the backends as SGLang chose them, the
    median time to first token per length, stock's (SGLang's pick, same file) over it, and
    the share of the 131K prompt left after its last drop."""
    def derive(result: dict) -> str:
        row, stock = _row(result, config), _row(result, "stock")["single"]
        single = row["single"]
        times = " / ".join(f"{single[n]['ttft_s']:.3f}" for n in LENGTHS[:2]) + " / " + \
            " / ".join(f"{single[n]['ttft_s']:.2f}" for n in LENGTHS[2:])
        kept = single["131000"].get("kept_tokens")
        share = f"{kept[-1] / kept[0]:.0%}" if kept else "–"
        speedups = " / ".join(f"{stock[n]['ttft_s'] / single[n]['ttft_s']:.2f}x"
                              for n in LENGTHS)
        return (f"| {label} | {_backends(row['sglang_chose'])} | {times} s | {speedups} | "
                f"{share} |")
    return derive


# The other workloads, as (how a row's value is read, how the summary prints it).
WORKLOAD_CELLS = (
    (lambda r: r["short_batch"]["median_s"], "{:.3f} s"),
    (lambda r: r["mid_batch"]["seconds"], "{:.3f} s"),
    (lambda r: r["follow_ups"]["32768"]["median_s"] * 1e3, "{:.1f} ms"),
    (lambda r: r["follow_ups"]["65536"]["median_s"] * 1e3, "{:.1f} ms"),
    (lambda r: r["decode_itl_ms"], "{:.2f} ms"),
)


def workloads_row(config: str, label: str) -> Callable[[dict], str]:
    """One row of the summary's workload table: each workload's time, with stock's time over
    it in brackets (above 1: faster than stock), and the KV capacity at start-up."""
    def derive(result: dict) -> str:
        row, stock = _row(result, config), _row(result, "stock")
        cells = []
        for value, form in WORKLOAD_CELLS:
            mine = value(row)
            text = form.format(mine)
            cells.append(text if config == "stock" else f"{text} ({value(stock) / mine:.2f}x)")
        return f"| {label} | {' | '.join(cells)} | {row['max_total_num_tokens']:,} |"
    return derive


# The summary's label of each configuration's row.
LABELS = {
    "stock": "stock, no backend flag",
    "stock_flashinfer": "stock, `--attention-backend flashinfer`",
    "defaults": "`--enable-uniprefill`",
    "top_p": "`--enable-uniprefill --uniprefill-top-p 0.6`",
    "keep": "`--enable-uniprefill --uniprefill-keep-ratio 0.5,0.8`",
}
# The summary's tables, row by row: (configuration, the row as the summary prints it).
DEFAULTS_TABLE = (
    ("stock",
     "| stock, no backend flag | fa3 | 0.222 / 1.207 / 3.34 / 10.41 s | 1.00x / 1.00x / 1.00x / 1.00x | – |"),
    ("stock_flashinfer",
     "| stock, `--attention-backend flashinfer` | flashinfer | 0.227 / 1.485 / 4.50 / 15.18 s | 0.98x / 0.81x / 0.74x / 0.69x | – |"),
    ("defaults",
     "| `--enable-uniprefill` | fa3 / flashinfer | 0.225 / 1.241 / 3.36 / 10.26 s | 0.99x / 0.97x / 0.99x / 1.01x | 95% |"),
    ("top_p",
     "| `--enable-uniprefill --uniprefill-top-p 0.6` | fa3 / flashinfer | 0.113 / 0.501 / 1.28 / 3.75 s | 1.96x / 2.41x / 2.60x / 2.77x | 5% |"),
    ("keep",
     "| `--enable-uniprefill --uniprefill-keep-ratio 0.5,0.8` | fa3 / flashinfer | 0.122 / 0.547 / 1.39 / 4.03 s | 1.81x / 2.21x / 2.40x / 2.58x | 17% |"),
)
WORKLOADS_TABLE = (
    ("stock",
     "| stock, no backend flag | 0.958 s | 1.659 s | 25.0 ms | 30.0 ms | 6.53 ms | 410,620 |"),
    ("stock_flashinfer",
     "| stock, `--attention-backend flashinfer` | 0.995 s (0.96x) | 1.761 s (0.94x) | 33.5 ms (0.75x) | 34.8 ms (0.86x) | 6.57 ms (1.00x) | 410,620 |"),
    ("defaults",
     "| `--enable-uniprefill` | 0.973 s (0.99x) | 1.770 s (0.94x) | 30.9 ms (0.81x) | 31.5 ms (0.95x) | 6.59 ms (0.99x) | 410,620 |"),
    ("top_p",
     "| `--enable-uniprefill --uniprefill-top-p 0.6` | 0.958 s (1.00x) | 1.220 s (1.36x) | 35.5 ms (0.70x) | 37.4 ms (0.80x) | 6.51 ms (1.00x) | 410,620 |"),
    ("keep",
     "| `--enable-uniprefill --uniprefill-keep-ratio 0.5,0.8` | 0.956 s (1.00x) | 1.218 s (1.36x) | 35.5 ms (0.70x) | 37.3 ms (0.80x) | 6.68 ms (0.98x) | 828,574 |"),
)

# The shipped profiles' test-seed figures (their `test_seed` field): (model, the result file at
# the longest length, the figure as both pages print it: agreement over every length run,
# FLOP-ideal at the longest).
TEST_SEED_HEADLINES = (
    ("smollm2", "fidelity/eval_smollm2_shipped_test_7600.json", "22/22 dense-right cases (100%) at 1.61x"),
    ("gemma3-270m", "fidelity/eval_gemma3_270m_shipped_test_7600.json", "14/15 dense-right cases (93%) at 1.54x"),
)

def block_sparse_agreement(configs: tuple, suffix: str) -> Callable[[dict], str]:
    """Agreement on dense-right cases, the same in every named configuration of a fidelity file
    (an evaluation suite's `--sweep custom`), as "a/n" + suffix."""
    def derive(result: dict) -> str:
        cells = {(c["agree"], c["dense_correct"])
                 for name in configs for c in result["summary"][name]["all"].values()
                 if "agree" in c}
        (agree, right), = cells
        return f"{agree}/{right}{suffix}"
    return derive


def flop_ideal_combination(tokens: int, density: float) -> Callable[[dict], str]:
    """`flop_ideal_block_sparse.py`'s FLOP-ideal of dropping with block-sparse attention."""
    def derive(result: dict) -> str:
        row, = [r for r in result["rows"] if r["tokens"] == tokens and r["density"] == density]
        return f"{row['both']:.1f}x at 131K"
    return derive


def stock_over(configs: tuple, template: str) -> Callable[[dict], str]:
    """Stock's 131K time to first token over each named row's, in one serving result file."""
    def derive(result: dict) -> str:
        stock = _row(result, "stock")["single"]["131000"]["ttft_s"]
        return template.format(*(stock / _row(result, c)["single"]["131000"]["ttft_s"]
                                 for c in configs))
    return derive


BOTH_09 = "block_sparse_estimate=both,block_sparse_top_p=0.9"
BLOCK_SPARSE_SERVING = "block_sparse/block_sparse_serving_h100.json"

FIGURES: list = [
    *(Figure(SUMMARY, text, DEFAULTS_FILE, defaults_row(config, LABELS[config]))
      for config, text in DEFAULTS_TABLE),
    *(Figure(SUMMARY, text, DEFAULTS_FILE, workloads_row(config, LABELS[config]))
      for config, text in WORKLOADS_TABLE),
    # The headline, on both pages: each shipped profile on its test seed.
    *(Figure(page, text, result, headline_text(model))
      for model, result, text in TEST_SEED_HEADLINES for page in (FRONT_PAGE, SUMMARY)),
    # Validation figures: the reporting seed the shipped profiles were chosen on.
    Figure(SUMMARY, "47/48 dense-right cases (98%) at 1.62x",
           "fidelity/eval_smollm2_two_drops_reporting.json", validation_text("smollm2")),
    Figure(SUMMARY, "43/45 dense-right cases (96%) at 1.59x",
           "fidelity/eval_gemma3_270m_top_p_095_099_reporting.json",
           validation_text("gemma3-270m")),
    # Block-sparse attention (estimate both, top-p 0.9) on the test seed, and its FLOP-ideal.
    Figure(FRONT_PAGE, "10/10 alone and over the drops",
           "fidelity/eval_smollm2_block_sparse_last_queries_test_7600.json",
           block_sparse_agreement((BOTH_09 + ",keep_ratio=1.0", BOTH_09),
                                  " alone and over the drops")),
    Figure(FRONT_PAGE, "15/15 alone",
           "fidelity/eval_gemma3_270m_block_sparse_last_queries_test_7600.json",
           block_sparse_agreement((BOTH_09 + ",keep_ratio=1.0",), " alone")),
    Figure(FRONT_PAGE, "over the drops 14/15",
           "fidelity/eval_gemma3_270m_block_sparse_over_drops_test_7600.json",
           lambda result: "over the drops " + block_sparse_agreement((BOTH_09,), "")(result)),
    Figure(FRONT_PAGE, "6.4x at 131K", "block_sparse/flop_ideal_llama31_8b.json",
           flop_ideal_combination(131000, 0.1)),
    # ... and as served, against dropping alone in the same run.
    Figure(FRONT_PAGE, "1.66x against stock fa3, where keep 0.5,0.8 alone gave 2.58x",
           BLOCK_SPARSE_SERVING,
           stock_over(("keep_block_sparse", "keep"),
                      "{:.2f}x against stock fa3, where keep 0.5,0.8 alone gave {:.2f}x")),
]
