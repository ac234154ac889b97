"""Shared-context benchmark: several requests about one cached document, one after another.

Every follow-up hits the document in the radix cache, so what the first request's selection
dropped is what the follow-ups find missing (prefix_reuse.py). Cases come from
`uniprefill_sglang/tools/shared_context.py` (generated locally): documents holding several facts
(locker codes, key-value lines, variable chains), asked one question per fact, as plain prompts
(document, question, answer primer) and as multi-turn chats (chat template; each turn asks
another fact, earlier turns carry the right answers so that every mode sees the same prompts).

Modes, in one engine (radix cache on), each case sent cold (`/flush_cache` first):
* ``dense``: UniPrefill off for the request (`custom_params={"uniprefill": false}`);
* ``nocache``: UniPrefill, the cache flushed before every request: each request selects for
  itself. The reference the prefix policies are compared with;
* ``reuse-sparse``, ``verify``, ``reselect``, ``dense-prefix``: UniPrefill with the cache and
  that prefix policy (per request `uniprefill_prefix_policy`).

Reported per mode: accuracy on first and follow-up requests (also restricted to the requests
dense answers), agreement with ``nocache`` (same output text), cached tokens per request, TTFT
(time to the first streamed chunk), what the policy did (reused / re-selected) and, for
re-selected requests, whether they kept exactly the positions ``nocache`` kept
(`UNIPREFILL_REPORT_KEPT=1`, set here except for the timing runs on random prompts: it reads the
survivors back after every drop).

CPU (SmolLM2-135M-Instruct, what tests/test_prefix_reuse.py runs a slice of):

    python benchmarks/shared_context.py --out benchmarks/results/prefix/shared_context_smollm2_cpu.json

GPU timing (random weights, random token ids, no tokenizer; fixed keep schedule):

    python benchmarks/shared_context.py --random-prompts --lengths 32768,65536 --question-tokens 100 \\
        --model benchmarks/models/llama-3.1-8b --engine-kwargs '{"load_format": "dummy",
        "uniprefill_keep_ratio": "0.5,0.8", "context_length": 70000}' --out shared_context_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))  # result_header, also when loaded by path
from result_header import result_header  # noqa: E402

from uniprefill_sglang.tools.cpu_engine import flush_cache  # noqa: E402

MODES = {
    "dense": ({"uniprefill": False}, True),
    "nocache": ({}, False),
    "reuse-sparse": ({"uniprefill_prefix_policy": "reuse-sparse"}, True),
    "verify": ({"uniprefill_prefix_policy": "verify"}, True),
    "reselect": ({"uniprefill_prefix_policy": "reselect"}, True),
    "dense-prefix": ({"uniprefill_prefix_policy": "dense-prefix"}, True),
}
REFERENCE = "nocache"


class Conversation:
    """Prompts (token ids) sent one after another about one document, and how to grade each
    answer (None: not graded, random prompts)."""

    def __init__(self, name: str, prompts: List[List[int]], questions: Optional[list] = None):
        self.name, self.prompts, self.questions = name, prompts, questions


def plain_conversations(tokenizer, kinds, lengths, seeds, num_facts) -> List[Conversation]:
    from uniprefill_sglang.tools import shared_context

    out = []
    for case in shared_context.make_cases(tokenizer, kinds, lengths, seeds, num_facts):
        out.append(Conversation(f"plain-{case.name}",
                                [case.prompt_ids(i) for i in range(len(case.questions))],
                                case.questions))
    return out


def chat_conversations(tokenizer, kinds, lengths, seeds, num_facts) -> List[Conversation]:
    """Multi-turn chats: turn k asks fact k after the earlier turns and their right answers."""
    from uniprefill_sglang.tools import shared_context
    from uniprefill_sglang.tools.tasks import encode

    out = []
    for case in shared_context.make_cases(tokenizer, kinds, lengths, seeds, num_facts):
        turns = shared_context.chat_turns(case)
        messages, prompts = [], []
        for turn, q in zip(turns, case.questions):
            primer = q.text.split("\n")[1]
            messages.append({"role": "user", "content": turn})
            text = tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=True)
            prompts.append(encode(tokenizer, text + primer))
            messages.append({"role": "assistant", "content": f"{primer} {q.answer}."})
        out.append(Conversation(f"chat-{case.name}", prompts, case.questions))
    return out


def random_conversations(lengths, question_tokens: int, num_questions: int, vocab: int,
                         seed: int) -> List[Conversation]:
    rng = random.Random(seed)
    out = []
    for length in lengths:
        doc = [rng.randrange(100, vocab) for _ in range(length)]
        prompts = [doc + [rng.randrange(100, vocab) for _ in range(question_tokens)]
                   for _ in range(num_questions)]
        out.append(Conversation(f"random-{length}", prompts))
    return out


def _send(engine, ids: List[int], knobs: dict, max_new_tokens: int) -> dict:
    """One greedy request, streamed: TTFT = the first chunk's arrival."""
    from uniprefill_sglang.tools.demo import timed_generate

    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "custom_params": knobs}
    ttft, last = timed_generate(engine, ids, params)
    meta = last["meta_info"]
    entry = (meta.get("uniprefill") or [{}])[0]
    return {"text": last.get("text", ""), "output_ids": last.get("output_ids"),
            "ttft_s": ttft, "cached_tokens": meta.get("cached_tokens", 0),
            "kept_tokens": entry.get("kept_tokens"), "kept_digest": entry.get("kept_digest"),
            "reason": entry.get("reason"), "prefix": entry.get("prefix")}


def run(engine, conversations: List[Conversation], modes: List[str], max_new_tokens: int,
        repeats: int = 1, progress: bool = True) -> List[dict]:
    rows = []
    for rep in range(repeats):
        for conv in conversations:
            for mode in modes:
                knobs, cached = MODES[mode]
                flush_cache(engine, timeout_s=120)
                for turn, ids in enumerate(conv.prompts):
                    if not cached:
                        flush_cache(engine, timeout_s=120)
                    res = _send(engine, ids, knobs, max_new_tokens)
                    q = conv.questions[turn] if conv.questions else None
                    row = {"conversation": conv.name, "mode": mode, "turn": turn,
                           "repeat": rep, "prompt_tokens": len(ids), **res,
                           "correct": q.correct(res["text"]) if q else None}
                    rows.append(row)
                    if progress:
                        action = (res["prefix"] or {}).get("action", "-")
                        print(f"{conv.name} {mode:12s} turn {turn} cached {res['cached_tokens']:6d}"
                              f" {action:11s} ttft {res['ttft_s']:.3f}s "
                              f"{'' if q is None else ('ok ' if row['correct'] else 'NO ')}"
                              f"{res['text'][:40]!r}", flush=True)
    return rows


def summarize(rows: List[dict], modes: List[str]) -> Dict[str, dict]:
    by = defaultdict(list)
    for r in rows:
        by[(r["conversation"], r["turn"], r["repeat"], r["mode"])].append(r)
    ref = {k[:3]: v[0] for k, v in by.items() if k[3] == REFERENCE}
    dense = {k[:3]: v[0] for k, v in by.items() if k[3] == "dense"}
    out = {}
    for mode in modes:
        mine = [v[0] for k, v in by.items() if k[3] == mode]
        first = [r for r in mine if r["turn"] == 0]
        follow = [r for r in mine if r["turn"] > 0]
        key = lambda r: (r["conversation"], r["turn"], r["repeat"])  # noqa: E731

        def acc(rs):
            graded = [r for r in rs if r["correct"] is not None]
            return None if not graded else [sum(r["correct"] for r in graded), len(graded)]

        def agree(rs):
            pairs = [(r, ref[key(r)]) for r in rs if key(r) in ref]
            return None if not pairs else [sum(r["text"] == o["text"] for r, o in pairs),
                                           len(pairs)]

        def mean(xs):
            xs = [x for x in xs if x is not None]
            return None if not xs else sum(xs) / len(xs)

        dense_right = [r for r in follow if key(r) in dense and dense[key(r)]["correct"]]
        reselected = [r for r in mine if (r["prefix"] or {}).get("action") == "re-selected"]
        exact = [r for r in reselected if key(r) in ref and r["kept_digest"] is not None
                 and r["kept_digest"] == ref[key(r)]["kept_digest"]]
        out[mode] = {
            "first_correct": acc(first), "followup_correct": acc(follow),
            "followup_correct_where_dense_right": acc(dense_right),
            "first_agree_with_nocache": agree(first),
            "followup_agree_with_nocache": agree(follow),
            "mean_cached_tokens_followup": mean([r["cached_tokens"] for r in follow]),
            "mean_ttft_first_s": mean([r["ttft_s"] for r in first]),
            "mean_ttft_followup_s": mean([r["ttft_s"] for r in follow]),
            "prefix_actions": dict(Counter((r["prefix"] or {}).get("action", "none")
                                           for r in mine)),
            "reselected_exact_positions": [len(exact), len(reselected)],
        }
    return out


def markdown(summary: Dict[str, dict]) -> str:
    def frac(v):
        return "-" if v is None else f"{v[0]}/{v[1]}"

    def sec(v):
        return "-" if v is None else f"{v:.3f}"

    lines = ["| mode | first right | follow-ups right | follow-ups right where dense is | "
             "follow-ups = nocache | cached tokens / follow-up | TTFT first (s) | "
             "TTFT follow-up (s) | re-selected (exact positions) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for mode, s in summary.items():
        re_sel = s["reselected_exact_positions"]
        lines.append(
            f"| {mode} | {frac(s['first_correct'])} | {frac(s['followup_correct'])} | "
            f"{frac(s['followup_correct_where_dense_right'])} | "
            f"{frac(s['followup_agree_with_nocache'])} | "
            f"{'-' if s['mean_cached_tokens_followup'] is None else round(s['mean_cached_tokens_followup'])} | "
            f"{sec(s['mean_ttft_first_s'])} | {sec(s['mean_ttft_followup_s'])} | "
            f"{re_sel[1]} ({re_sel[0]}) |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2",
                   help="smollm2 (model_zoo, the CPU engine) or a model folder")
    p.add_argument("--engine-kwargs", default="{}", help="JSON: extra sglang.Engine arguments")
    p.add_argument("--modes", default=",".join(m for m in MODES if m != "dense-prefix"))
    p.add_argument("--kinds", default="locker,kv,vt")
    p.add_argument("--formats", default="plain,chat")
    p.add_argument("--lengths", default="2048")
    p.add_argument("--seeds", default="0")
    p.add_argument("--facts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--random-prompts", action="store_true",
                   help="random token ids (no tokenizer needed), timing only")
    p.add_argument("--question-tokens", type=int, default=100)
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not args.random_prompts:  # positions fingerprints cost a host sync per drop: not timed
        os.environ.setdefault("UNIPREFILL_REPORT_KEPT", "1")
    modes = args.modes.split(",")
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"unknown mode {m!r}; expected some of {', '.join(MODES)}")
    lengths = [int(x) for x in args.lengths.split(",")]
    model = args.model
    from uniprefill_sglang.tools.model_zoo import MODELS, prepare_model

    if model in MODELS:
        model = prepare_model(model)
    engine_kwargs = json.loads(args.engine_kwargs)
    if args.random_prompts:
        engine_kwargs.setdefault("skip_tokenizer_init", True)
        cfg = json.loads((Path(model) / "config.json").read_text())
        convs = random_conversations(lengths, args.question_tokens, args.questions,
                                     cfg["vocab_size"], seed=0)
        max_new = 1
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
        kinds, seeds = args.kinds.split(","), [int(s) for s in args.seeds.split(",")]
        builders = {"plain": plain_conversations, "chat": chat_conversations}
        convs = [c for f in args.formats.split(",")
                 for c in builders[f](tok, kinds, lengths, seeds, args.facts)]
        max_new = args.max_new_tokens
    import torch

    from uniprefill_sglang.tools.demo import make_engine

    engine = make_engine(model, torch.cuda.is_available(), enable_uniprefill=True,
                         **engine_kwargs)
    try:
        if args.random_prompts:  # warm-up: kernels, CUDA graphs, FlashInfer plans
            run(engine, convs[:1], modes, max_new, progress=False)
        rows = run(engine, convs, modes, max_new, repeats=args.repeats)
    finally:
        engine.shutdown()
    summary = summarize(rows, modes)
    table = markdown(summary)
    print(table)
    result = {"header": result_header(model=Path(model).name), "args": vars(args),
              "summary": summary, "table": table, "rows": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
