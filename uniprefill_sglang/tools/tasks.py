"""Long-context tasks, generated locally and deterministically (no downloads).

Every case is built for one tokenizer and fills a token budget (``target_tokens``) with a
haystack, as long as possible without exceeding it; ``depth`` (0 = start, 1 = end) places the
asked-for item. The RULER-style suite (``TASKS``, what ``benchmarks/eval_suite.py`` runs):

* ``niah_number`` / ``niah_uuid`` / ``niah_word``: single needle ("The special magic number for
  <key> is: <value>.") in repeated noise sentences; value a 7-digit number, a UUID-like string
  (``xxxxxxxx-xxxx-xxxx``) or a word.
* ``niah_multikey``: four needles with different keys (three distractors at seeded positions);
  one is asked for.
* ``niah_multivalue``: one key, four values (first at ``depth``, the others at seeded
  positions); all four asked for (``recall`` keeps the fraction found).
* ``vt``: variable tracking, ``VAR X = 12345`` at ``depth`` then a chain of four
  ``VAR Y = VAR X`` hops at seeded later positions; asked for every variable holding the value.
* ``qa``: question answering over distractor documents: short made-up "documents" about
  made-up places, one of which answers the question (at ``depth``), the rest are distractors of
  the same template about other places.

``RULER_TASKS`` adds RULER's remaining synthetic families (the last two in
``aggregation_tasks.py``):

* ``niah_multiquery``: four needles with different keys, all four asked at once.
* ``cwe``: common-words extraction, a numbered list of words where ten words recur often and
  the rest a few times each; asked for the ten common ones.
* ``fwe``: frequent-words extraction, a "coded text" of made-up words drawn Zipf-like; asked
  for the three most frequent.

The needle tasks (``HAYSTACK_TASKS``) take ``haystack``: ``noise`` (the default, RULER's
repeated noise sentences), ``prose`` (plain sentences of our own) or ``essay`` (an essay of our
own, repeated); see ``haystacks.py``. Shared-context cases (one context, several questions, as
SCBench sends them) are built by ``shared_context_tasks.py``.

Two simpler retrieval tasks (``RETRIEVAL_TASKS``, the CPU fidelity test and the demo):

* ``passkey``: a 5-digit pass key hidden at ``depth`` inside the noise sentences.
* ``kv``: a block of ``kv_pairs=4`` key-value lines (UUID-like keys, 5-digit values) hidden at
  ``depth``, one of them asked for; ``kv_style="sentence"`` (default) writes each line as
  ``The value of key <k> is <v>.``, ``kv_style="colon"`` as ``<k>: <v>``. A reply that also
  names another line's value is wrong. SmolLM2-135M-Instruct (dense, fp32, 1K tokens): 4
  sentence lines 4/6, 4 colon lines 3/6, 16 lines 1/6, a context made only of key-value lines
  (the classic KV-retrieval task) 0/6, which is why that variant is not generated.

A case is correct (``check``) when every expected answer appears in the output as a whole word
(case-insensitive) and no wrong answer does. ``score`` is RULER's own rule instead
(``scoring.py``): the fraction of the answers found as substrings (``string_match_all``; ``qa``:
``string_match_part``), with no penalty for naming a distractor.

Seeds (``seeds.py``): ``TUNING_SEEDS`` (0-999, what calibration and any other choice of settings
may look at), ``REPORTING_SEEDS`` (1000-1999, the validation set that chooses among candidates)
and ``TEST_SEEDS`` (2000-2999, evaluated once per shipped profile, with fresh ``essay`` and
``manual`` text) are disjoint; ``seed_set`` names a seed's set.

Prompts are ``fmt="plain"`` (context, question, then an answer primer the model completes:
what SmolLM2-135M-Instruct does best, e.g. pass key at 1K 6/6 plain, 4/6 chat), ``fmt="chat"``
(chat template, primer at the start of the assistant turn; needs a chat template) or
``fmt="chat_noprimer"`` (chat template, no primer). Token ids are the tokenizer's own encoding
*with* its special tokens (Gemma's ``<bos>``; SmolLM2 adds none).

Randomness comes only from ``random.Random(f"{task}:{seed}")`` (and the haystacks' per-round
``random.Random(f"{kind}:{seed}:{round}")``, ``essay`` and ``manual`` on test seeds only): the
same task and seed give the
same key, value and distractors at every length and depth (only the haystack and the position
change), and the same tokenizer gives the same ids on every machine.

Usage::

    cases = make_cases(tokenizer, tasks=("passkey", "kv"), lengths=(1024, 2048))
    out = engine.generate(input_ids=case.input_ids,
                          sampling_params={"temperature": 0, "max_new_tokens": case.max_new_tokens})
    case.check(out["text"])
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from uniprefill_sglang.tools import haystacks as _haystacks
from uniprefill_sglang.tools import scoring as _scoring
from uniprefill_sglang.tools.seeds import (REPORTING_SEEDS, TEST_SEEDS, TUNING_SEEDS,  # noqa: F401
                                         parse_seeds, seed_set)

TASKS = (
    "niah_number",
    "niah_uuid",
    "niah_word",
    "niah_multikey",
    "niah_multivalue",
    "vt",
    "qa",
)
RETRIEVAL_TASKS = ("passkey", "kv")
RULER_TASKS = TASKS + ("niah_multiquery", "cwe", "fwe")
# Tasks whose context is a haystack with needles in it (the ``haystack`` parameter).
HAYSTACK_TASKS = ("niah_number", "niah_uuid", "niah_word", "niah_multikey", "niah_multivalue",
                  "niah_multiquery", "vt", "passkey", "kv")
FORMATS = ("plain", "chat", "chat_noprimer")
KV_STYLES = ("sentence", "colon")

# Answer lengths in tokens are small; these leave room for a short preamble in the output.
MAX_NEW_TOKENS = {
    "niah_number": 12,
    "niah_uuid": 24,
    "niah_word": 8,
    "niah_multikey": 12,
    "niah_multivalue": 36,
    "vt": 28,
    "qa": 10,
    "passkey": 12,
    "kv": 12,
    "niah_multiquery": 40,
    "cwe": 64,
    "fwe": 24,
}

FILLER_SENTENCES = _haystacks.NOISE_SENTENCES

_WORDS = (
    "apple", "river", "candle", "falcon", "harbor", "meadow", "pepper", "silver", "tunnel",
    "violet", "walnut", "lantern", "marble", "orchid", "pebble", "rocket", "saddle", "timber",
    "anchor", "basket", "cactus", "dragon", "engine", "forest", "garlic", "helmet", "island",
    "jacket", "kettle", "ladder", "magnet", "napkin", "oyster", "parrot", "quartz", "ribbon",
    "salmon", "tomato", "umpire", "velvet", "window", "yogurt", "zipper", "bridge", "castle",
    "desert", "feather", "glacier", "hammer", "iguana", "jungle", "koala", "lemon", "mirror",
)
_ADJECTIVES = (
    "quiet", "bright", "hollow", "frozen", "gentle", "rapid", "golden", "hidden", "purple",
    "ancient", "brave", "clever", "dusty", "eager", "fancy", "grumpy", "humble", "icy",
)
_SYLLABLES = ("ka", "lo", "mer", "vin", "dra", "so", "tel", "bru", "nia", "gor", "pe", "zan",
              "ri", "mo", "tha", "qui", "ven", "las", "dor", "fi")


@dataclass
class EvalCase:
    task: str
    target_tokens: int
    depth: float
    seed: int
    fmt: str
    prompt: str
    input_ids: list[int]
    answers: list[str]  # all must appear in the output
    question: str
    max_new_tokens: int
    wrong_answers: list[str] = field(default_factory=list)  # none may appear
    meta: dict[str, Any] = field(default_factory=dict)
    haystack: str = "noise"
    metric: str = "string_match_all"  # the benchmark's own rule (scoring.py)

    @property
    def n_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def name(self) -> str:
        variant = f"-{self.meta['variant']}" if "variant" in self.meta else ""
        hay = "" if self.haystack == "noise" else f"-{self.haystack}"
        return f"{self.task}{variant}{hay}-{self.target_tokens}-d{self.depth:g}-s{self.seed}"

    def score(self, output_text: str) -> float:
        """The benchmark's own score of an output (RULER's rule: ``metric``), in [0, 1]."""
        return _scoring.score(self.metric, output_text, self.answers)

    def recall(self, output_text: str) -> float:
        """Fraction of the expected answers found in the output."""
        found = sum(_contains(output_text, a) for a in self.answers)
        return found / len(self.answers)

    def check(self, output_text: str) -> bool:
        """Every expected answer and no wrong one appears in the output (whole words,
        case-insensitive)."""
        return (all(_contains(output_text, a) for a in self.answers)
                and not any(_contains(output_text, w) for w in self.wrong_answers))


def _contains(text: str, answer: str) -> bool:
    # Whole-word match: "1234567" must not count inside "12345678", "VAR AB" not in "VAR ABC".
    pat = r"(?<![0-9A-Za-z])" + re.escape(answer) + r"(?![0-9A-Za-z])"
    return re.search(pat, text, flags=re.IGNORECASE) is not None


# ---------------------------------------------------------------------------------------------
# building blocks


def _uuid_like(rng: random.Random) -> str:
    h = "0123456789abcdef"
    return "-".join("".join(rng.choice(h) for _ in range(n)) for n in (8, 4, 4))


def _key(rng: random.Random, used: set) -> str:
    while True:
        k = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_WORDS)}"
        if k not in used:
            used.add(k)
            return k


def _value(rng: random.Random, kind: str, used: set) -> str:
    while True:
        if kind == "number":
            v = str(rng.randint(1000000, 9999999))
        elif kind == "uuid":
            v = _uuid_like(rng)
        elif kind == "word":
            v = rng.choice(_WORDS)
        else:
            raise ValueError(kind)
        if v not in used:
            used.add(v)
            return v


def _noise(n: int) -> list[str]:
    return [FILLER_SENTENCES[i % len(FILLER_SENTENCES)] for i in range(n)]


def _insert(units: list[str], items: Sequence[tuple[float, str]]) -> list[str]:
    """Insert each (relative position, text) into ``units``; equal positions keep their order."""
    out = list(units)
    n = len(units)
    # Insert from the back so earlier indices stay valid; stable for equal positions.
    for pos, text in sorted(items, key=lambda x: x[0], reverse=True):
        out.insert(round(pos * n), text)
    return out


def _spread(rng: random.Random, k: int, lo: float = 0.0, hi: float = 1.0) -> list[float]:
    return [rng.uniform(lo, hi) for _ in range(k)]


def _name(rng: random.Random, used: set, parts: int = 3) -> str:
    while True:
        s = "".join(rng.choice(_SYLLABLES) for _ in range(parts)).capitalize()
        if s not in used:
            used.add(s)
            return s


# ---------------------------------------------------------------------------------------------
# tasks: each returns (head, build(n) -> (context, question, primer), answers, meta)

_NIAH_HEAD = ("Some special magic {kind}s are hidden inside the following text. "
              "Make sure to memorize them. I will quiz you about the {kind}s afterwards.")
_NIAH_LINE = "The special magic {kind} for {key} is: {value}."
_KIND_NOUN = {"number": "number", "uuid": "uuid", "word": "word"}


def _niah(rng, kind: str, depth: float, n_keys: int, n_values: int, fill=None,
          n_queries: int = 1):
    """Needles "The special magic <kind> for <key> is: <value>."; key 0 (n_values values) at
    ``depth``, the other keys (one value each) at seeded positions; the first ``n_queries`` keys
    are asked (the rest are distractors)."""
    fill = fill or _noise
    noun = _KIND_NOUN[kind]
    used_k: set = set()
    used_v: set = set()
    keys = [_key(rng, used_k) for _ in range(n_keys)]
    values = [[_value(rng, kind, used_v) for _ in range(n_values if i == 0 else 1)]
              for i in range(n_keys)]
    # Asked key's values: the first at depth, the rest at seeded positions; distractor keys too.
    items = [(depth, _NIAH_LINE.format(kind=noun, key=keys[0], value=values[0][0]))]
    for pos, v in zip(_spread(rng, n_values - 1), values[0][1:]):
        items.append((pos, _NIAH_LINE.format(kind=noun, key=keys[0], value=v)))
    for pos, k, vs in zip(_spread(rng, n_keys - 1), keys[1:], values[1:]):
        items.append((pos, _NIAH_LINE.format(kind=noun, key=k, value=vs[0])))
    head = _NIAH_HEAD.format(kind=noun)
    if n_queries > 1:
        asked = keys[:n_queries]
        names = ", ".join(asked[:-1]) + f" and {asked[-1]}"
        question = f"What are all the special magic {noun}s for {names} mentioned in the text?"
        primer = f"The special magic {noun}s for {names} mentioned in the text are:"
    elif n_values == 1:
        question = f"What is the special magic {noun} for {keys[0]} mentioned in the text?"
        primer = f"The special magic {noun} for {keys[0]} mentioned in the text is:"
    else:
        question = (f"What are all the special magic {noun}s for {keys[0]} mentioned in the "
                    "text?")
        primer = f"The special magic {noun}s for {keys[0]} mentioned in the text are:"

    def build(n: int):
        return " ".join([head, *_insert(fill(n), items)]), question, primer

    meta = {"key": keys[0], "distractor_keys": keys[n_queries:],
            "positions": [p for p, _ in items]}
    if n_queries > 1:
        return build, [vs[0] for vs in values[:n_queries]], {**meta, "keys": keys[:n_queries]}
    return build, list(values[0]), meta


def _vt(rng, depth: float, hops: int = 4, fill=None):
    fill = fill or _noise
    used: set = set()
    names = ["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
             for _ in range(hops + 1)]
    while len(set(names)) < len(names):  # redraw on a collision (deterministic)
        names = ["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
                 for _ in range(hops + 1)]
    value = _value(rng, "number", used)[:5]
    lines = [f"VAR {names[0]} = {value}."] + [
        f"VAR {names[i + 1]} = VAR {names[i]}." for i in range(hops)
    ]
    # Hops follow the definition in order, at seeded positions between depth and the end.
    pos = [depth] + sorted(_spread(rng, hops, depth, 1.0))
    items = list(zip(pos, lines))
    head = ("Memorize and track the chain(s) of variable assignment hidden in the following "
            "text.")
    question = (f"Find all variables that are assigned the value {value} in the text above.")
    primer = (f"Answer: According to the chain(s) of variable assignment in the text above, "
              f"{hops + 1} variables are assigned the value {value}, they are:")

    def build(n: int):
        return " ".join([head, *_insert(fill(n), items)]), question, primer

    return build, list(names), {"value": value, "chain": names}


# (fact, question, primer): the primer ends where the fact puts the answer.
_QA_TEMPLATES = (
    ("The capital of the kingdom of {place} is {answer}.",
     "What is the capital of the kingdom of {place}?",
     "The capital of the kingdom of {place} is"),
    ("The river of the valley of {place} is the {answer}.",
     "What is the river of the valley of {place}?",
     "The river of the valley of {place} is the"),
    ("The founder of the guild of {place} was {answer}.",
     "Who was the founder of the guild of {place}?",
     "The founder of the guild of {place} was"),
)
_QA_FILL = (
    "Its markets sell wool, salt and dried fish.",
    "Travellers reach it by a long road through the hills.",
    "The winters there are cold and the summers short.",
    "Its people are known for their songs and their bread.",
)


def _qa(rng, depth: float):
    t = rng.randrange(len(_QA_TEMPLATES))
    fact, q, primer = _QA_TEMPLATES[t]
    used: set = set()
    place = _name(rng, used)
    answer = _name(rng, used)
    gold = fact.format(place=place, answer=answer)
    question = q.format(place=place)
    primer = primer.format(place=place)
    head = ("Below are some documents. Answer the question based on the documents.")
    # A distractor document: the same fact template about another place (different answer),
    # or another template about the same place's neighbours.
    pool_rng = random.Random(f"qa-pool:{rng.random()}")
    distractors: list[str] = []

    def doc(i: int, text: str) -> str:
        return f"Document {i}: {text}"

    def distractor(j: int) -> str:
        while len(distractors) <= j:
            tt = pool_rng.randrange(len(_QA_TEMPLATES))
            p, a = _name(pool_rng, used, 4), _name(pool_rng, used, 4)
            distractors.append(_QA_TEMPLATES[tt][0].format(place=p, answer=a) + " "
                               + pool_rng.choice(_QA_FILL))
        return distractors[j]

    def build(n: int):
        gold_at = round(depth * n)
        docs, j = [], 0
        for i in range(n + 1):
            if i == gold_at:
                docs.append(gold + " " + _QA_FILL[t % len(_QA_FILL)])
            else:
                docs.append(distractor(j))
                j += 1
        text = "\n".join(doc(i + 1, d) for i, d in enumerate(docs))
        return f"{head}\n\n{text}", question, primer

    return build, [answer], {"place": place, "template": t, "unit_tokens": 10}


def _passkey(rng, depth: float, fill=None):
    fill = fill or _noise
    key = str(rng.randint(10000, 99999))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    # The classic "There is an important info hidden..." preamble made SmolLM2 answer "the pass
    # key." at depth 0.1-0.5; naming the pass key up front works better.
    head = ("There is an important pass key hidden inside a lot of irrelevant text. "
            "Find it and memorize it. I will quiz you about the pass key.")

    def build(n: int):
        context = " ".join([head, *_insert(fill(n), [(depth, needle)])])
        return context, "What is the pass key?", "The pass key is"

    return build, [key], {"needle": needle}


def _kv_line(style: str, key: str, value: str) -> str:
    return f"The value of key {key} is {value}." if style == "sentence" else f"{key}: {value}"


def _kv(rng, depth: float, n_pairs: int, style: str, fill=None):
    fill = fill or _noise
    if style not in KV_STYLES:
        raise ValueError(f"unknown kv_style {style!r}; expected one of {KV_STYLES}")
    if n_pairs < 1:
        raise ValueError("kv_pairs must be >= 1")
    keys: set = set()
    pairs = []
    while len(pairs) < n_pairs:
        k = _uuid_like(rng)
        if k not in keys:
            keys.add(k)
            pairs.append((k, str(rng.randint(10000, 99999))))
    asked = rng.randrange(n_pairs)
    key, answer = pairs[asked]
    question = f"What is the value of key {key}?"
    # The primer repeats the line format, so that the answer is a plain copy of the token after
    # the matching line (what a small model's induction heads do).
    primer = f"The value of key {key} is" if style == "sentence" else f"{key}:"
    head = ("There is a list of keys and their values hidden inside a lot of irrelevant text. "
            "Find it and memorize it. I will quiz you about one of the keys.")
    block = "\n".join(_kv_line(style, k, v) for k, v in pairs)

    def build(n: int):
        units = fill(n)
        pos = round(depth * n)
        context = f"{head} {' '.join(units[:pos])}\n{block}\n{' '.join(units[pos:])}"
        return context, question, primer

    meta = {"variant": f"{style}{n_pairs}", "key": key, "index": asked,
            "wrong_answers": [v for i, (_, v) in enumerate(pairs) if i != asked]}
    return build, [answer], meta


# ---------------------------------------------------------------------------------------------
# prompt text and sizing


def _format(tokenizer, fmt: str, context: str, question: str, primer: str) -> str:
    if fmt == "plain":
        return f"{context}\n\n{question}\n{primer}"
    msgs = [{"role": "user", "content": f"{context}\n\n{question}"}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return text + primer if fmt == "chat" else text


def _fit(build: Callable[[int], list[int]], target: int, hi: int) -> int:
    """Largest n in [0, hi] with len(build(n)) <= target (build is monotone in n)."""
    lo = 0
    if len(build(lo)) > target:
        raise ValueError(f"target {target} tokens is smaller than the empty prompt")
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(build(mid)) <= target:
            lo = mid
        else:
            hi = mid - 1
    return lo


# ---------------------------------------------------------------------------------------------


def encode(tokenizer, text: str) -> list[int]:
    """The tokenizer's own encoding, special tokens included (Gemma's <bos>)."""
    return list(tokenizer(text)["input_ids"])


def make_case(tokenizer, task: str, target_tokens: int, depth: float = 0.5, seed: int = 0,
              fmt: str = "plain", *, kv_pairs: int = 4, kv_style: str = "sentence",
              haystack: str = "noise") -> EvalCase:
    """One case of ``task`` whose prompt is as long as possible within ``target_tokens``.

    ``kv_pairs`` and ``kv_style`` shape the ``kv`` task only (see the module docstring);
    ``haystack`` (``haystacks.HAYSTACKS``) the filler of the ``HAYSTACK_TASKS``.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError("depth must be in [0, 1]")
    if fmt not in FORMATS:
        raise ValueError(f"unknown fmt {fmt!r}; expected one of {FORMATS}")
    if haystack not in _haystacks.HAYSTACKS:
        raise ValueError(f"unknown haystack {haystack!r}; expected one of "
                         f"{_haystacks.HAYSTACKS}")
    if haystack != "noise" and task not in HAYSTACK_TASKS:
        raise ValueError(f"task {task!r} has no haystack; haystack applies to {HAYSTACK_TASKS}")
    rng = random.Random(f"{task}:{seed}")

    def fill(n: int) -> list[str]:
        return _haystacks.units(haystack, n, seed)

    metric = "string_match_all"
    if task in ("niah_number", "niah_uuid", "niah_word"):
        build, answers, meta = _niah(rng, task.split("_")[1], depth, 1, 1, fill)
    elif task == "niah_multikey":
        build, answers, meta = _niah(rng, "number", depth, 4, 1, fill)
    elif task == "niah_multivalue":
        build, answers, meta = _niah(rng, "number", depth, 1, 4, fill)
    elif task == "niah_multiquery":
        build, answers, meta = _niah(rng, "number", depth, 4, 1, fill, n_queries=4)
    elif task == "vt":
        build, answers, meta = _vt(rng, depth, fill=fill)
    elif task == "qa":
        build, answers, meta = _qa(rng, depth)
        metric = "string_match_part"
    elif task == "passkey":
        build, answers, meta = _passkey(rng, depth, fill)
    elif task == "kv":
        build, answers, meta = _kv(rng, depth, kv_pairs, kv_style, fill)
    elif task in ("cwe", "fwe"):
        from uniprefill_sglang.tools import aggregation_tasks

        build, answers, meta = aggregation_tasks.build(task, rng, target_tokens)
    else:
        raise ValueError(f"unknown task {task!r}; expected one of "
                         f"{RULER_TASKS + RETRIEVAL_TASKS}")

    def text(n: int) -> str:
        return _format(tokenizer, fmt, *build(n))

    # Upper bound on haystack units: a noise sentence is >= 3 tokens, a document >= 10.
    unit_tokens = meta.pop("unit_tokens", _haystacks.min_unit_tokens(haystack))
    hi = max(1, target_tokens // unit_tokens)
    n = _fit(lambda n: encode(tokenizer, text(n)), target_tokens, hi=hi)
    prompt = text(n)
    _, question, _ = build(n)
    return EvalCase(task=task, target_tokens=target_tokens, depth=depth, seed=seed, fmt=fmt,
                    prompt=prompt, input_ids=encode(tokenizer, prompt), answers=answers,
                    question=question, max_new_tokens=MAX_NEW_TOKENS[task],
                    wrong_answers=meta.pop("wrong_answers", []), meta={**meta, "n_units": n},
                    haystack=haystack, metric=metric)


def make_cases(tokenizer, tasks: Iterable[str] = TASKS,
               lengths: Iterable[int] = (1024, 2048, 4096, 8192),
               depths: Iterable[float] = (0.1, 0.5, 0.9), seeds: Iterable[int] = (0,),
               fmt: str = "plain", haystacks: Iterable[str] = ("noise",)) -> list[EvalCase]:
    """The task x haystack x length x depth x seed grid, in that nesting order; a task without
    a haystack (``qa``, ``cwe``, ``fwe``) is generated once, not once per haystack.
    ``depths`` place the needle; the aggregation tasks (``cwe``, ``fwe``) have no needle and
    are generated at the first depth only."""
    lengths, depths, seeds, haystacks = list(lengths), list(depths), list(seeds), list(haystacks)
    out = []
    for t in tasks:
        hays = haystacks if t in HAYSTACK_TASKS else ["noise"]
        ds = depths if t not in ("cwe", "fwe") else depths[:1]
        out += [make_case(tokenizer, t, L, d, s, fmt, haystack=h)
                for h in hays for L in lengths for d in ds for s in seeds]
    return out


def fingerprint(cases: Sequence[EvalCase]) -> str:
    """A short hash of every case's ids and answers (determinism checks, result files)."""
    import hashlib

    h = hashlib.sha256()
    for c in cases:
        h.update(c.name.encode())
        h.update(",".join(map(str, c.input_ids)).encode())
        h.update("|".join(c.answers).encode())
    return h.hexdigest()[:16]
