"""Shared-context cases, generated locally: one document, several questions about it.

What a prefix cache meets in serving (SCBench's shared-context mode, Li et al., ICLR 2025): a
long document is sent once and then asked about again and again, each request hitting the cached
document. A case here is a document holding several facts of one kind, spread over its length,
and one question per fact; the questions go one after another, so that every follow-up reuses
the cached document. Kinds:

* ``locker``: needles, "The code of locker <name> is <5 digits>."
* ``kv``: key-value lines with UUID-like keys (tasks.py's ``kv`` task, several asked).
* ``vt``: variable chains, "VAR A = 12345." then hops "VAR B = VAR A."; each question asks
  for a chain's last variable's value.

Prompts are plain text: the document, a blank line, the question and an answer primer. Token ids
are the document's ids followed by the question's, so that the document is a prefix of every
request to the token (a radix cache then matches all of it). `chat_turns` builds a multi-turn
chat over the same document for the chat-template path.

Randomness comes only from ``random.Random(f"shared:{kind}:{seed}")``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import List, Sequence

from uniprefill_sglang.tools.tasks import (_contains, _fit, _insert, _noise, _spread, _uuid_like,
                                          encode)

KINDS = ("locker", "kv", "vt")
_NAMES = ("amber", "birch", "cobalt", "dune", "ember", "fjord", "garnet", "hazel", "indigo",
          "juniper", "kestrel", "lagoon", "maple", "nectar", "onyx", "prism")


@dataclass
class Question:
    text: str          # question and answer primer, as appended to the document
    answer: str
    wrong: List[str]   # the other facts' answers: naming one is wrong
    input_ids: List[int] = field(default_factory=list)  # the question's ids (after the document's)

    def correct(self, output: str) -> bool:
        return _contains(output, self.answer) and not any(_contains(output, w) for w in self.wrong)


@dataclass
class SharedContextCase:
    kind: str
    seed: int
    document: str
    document_ids: List[int]
    questions: List[Question]

    @property
    def name(self) -> str:
        return f"{self.kind}-{len(self.document_ids)}-s{self.seed}"

    def prompt_ids(self, q: int) -> List[int]:
        return self.document_ids + self.questions[q].input_ids


def _facts(kind: str, rng: random.Random, n: int):
    """(fact lines, [(question text, answer)])."""
    if kind == "locker":
        names = rng.sample(_NAMES, n)
        codes = rng.sample(range(10000, 100000), n)
        lines = [f"The code of locker {a} is {c}." for a, c in zip(names, codes)]
        asks = [(f"What is the code of locker {a}?\nThe code of locker {a} is", str(c))
                for a, c in zip(names, codes)]
    elif kind == "kv":
        keys = [_uuid_like(rng) for _ in range(n)]
        values = rng.sample(range(10000, 100000), n)
        lines = [f"The value of key {k} is {v}." for k, v in zip(keys, values)]
        asks = [(f"What is the value of key {k}?\nThe value of key {k} is", str(v))
                for k, v in zip(keys, values)]
    elif kind == "vt":
        letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
        lines, asks, used = [], [], set()
        for value in rng.sample(range(10000, 100000), n):
            chain = []
            while len(chain) < 3:
                v = "".join(rng.choice(letters) for _ in range(4))
                if v not in used:
                    used.add(v)
                    chain.append(v)
            lines.append(f"VAR {chain[0]} = {value}. VAR {chain[1]} = VAR {chain[0]}. "
                         f"VAR {chain[2]} = VAR {chain[1]}.")
            asks.append((f"What is the value of VAR {chain[2]}?\nVAR {chain[2]} =", str(value)))
    else:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
    return lines, asks


def make_case(tokenizer, kind: str, target_tokens: int, num_facts: int = 4,
              seed: int = 0) -> SharedContextCase:
    """A document of at most `target_tokens` tokens (question included) with `num_facts` facts
    spread over it, and one question per fact (in a seeded order)."""
    rng = random.Random(f"shared:{kind}:{seed}")
    lines, asks = _facts(kind, rng, num_facts)
    positions = sorted(_spread(rng, num_facts, 0.05, 0.95))
    head = ("Below is a long text with some facts hidden in it. Memorize them: I will ask you "
            "about them afterwards.")

    def document(n: int) -> str:
        return " ".join([head, *_insert(_noise(n), list(zip(positions, lines)))])

    longest_question = max(len(encode(tokenizer, "\n\n" + t)) for t, _ in asks)
    n = _fit(lambda n: encode(tokenizer, document(n)), target_tokens - longest_question,
             hi=max(1, target_tokens // 3))
    doc = document(n)
    order = list(range(num_facts))
    rng.shuffle(order)
    answers = [a for _, a in asks]
    questions = [Question(text=asks[i][0], answer=asks[i][1],
                          wrong=[a for j, a in enumerate(answers) if j != i],
                          input_ids=_continuation_ids(tokenizer, "\n\n" + asks[i][0]))
                 for i in order]
    return SharedContextCase(kind, seed, doc, encode(tokenizer, doc), questions)


def _continuation_ids(tokenizer, text: str) -> List[int]:
    """Ids of `text` as it continues a document: no special tokens of its own (a tokenizer that
    adds a leading <bos> would put one mid-prompt)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def make_cases(tokenizer, kinds: Sequence[str] = KINDS, lengths: Sequence[int] = (2048,),
               seeds: Sequence[int] = (0,), num_facts: int = 4) -> List[SharedContextCase]:
    return [make_case(tokenizer, k, L, num_facts, s) for k in kinds for L in lengths
            for s in seeds]


def chat_turns(case: SharedContextCase) -> List[str]:
    """User turns of a multi-turn chat over the case's document: the first carries the
    document and the first question, each later one asks another fact (no primer: a chat
    answers in its own words)."""
    asks = [q.text.split("\n")[0] for q in case.questions]
    return [f"{case.document}\n\n{asks[0]}"] + asks[1:]
