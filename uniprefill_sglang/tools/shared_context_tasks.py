"""SCBench-style shared-context cases over the RULER-style families: one context, several queries.

SCBench (Li et al., 2025) measures a long context that is prefilled once and then queried again
and again, as a prefix cache serves it. Its two shared-context modes, followed here:

* ``multi_request``: every query is its own request, ``context + query``: the follow-ups share
  the context (and only the context) with the first request.
* ``multi_turn``: one conversation; request k is ``context + turn 1 + answer 1 + ... + turn k``,
  the earlier turns carrying the *right* answers (so that every configuration sees the same
  prompts), and each request shares everything before its last question with the previous one.

Tasks (``SHARED_TASKS``; the retrieval kind SCBench scores by whether the answer appears):

* ``kv``: a JSON object of UUID-like keys and values, nothing else (SCBench's key-value
  retrieval); each query asks the value of one key, the keys spread over the object.
* ``niah``: one needle per query ("The special magic number for <key> is: <value>.") at
  seeded positions in a haystack (``haystacks.py``: noise, prose or essay); each query asks one
  key (the other needles are its distractors).

Formats: ``plain`` (context, blank line, question, answer primer) and ``chat`` (the chat
template; the primer opens the assistant turn). Token ids: the prompt text up to the end of the
context is encoded with the tokenizer's special tokens, the rest as a continuation without any,
so the context's ids are the same prefix of every request (a radix cache matches all of it).

Scoring: ``SharedQuery.score`` is SCBench's retrieval rule (``scoring.scbench_match``: the
answer is a substring of the output, case-insensitive); ``check`` is the project's stricter one
(whole word, and no other query's answer named). Randomness comes only from
``random.Random(f"shared:{task}:{seed}")`` and the haystack's own seeded order.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Iterable, List

from uniprefill_sglang.tools import haystacks as _haystacks
from uniprefill_sglang.tools import scoring as _scoring
from uniprefill_sglang.tools.tasks import (_NIAH_HEAD, _NIAH_LINE, _contains, _fit, _insert,
                                          _key, _spread, _value, encode)

SHARED_TASKS = ("kv", "niah")
SHARED_MODES = ("multi_request", "multi_turn")
SHARED_FORMATS = ("plain", "chat")
MAX_NEW_TOKENS = {"kv": 32, "niah": 12}

_KV_HEAD = ("Extract the value corresponding to the specified key in the JSON object below. "
            "The keys and the values are UUIDs.")


@dataclass
class SharedQuery:
    question: str
    primer: str
    answer: str
    wrong: List[str]  # the other queries' answers: the strict check rejects naming one
    input_ids: List[int] = field(default_factory=list)  # the whole prompt of this request

    def score(self, output: str) -> float:
        """SCBench's retrieval score: 1.0 if the answer appears in the output."""
        return _scoring.scbench_match(output, self.answer)

    def check(self, output: str) -> bool:
        return _contains(output, self.answer) and not any(_contains(output, w) for w in self.wrong)


@dataclass
class SharedCase:
    task: str
    mode: str
    fmt: str
    haystack: str
    target_tokens: int
    seed: int
    context: str
    context_ids: List[int]  # the shared prefix: every query's input_ids start with these
    queries: List[SharedQuery]
    max_new_tokens: int

    @property
    def name(self) -> str:
        hay = "" if self.haystack == "noise" or self.task == "kv" else f"-{self.haystack}"
        return f"shared_{self.task}-{self.mode}{hay}-{self.fmt}-{self.target_tokens}-s{self.seed}"

    @property
    def n_tokens(self) -> int:
        """The longest request's prompt (the last one in ``multi_turn``)."""
        return max(len(q.input_ids) for q in self.queries)


def _uuid(rng: random.Random) -> str:
    h = "0123456789abcdef"
    return "-".join("".join(rng.choice(h) for _ in range(n)) for n in (8, 4, 4, 4, 12))


def _kv_builder(rng: random.Random, n_queries: int):
    """build(n) -> (context, [(question, primer, answer)]) over n key-value pairs."""
    pair_rng = random.Random(f"kv-pairs:{rng.random()}")
    pairs: list[tuple[str, str]] = []
    seen: set = set()
    fractions = _spread(rng, n_queries, 0.0, 1.0)

    def build(n: int):
        n = max(n, n_queries)
        while len(pairs) < n:
            k, v = _uuid(pair_rng), _uuid(pair_rng)
            if k not in seen and v not in seen:
                seen.update((k, v))
                pairs.append((k, v))
        body = ", ".join(f'"{k}": "{v}"' for k, v in pairs[:n])
        context = f"{_KV_HEAD}\n\nJSON data:\n{{{body}}}"
        asked: list[int] = []
        for f in fractions:  # distinct pairs, near each fraction of the object
            i = min(n - 1, round(f * (n - 1)))
            while i in asked:
                i = (i + 1) % n
            asked.append(i)
        qs = [(f'What is the value of key "{pairs[i][0]}" in the JSON object above?',
               f'The value of key "{pairs[i][0]}" is:', pairs[i][1]) for i in asked]
        return context, qs

    return build, 40  # a pair is > 40 tokens


def _niah_builder(rng: random.Random, n_queries: int, haystack: str, seed: int):
    used_k: set = set()
    used_v: set = set()
    keys = [_key(rng, used_k) for _ in range(n_queries)]
    values = [_value(rng, "number", used_v) for _ in range(n_queries)]
    positions = sorted(_spread(rng, n_queries, 0.05, 0.95))
    items = [(p, _NIAH_LINE.format(kind="number", key=k, value=v))
             for p, k, v in zip(positions, keys, values)]
    head = _NIAH_HEAD.format(kind="number")
    qs = [(f"What is the special magic number for {k} mentioned in the text?",
           f"The special magic number for {k} mentioned in the text is:", v)
          for k, v in zip(keys, values)]

    def build(n: int):
        return " ".join([head, *_insert(_haystacks.units(haystack, n, seed), items)]), qs

    return build, _haystacks.min_unit_tokens(haystack)


def _prompt_texts(tokenizer, fmt: str, mode: str, context: str, qs) -> tuple[str, List[str]]:
    """(the text up to the end of the context, every request's whole prompt text)."""
    prompts = []
    if fmt == "plain":
        for k, (question, primer, _) in enumerate(qs):
            if mode == "multi_turn":
                past = "".join(f"\n\n{q}\n{p} {a}" for q, p, a in qs[:k])
                prompts.append(f"{context}{past}\n\n{question}\n{primer}")
            else:
                prompts.append(f"{context}\n\n{question}\n{primer}")
    else:
        for k, (question, primer, _) in enumerate(qs):
            if mode == "multi_turn":
                msgs = [{"role": "user", "content": f"{context}\n\n{qs[0][0]}"}]
                for j in range(k):
                    msgs.append({"role": "assistant", "content": f"{qs[j][1]} {qs[j][2]}"})
                    msgs.append({"role": "user", "content": qs[j + 1][0]})
            else:
                msgs = [{"role": "user", "content": f"{context}\n\n{question}"}]
            text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            prompts.append(text + primer)
    at = prompts[0].index(context) + len(context)
    prefix = prompts[0][:at]
    assert all(p.startswith(prefix) for p in prompts)
    return prefix, prompts


def _continuation(tokenizer, text: str) -> List[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def make_shared_case(tokenizer, task: str, target_tokens: int, seed: int = 0, *,
                     n_queries: int = 3, mode: str = "multi_request", fmt: str = "plain",
                     haystack: str = "noise") -> SharedCase:
    """One context and ``n_queries`` queries; the longest request fits ``target_tokens``."""
    if task not in SHARED_TASKS:
        raise ValueError(f"unknown shared task {task!r}; expected one of {SHARED_TASKS}")
    if mode not in SHARED_MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {SHARED_MODES}")
    if fmt not in SHARED_FORMATS:
        raise ValueError(f"unknown fmt {fmt!r}; expected one of {SHARED_FORMATS}")
    if haystack not in _haystacks.HAYSTACKS:
        raise ValueError(f"unknown haystack {haystack!r}")
    if n_queries < 1:
        raise ValueError("n_queries must be >= 1")
    rng = random.Random(f"shared:{task}:{seed}")
    if task == "kv":
        build, unit_tokens = _kv_builder(rng, n_queries)
    else:
        build, unit_tokens = _niah_builder(rng, n_queries, haystack, seed)

    def requests(n: int):
        context, qs = build(n)
        prefix, prompts = _prompt_texts(tokenizer, fmt, mode, context, qs)
        prefix_ids = encode(tokenizer, prefix)
        return context, qs, prefix_ids, [prefix_ids + _continuation(tokenizer, p[len(prefix):])
                                         for p in prompts]

    n = _fit(lambda n: max(requests(n)[3], key=len), target_tokens,
             hi=max(1, target_tokens // unit_tokens))
    context, qs, prefix_ids, ids = requests(n)
    answers = [a for _, _, a in qs]
    queries = [SharedQuery(question=q, primer=p, answer=a,
                           wrong=[b for j, b in enumerate(answers) if j != i], input_ids=ids[i])
               for i, (q, p, a) in enumerate(qs)]
    return SharedCase(task=task, mode=mode, fmt=fmt, haystack="noise" if task == "kv" else haystack,
                      target_tokens=target_tokens, seed=seed, context=context,
                      context_ids=prefix_ids, queries=queries, max_new_tokens=MAX_NEW_TOKENS[task])


def make_shared_cases(tokenizer, tasks: Iterable[str] = SHARED_TASKS,
                      modes: Iterable[str] = SHARED_MODES, lengths: Iterable[int] = (2048,),
                      seeds: Iterable[int] = (0,), n_queries: int = 3, fmt: str = "plain",
                      haystacks: Iterable[str] = ("noise",)) -> List[SharedCase]:
    """The task x haystack x mode x length x seed grid (``kv`` has no haystack: once)."""
    modes, lengths, seeds, haystacks = list(modes), list(lengths), list(seeds), list(haystacks)
    out = []
    for t in tasks:
        for h in (haystacks if t == "niah" else ["noise"]):
            out += [make_shared_case(tokenizer, t, L, s, n_queries=n_queries, mode=m, fmt=fmt,
                                     haystack=h)
                    for m in modes for L in lengths for s in seeds]
    return out
