"""Deterministic long-context retrieval cases (no downloads), sized in tokens of a given tokenizer.

Two kinds:

* ``passkey``: a 5-digit pass key hidden at ``depth`` (0 = start, 1 = end) inside repetitive
  filler text; the question comes at the end.
* ``kv``: key-value lines (UUID-like keys ``xxxxxxxx-xxxx-xxxx``, 5-digit values), by default a
  block of ``kv_pairs=4`` lines hidden at ``depth`` inside filler, one of them asked for;
  ``kv_pairs=None`` makes the whole context key-value lines (the classic KV-retrieval task,
  asked line at ``depth``). ``kv_style="sentence"`` (default) writes each line as
  ``The value of key <k> is <v>.``, ``kv_style="colon"`` as ``<k>: <v>``.
  SmolLM2-135M-Instruct (dense, fp32, 1K tokens): 4 sentence lines 4/6, 4 colon lines 3/6,
  16 lines 1/6; a context full of lines 0/6 (both styles; also with word keys), so the classic
  variant is too hard for this model.

Every case carries ``prompt`` (text), ``input_ids`` (its exact tokenisation, no BOS added:
SmolLM2's tokenizer adds none), ``answer`` and ``check``. ``fmt="plain"`` (default) is the raw
text: context, question, then an answer primer (``The pass key is`` / ``The value of key <k> is``
/ ``<k>:``) that the model completes; ``fmt="chat"`` wraps context and question in the chat
template and puts the primer at the start of the assistant turn; ``"chat_noprimer"`` omits it.
SmolLM2-135M-Instruct does best with ``plain`` (pass key at 1K: 6/6 plain, 4/6 chat).

Usage::

    tok = AutoTokenizer.from_pretrained(model_dir)
    cases = make_cases(tok, kinds=("passkey", "kv"), lengths=(1024, 2048), depths=(0.1, 0.5, 0.9))
    out = engine.generate(input_ids=case.input_ids, sampling_params={"temperature": 0, ...})
    case.check(out["text"])
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

FILLER_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)

KINDS = ("passkey", "kv")
FORMATS = ("chat", "chat_noprimer", "plain")


@dataclass
class RetrievalCase:
    kind: str
    target_tokens: int
    depth: float
    seed: int
    fmt: str
    prompt: str
    input_ids: list[int]
    answer: str
    question: str
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def name(self) -> str:
        style = ""
        if self.kind == "kv":
            n = "all" if self.meta.get("all") else self.meta["n_pairs"]
            style = f"-{self.meta['kv_style']}{n}"
        return f"{self.kind}{style}-{self.target_tokens}-d{self.depth:g}-s{self.seed}"

    def check(self, output_text: str) -> bool:
        """True when the first 5-digit number in the output is the answer."""
        m = re.search(r"(?<!\d)\d{5}(?!\d)", output_text)
        return m is not None and m.group(0) == self.answer


# ---------------------------------------------------------------------------------------------
# formatting


def _format(tokenizer, fmt: str, context: str, question: str, primer: str) -> str:
    if fmt == "plain":
        return f"{context}\n\n{question}\n{primer}"
    if fmt not in ("chat", "chat_noprimer"):
        raise ValueError(f"unknown fmt {fmt!r}; expected one of {FORMATS}")
    msgs = [{"role": "user", "content": f"{context}\n\n{question}"}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return text + primer if fmt == "chat" else text


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# ---------------------------------------------------------------------------------------------
# pass key


def _passkey_parts(rng: random.Random):
    key = str(rng.randint(10000, 99999))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    # (Tried the classic "There is an important info hidden..." preamble: with it SmolLM2
    # answered "the pass key." at depth 0.1-0.5; naming the pass key up front works better.)
    head = (
        "There is an important pass key hidden inside a lot of irrelevant text. "
        "Find it and memorize it. I will quiz you about the pass key."
    )
    question = "What is the pass key?"
    primer = "The pass key is"
    return key, needle, head, question, primer


def _passkey_context(head: str, needle: str, n_filler: int, depth: float) -> str:
    fill = [FILLER_SENTENCES[i % len(FILLER_SENTENCES)] for i in range(n_filler)]
    pos = round(depth * n_filler)
    body = fill[:pos] + [needle] + fill[pos:]
    return head + " " + " ".join(body)


# ---------------------------------------------------------------------------------------------
# key-value


def _uuid_like(rng: random.Random) -> str:
    h = "0123456789abcdef"
    return "-".join("".join(rng.choice(h) for _ in range(n)) for n in (8, 4, 4))


def _kv_lines(rng: random.Random, n: int) -> list[tuple[str, str]]:
    keys: set[str] = set()
    out = []
    while len(out) < n:
        k = _uuid_like(rng)
        if k in keys:
            continue
        keys.add(k)
        out.append((k, str(rng.randint(10000, 99999))))
    return out


KV_STYLES = ("sentence", "colon")


def _kv_line(style: str, k: str, v: str) -> str:
    return f"The value of key {k} is {v}." if style == "sentence" else f"{k}: {v}"


def _kv_primer(style: str, k: str) -> str:
    # The primer repeats the line format, so that the answer is a plain copy of the token after
    # the matching line (what a small model's induction heads do).
    return f"The value of key {k} is" if style == "sentence" else f"{k}:"


def _kv_context(style: str, pairs: Sequence[tuple[str, str]]) -> str:
    head = "Below is a list of keys and their values.\n"
    return head + "\n".join(_kv_line(style, k, v) for k, v in pairs)


# ---------------------------------------------------------------------------------------------
# sizing


def _fit(build: Callable[[int], list[int]], target: int, lo: int = 0, hi: int | None = None) -> int:
    """Largest n in [lo, hi] with len(build(n)) <= target (build is monotone in n)."""
    if hi is None:
        hi = max(1, target)  # one filler unit is at least one token
    if len(build(lo)) > target:
        raise ValueError(f"target {target} tokens is smaller than the empty prompt")
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(build(mid)) <= target:
            lo = mid
        else:
            hi = mid - 1
    return lo


def make_case(
    tokenizer,
    kind: str,
    target_tokens: int,
    depth: float = 0.5,
    seed: int = 0,
    fmt: str = "plain",
    kv_style: str = "sentence",
    kv_pairs: int | None = 4,
) -> RetrievalCase:
    """One case whose prompt is as long as possible without exceeding ``target_tokens``.

    ``kv_pairs`` (kind ``kv``): number of key-value lines, hidden as one block at ``depth`` in
    filler text; ``None`` fills the whole context with lines and asks for the one at ``depth``.
    Deterministic in all arguments and the tokenizer.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError("depth must be in [0, 1]")
    if kv_style not in KV_STYLES:
        raise ValueError(f"unknown kv_style {kv_style!r}; expected one of {KV_STYLES}")
    rng = random.Random(f"{kind}:{seed}")
    if kind == "passkey":
        key, needle, head, question, primer = _passkey_parts(rng)

        def text(n: int) -> str:
            return _format(tokenizer, fmt, _passkey_context(head, needle, n, depth), question, primer)

        n = _fit(lambda n: _encode(tokenizer, text(n)), target_tokens)
        prompt, answer, meta = text(n), key, {"n_filler": n, "needle": needle}
    elif kind == "kv" and kv_pairs is None:
        # The whole context is key-value lines; depth picks the asked line.
        # Draw a generous pool of pairs once; prompts use a prefix of it.
        pool = _kv_lines(rng, max(8, target_tokens // 8))

        def pick(n: int) -> int:
            return min(n - 1, round(depth * (n - 1)))

        def text(n: int) -> str:
            i = pick(n)
            q = f"What is the value of key {pool[i][0]}?"
            pr = _kv_primer(kv_style, pool[i][0])
            return _format(tokenizer, fmt, _kv_context(kv_style, pool[:n]), q, pr)

        n = _fit(lambda n: _encode(tokenizer, text(n)), target_tokens, lo=1, hi=len(pool))
        i = pick(n)
        prompt, answer = text(n), pool[i][1]
        question = f"What is the value of key {pool[i][0]}?"
        meta = {"n_pairs": n, "index": i, "key": pool[i][0], "kv_style": kv_style, "all": True}
    elif kind == "kv":
        # A block of kv_pairs lines hidden at depth inside filler; the seed picks the asked key.
        if kv_pairs < 1:
            raise ValueError("kv_pairs must be >= 1 (or None)")
        pairs = _kv_lines(rng, kv_pairs)
        i = rng.randrange(kv_pairs)
        key, answer = pairs[i]
        question = f"What is the value of key {key}?"
        primer = _kv_primer(kv_style, key)
        head = (
            "There is a list of keys and their values hidden inside a lot of irrelevant text. "
            "Find it and memorize it. I will quiz you about one of the keys."
        )
        block = "\n".join(_kv_line(kv_style, k, v) for k, v in pairs)

        def text(n: int) -> str:
            fill = [FILLER_SENTENCES[j % len(FILLER_SENTENCES)] for j in range(n)]
            pos = round(depth * n)
            ctx = f"{head} {' '.join(fill[:pos])}\n{block}\n{' '.join(fill[pos:])}"
            return _format(tokenizer, fmt, ctx, question, primer)

        n = _fit(lambda n: _encode(tokenizer, text(n)), target_tokens)
        prompt = text(n)
        meta = {"n_pairs": kv_pairs, "index": i, "key": key, "kv_style": kv_style, "n_filler": n}
    else:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
    ids = _encode(tokenizer, prompt)
    return RetrievalCase(
        kind=kind,
        target_tokens=target_tokens,
        depth=depth,
        seed=seed,
        fmt=fmt,
        prompt=prompt,
        input_ids=ids,
        answer=answer,
        question=question,
        meta=meta,
    )


def make_cases(
    tokenizer,
    kinds: Iterable[str] = KINDS,
    lengths: Iterable[int] = (1024, 2048, 4096, 6144),
    depths: Iterable[float] = (0.1, 0.5, 0.9),
    seeds: Iterable[int] = (0,),
    fmt: str = "plain",
    kv_style: str = "sentence",
    kv_pairs: int | None = 4,
) -> list[RetrievalCase]:
    return [
        make_case(tokenizer, k, L, d, s, fmt, kv_style, kv_pairs)
        for k in kinds
        for L in lengths
        for d in depths
        for s in seeds
    ]


# ---------------------------------------------------------------------------------------------
# dense accuracy measurement on the CPU engine


def evaluate(
    engine,
    cases: Sequence[RetrievalCase],
    max_new_tokens: int = 12,
    log: Callable[[str], None] | None = print,
) -> list[dict[str, Any]]:
    """Greedy-decode every case one request at a time; return one record per case."""
    import time

    rows = []
    for c in cases:
        t0 = time.perf_counter()
        out = engine.generate(
            input_ids=c.input_ids,
            sampling_params={"temperature": 0.0, "max_new_tokens": max_new_tokens},
        )
        dt = time.perf_counter() - t0
        row = {
            "name": c.name,
            "kind": c.kind,
            "fmt": c.fmt,
            "target_tokens": c.target_tokens,
            "n_tokens": c.n_tokens,
            "depth": c.depth,
            "seed": c.seed,
            "answer": c.answer,
            "output": out["text"],
            "correct": c.check(out["text"]),
            "seconds": dt,
            "cached_tokens": out["meta_info"].get("cached_tokens"),
        }
        rows.append(row)
        if log:
            log(
                f"{c.name:28s} {c.fmt:13s} n={c.n_tokens:5d} {dt:6.1f}s "
                f"{'OK ' if row['correct'] else 'BAD'} want={c.answer} got={out['text']!r}"
            )
    return rows


def summarize(rows: Sequence[dict[str, Any]]) -> str:
    from collections import defaultdict

    groups: dict[tuple, list] = defaultdict(list)
    for r in rows:
        groups[(r["fmt"], r["kind"], r["target_tokens"])].append(r)
    lines = [f"{'fmt':13s} {'kind':8s} {'tokens':>6s} {'correct':>9s} {'mean s':>7s}"]
    for (fmt, kind, L), rs in sorted(groups.items()):
        ok = sum(r["correct"] for r in rs)
        mean = sum(r["seconds"] for r in rs) / len(rs)
        lines.append(f"{fmt:13s} {kind:8s} {L:6d} {ok:4d}/{len(rs):<4d} {mean:7.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """``python -m uniprefill_sglang.retrieval [--lengths 1024 2048 ...] [--fmt chat ...]``:
    dense accuracy of SmolLM2-135M-Instruct on the CPU engine."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m uniprefill_sglang.retrieval")
    ap.add_argument("--model-path", default=None, help="default: SmolLM2 from model_zoo")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS))
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096, 6144])
    ap.add_argument("--depths", nargs="+", type=float, default=[0.1, 0.5, 0.9])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--fmt", nargs="+", default=["plain"])
    ap.add_argument("--kv-style", default="sentence", choices=KV_STYLES)
    ap.add_argument("--kv-pairs", type=int, default=4, help="0: the whole context is pairs")
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)

    from uniprefill_sglang.cpu_engine import activate_cpu_engine_env, make_cpu_engine

    activate_cpu_engine_env()
    from transformers import AutoTokenizer

    from uniprefill_sglang.model_zoo import prepare_smollm2

    path = args.model_path or prepare_smollm2()
    tok = AutoTokenizer.from_pretrained(path)
    cases = [
        c
        for fmt in args.fmt
        for c in make_cases(
            tok, args.kinds, args.lengths, args.depths, args.seeds, fmt, args.kv_style,
            args.kv_pairs or None,
        )
    ]
    kw = {"dtype": args.dtype} if args.dtype else {}
    # Radix cache off: every request is a full prefill, so the timing column means something.
    engine = make_cpu_engine(path, disable_radix_cache=True, **kw)
    try:
        rows = evaluate(engine, cases, args.max_new_tokens)
    finally:
        engine.shutdown()
    print(summarize(rows))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
