"""RULER's aggregation families, generated locally: common- and frequent-words extraction.

No needle here: the answer is a property of the whole context, so every part of it counts.

* ``cwe`` (common-words extraction): a numbered list of made-up words ("1. talomu 2. resiko
  ..."); ``CWE_COMMON`` words appear ``CWE_COMMON_FREQ`` times each (fewer below ~2K
  tokens, where that many would not fit: ``cwe_common_freq``), every other word
  ``CWE_RARE_FREQ`` times, in a seeded order. Asked for the common ones; the budget is filled
  with more rare words.
* ``fwe`` (frequent-words extraction): a "coded text" of made-up words drawn from a Zipf-like
  law (the r-th word ``floor(n / (r^2 * H))`` times of ``n`` words, H the normaliser, over
  ``FWE_VOCAB`` words), shuffled. Asked for the three most frequent (strictly more frequent
  than the fourth at every length).

Words are fixed-length (six letters for ``cwe``, five for ``fwe``), so no word occurs inside
another and RULER's substring rule cannot be fooled. Called through ``tasks.make_case``; each
builder returns ``(build(n) -> (context, question, primer), answers, meta)`` as tasks.py's do.
"""

from __future__ import annotations

import random

CWE_COMMON = 10
CWE_COMMON_FREQ = 15
CWE_RARE_FREQ = 3
FWE_VOCAB = 100
FWE_TOP = 3
FWE_ALPHA = 2.0

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def _word_stream(rng: random.Random):
    """Distinct six-letter consonant-vowel words, forever (prefix-stable for one rng)."""
    seen: set = set()
    while True:
        w = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(3))
        if w not in seen:
            seen.add(w)
            yield w


class _Words:
    def __init__(self, rng: random.Random):
        self._it = _word_stream(rng)
        self.words: list[str] = []

    def first(self, k: int) -> list[str]:
        while len(self.words) < k:
            self.words.append(next(self._it))
        return self.words[:k]


def cwe_common_freq(target_tokens: int) -> int:
    """How often each common word appears: ``CWE_COMMON_FREQ`` from ~2K tokens on, less
    below (a numbered item is ~6 tokens; the common words take at most ~70% of the budget)."""
    return max(2 * CWE_RARE_FREQ, min(CWE_COMMON_FREQ, target_tokens // (CWE_COMMON * 9)))


def _cwe(rng: random.Random, target_tokens: int):
    freq = cwe_common_freq(target_tokens)
    base = rng.random()
    pool = _Words(random.Random(f"cwe-words:{base}"))
    common = pool.first(CWE_COMMON)
    head = ("Below is a numbered list of words. Some of the words appear more often than the "
            "others. Memorize the ones that appear most often.")
    question = f"What are the {CWE_COMMON} most common words in the list above?"
    primer = f"Answer: The top {CWE_COMMON} words that appear most often in the list are:"

    def build(n: int):
        rare = pool.first(CWE_COMMON + n)[CWE_COMMON:]
        items = common * freq + rare * CWE_RARE_FREQ
        random.Random(f"cwe-order:{base}:{n}").shuffle(items)
        listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
        return f"{head}\n{listing}", question, primer

    # A rare word adds CWE_RARE_FREQ numbered items of >= 3 tokens each.
    return build, list(common), {"unit_tokens": 3 * CWE_RARE_FREQ, "common_freq": freq}


def fwe_counts(n: int) -> list[int]:
    """Occurrences of the r-th most frequent coded word (r = 1..FWE_VOCAB) in an ``n``-word
    draw; non-increasing in r, non-decreasing in n."""
    weights = [1.0 / (r ** FWE_ALPHA) for r in range(1, FWE_VOCAB + 1)]
    total = sum(weights)
    return [int(n * w / total) for w in weights]


def _fwe(rng: random.Random):
    base = rng.random()
    wrng = random.Random(f"fwe-words:{base}")
    vocab: list[str] = []
    while len(vocab) < FWE_VOCAB:
        w = "".join(wrng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(5))
        if w not in vocab:
            vocab.append(w)
    head = ("Read the coded text below and keep track of how often each coded word appears. "
            f"You will be asked which {FWE_TOP} coded words appear most often.")
    question = f"What are the {FWE_TOP} most frequently appearing coded words in the text above?"
    primer = (f"Answer: According to the coded text above, the {FWE_TOP} most frequently "
              "appearing coded words are:")
    # Below this many words the top three are not strictly ahead of the fourth.
    min_n = next(n for n in range(1, 10_000)
                 if fwe_counts(n)[FWE_TOP - 1] > fwe_counts(n)[FWE_TOP])

    def build(n: int):
        n = n + min_n
        words = [w for w, c in zip(vocab, fwe_counts(n)) for _ in range(c)]
        random.Random(f"fwe-order:{base}:{n}").shuffle(words)
        return f"{head}\n\n{' '.join(words)}", question, primer

    return build, vocab[:FWE_TOP], {"unit_tokens": 1}


def build(task: str, rng: random.Random, target_tokens: int):
    if task == "cwe":
        return _cwe(rng, target_tokens)
    if task == "fwe":
        return _fwe(rng)
    raise ValueError(f"unknown aggregation task {task!r}")
