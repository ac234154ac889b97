"""Scoring rules of the benchmarks whose formats the local generators follow.

* RULER (Hsieh et al., 2024) scores a prediction against its references by plain substring
  match, case-insensitive: ``string_match_all`` (every task with several references: niah,
  vt, cwe, fwe) is the fraction of the references found; ``string_match_part`` (qa) is 1 if any
  reference is found. A case counts as right when its score is 1.
* SCBench (Li et al., 2025) scores its retrieval tasks (key-value retrieval, needles) per
  query by whether the expected string appears in the answer (case-insensitive): 1 or 0.

These are looser than the project's own check (``EvalCase.check``: whole words, and no wrong
answer such as a distractor's value may appear), which is kept beside them.
"""

from __future__ import annotations

from typing import Sequence

METRICS = ("string_match_all", "string_match_part", "scbench_match")


def _norm(text: str) -> str:
    return text.strip().lower()


def string_match_all(output: str, references: Sequence[str]) -> float:
    """Fraction of the references that occur in the output (substring, case-insensitive)."""
    if not references:
        raise ValueError("no references")
    out = _norm(output)
    return sum(r.lower() in out for r in references) / len(references)


def string_match_part(output: str, references: Sequence[str]) -> float:
    """1.0 if any reference occurs in the output (substring, case-insensitive), else 0.0."""
    if not references:
        raise ValueError("no references")
    out = _norm(output)
    return float(any(r.lower() in out for r in references))


def scbench_match(output: str, answer: str) -> float:
    """SCBench's retrieval rule for one query: 1.0 if the answer occurs in the output."""
    return float(answer.strip().lower() in _norm(output))


def score(metric: str, output: str, references: Sequence[str]) -> float:
    if metric == "string_match_all":
        return string_match_all(output, references)
    if metric == "string_match_part":
        return string_match_part(output, references)
    if metric == "scbench_match":
        if len(references) != 1:
            raise ValueError("scbench_match scores one answer")
        return scbench_match(output, references[0])
    raise ValueError(f"unknown metric {metric!r}; expected one of {METRICS}")
