"""The named seed sets every generated case draws from, disjoint so that no figure is chosen on
the cases it reports:

* ``TUNING_SEEDS`` (0-999): what calibration and any other choice of settings may look at.
* ``REPORTING_SEEDS`` (1000-1999): the validation set, used to choose among candidate settings
  (profiles, block sizes) once tuning is done; its figures are validation figures. The name
  ``reporting`` is kept because recorded commands use it.
* ``TEST_SEEDS`` (2000-2999): evaluated once per shipped profile, after the choice; the figure
  a profile records and the headline uses. On these seeds the ``essay`` and ``manual``
  haystacks are fresh text too (``haystacks.units``), not only the needles.
"""

from __future__ import annotations

TUNING_SEEDS = tuple(range(0, 1000))
REPORTING_SEEDS = tuple(range(1000, 2000))
TEST_SEEDS = tuple(range(2000, 3000))

SEED_SETS = {"tuning": TUNING_SEEDS, "reporting": REPORTING_SEEDS, "test": TEST_SEEDS}


def seed_set(seed: int) -> str:
    """``"tuning"``, ``"reporting"`` (validation) or ``"test"``; a seed in none raises."""
    for name, seeds in SEED_SETS.items():
        if seeds[0] <= seed <= seeds[-1]:
            return name
    raise ValueError(f"seed {seed} is in none of the seed sets "
                     + ", ".join(f"{n} ({s[0]}-{s[-1]})" for n, s in SEED_SETS.items()))


def parse_seeds(text: str) -> list[int]:
    """``"0,1"``, or a named set's first seeds: ``"reporting:3"`` (1000, 1001, 1002),
    ``"tuning:2"`` (0, 1), ``"test:1"`` (2000)."""
    if ":" in text:
        name, k = text.split(":", 1)
        if name not in SEED_SETS:
            raise ValueError(f"unknown seed set {name!r}; expected one of {', '.join(SEED_SETS)}")
        if not k.isdigit() or not 0 < int(k) <= len(SEED_SETS[name]):
            raise ValueError(f"{text!r}: the count after ':' must be 1-{len(SEED_SETS[name])}")
        return list(SEED_SETS[name][:int(k)])
    return [int(x) for x in text.split(",") if x]
