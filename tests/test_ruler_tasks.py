"""The RULER- and SCBench-format generators (no engine): haystacks, the multi-query and
aggregation families, shared-context cases, the benchmarks' scoring rules and the named seed
sets. Tokenizer-only; seconds."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from uniprefill_sglang.tools import calibrate as cal
from uniprefill_sglang.tools import aggregation_tasks as agg
from uniprefill_sglang.tools import haystacks, scoring
from uniprefill_sglang.tools.shared_context_tasks import (SHARED_MODES, make_shared_case,
                                                          make_shared_cases)
from uniprefill_sglang.tools.tasks import (_ADJECTIVES, _WORDS, HAYSTACK_TASKS, REPORTING_SEEDS,
                                           TEST_SEEDS, TUNING_SEEDS, fingerprint, make_case,
                                           make_cases, parse_seeds, seed_set)

SEED = REPORTING_SEEDS[0]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


# ---- haystacks ------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [7, TEST_SEEDS[0], TEST_SEEDS[-1]])
@pytest.mark.parametrize("kind", haystacks.HAYSTACKS)
def test_haystacks_grow_by_prefix_and_hold_nothing_a_question_asks(kind, seed):
    long = haystacks.units(kind, 300, seed=seed)
    assert len(long) == 300
    for n in (0, 1, 37, 299):
        assert haystacks.units(kind, n, seed=seed) == long[:n]
    text = " ".join(long)
    assert not re.search(r"\d", text)
    vocab = set(_WORDS) | set(_ADJECTIVES)
    words = set(re.findall(r"[a-z]+", text.lower()))
    assert not words & vocab, words & vocab
    for phrase in ("special magic", "pass key", "value", "var "):
        assert phrase not in text.lower()


def test_prose_order_follows_the_seed_and_essay_repeats():
    a, b = haystacks.units("prose", 64, 1), haystacks.units("prose", 64, 2)
    assert a != b and sorted(a) == sorted(b)  # same sentences, another order
    assert len(set(a[:len(haystacks.PROSE_SENTENCES)])) == len(haystacks.PROSE_SENTENCES)
    e = haystacks.units("essay", 2 * len(haystacks.ESSAY_SENTENCES), 0)
    assert e[:len(haystacks.ESSAY_SENTENCES)] == e[len(haystacks.ESSAY_SENTENCES):]
    with pytest.raises(ValueError):
        haystacks.units("lorem", 3)


# sha256 of "\n".join(units(kind, 500, seed)) for every tuning and validation seed, as the
# recorded cases were built: test seeds must not change them.
_FIXED_TEXT = {"essay": "2ea53091c0fbf3e1", "manual": "9583eb55c05032cd"}


@pytest.mark.parametrize("kind", sorted(_FIXED_TEXT))
def test_essay_and_manual_are_fresh_text_on_test_seeds_only(kind):
    import hashlib

    def digest(seed):
        return hashlib.sha256("\n".join(haystacks.units(kind, 500, seed)).encode()).hexdigest()

    for seed in (TUNING_SEEDS[0], TUNING_SEEDS[-1], REPORTING_SEEDS[0], REPORTING_SEEDS[-1]):
        assert digest(seed)[:16] == _FIXED_TEXT[kind], seed
    pool = haystacks.ESSAY_SENTENCES if kind == "essay" else haystacks.MANUAL_SENTENCES
    a, b = (haystacks.units(kind, 4 * len(pool), s) for s in TEST_SEEDS[:2])
    assert a != b and digest(TEST_SEEDS[0])[:16] != _FIXED_TEXT[kind]
    for text in (a, b):  # the same sentences, each round a whole pass over them
        for r in range(4):
            assert sorted(text[r * len(pool):(r + 1) * len(pool)]) == sorted(pool)
    if kind == "essay":  # paragraphs move, each stays whole and in order
        starts = {p[0]: p for p in haystacks.ESSAY_PARAGRAPHS}
        i = 0
        while i < len(a):
            assert tuple(a[i:i + len(starts[a[i]])]) == starts[a[i]]
            i += len(starts[a[i]])
    else:  # every round is the steps in order from some step
        for r in range(4):
            rnd = a[r * len(pool):(r + 1) * len(pool)]
            k = pool.index(rnd[0])
            assert tuple(rnd) == pool[k:] + pool[:k]


# ---- scoring --------------------------------------------------------------------------------


def test_ruler_and_scbench_rules():
    refs = ["1234567", "Apple", "VAR ABCDE"]
    assert scoring.string_match_all(" 1234567, apple and var abcde.", refs) == 1.0
    assert scoring.string_match_all("APPLE only", refs) == pytest.approx(1 / 3)
    assert scoring.string_match_all("nothing", refs) == 0.0
    # Substring, as RULER: a longer number contains the reference (the strict check does not).
    assert scoring.string_match_all("12345678", ["1234567"]) == 1.0
    assert scoring.string_match_part("the apple", refs) == 1.0
    assert scoring.string_match_part("pear", refs) == 0.0
    assert scoring.scbench_match(' "fc7ec440-82a0"', "FC7EC440-82a0") == 1.0
    assert scoring.scbench_match("fc7ec440", "fc7ec440-82a0") == 0.0
    assert scoring.score("scbench_match", "x 42", ["42"]) == 1.0
    with pytest.raises(ValueError):
        scoring.score("rouge", "x", ["x"])
    with pytest.raises(ValueError):
        scoring.string_match_all("x", [])


# ---- seeds ----------------------------------------------------------------------------------


def test_seed_sets_are_disjoint_and_named():
    sets = (TUNING_SEEDS, REPORTING_SEEDS, TEST_SEEDS)
    assert sum(len(s) for s in sets) == len(set().union(*sets)) == 3000
    assert seed_set(0) == "tuning" and seed_set(SEED) == "reporting"
    assert seed_set(1999) == "reporting" and seed_set(2000) == seed_set(2999) == "test"
    for outside in (-1, 3000):
        with pytest.raises(ValueError):
            seed_set(outside)
    assert parse_seeds("reporting:2") == list(REPORTING_SEEDS[:2])
    assert parse_seeds("tuning:1") == [TUNING_SEEDS[0]] and parse_seeds("3,5") == [3, 5]
    assert parse_seeds("test:1") == [2000] and parse_seeds("test:3") == [2000, 2001, 2002]
    for bad in ("heldout:2", "test:0", "test:x", "test:1001"):
        with pytest.raises(ValueError):
            parse_seeds(bad)


def test_calibration_refuses_reporting_seeds():
    base = ["--model", "smollm2"]
    args = cal.parse_args(base)  # its defaults are tuning seeds
    assert {*cal._ints(args.seeds), *cal._ints(args.heldout_seeds)} <= set(TUNING_SEEDS)
    for flag in ("--seeds", "--heldout-seeds"):
        for seed in (SEED, TEST_SEEDS[0]):
            with pytest.raises(SystemExit):
                cal.parse_args(base + [flag, str(seed)])
    with pytest.raises(ValueError, match="tuning seeds only"):
        cal._cases(None, [SEED], [0.5], ["niah_number"], ["noise"])


# ---- single cases ---------------------------------------------------------------------------

NEW_GRID = [("niah_multiquery", h) for h in haystacks.HAYSTACKS] + [
    ("niah_number", "prose"), ("niah_word", "essay"), ("niah_multikey", "prose"),
    ("niah_multivalue", "essay"), ("vt", "prose"), ("cwe", "noise"), ("fwe", "noise")]


@pytest.mark.parametrize("target", (1500, 3000))
def test_new_cases_are_deterministic_fill_their_budget_and_hold_each_needle_once(tokenizer,
                                                                                 target):
    for task, hay in NEW_GRID:
        a = make_case(tokenizer, task, target, 0.3, SEED, haystack=hay)
        b = make_case(tokenizer, task, target, 0.3, SEED, haystack=hay)
        assert a.input_ids == b.input_ids and a.answers == b.answers
        assert 0.9 * target < a.n_tokens <= target, (a.name, a.n_tokens)
        assert a.check(" " + ", ".join(a.answers) + ".") and a.score(", ".join(a.answers)) == 1.0
        assert a.score("I do not know.") == 0.0 and not a.check("I do not know.")
        context = a.prompt[:a.prompt.rindex(a.question)]
        if task.startswith("niah") or task == "vt":
            assert (hay in a.name.split("-")) == (hay != "noise")
            for ans in a.answers:
                # vt's names recur in the chain ("VAR B = VAR A"): twice except the last.
                expected = 1 if task != "vt" else (2 if ans != a.answers[-1] else 1)
                assert context.count(ans) == expected, (a.name, ans)
            if hay != "noise":
                assert haystacks.NOISE_SENTENCES[0] not in context
                pool = {"prose": haystacks.PROSE_SENTENCES, "essay": haystacks.ESSAY_SENTENCES,
                        "manual": haystacks.MANUAL_SENTENCES}[hay]
                assert sum(context.count(s) for s in pool) > 10
    # The seed changes the needles, the haystack only their surroundings.
    p = make_case(tokenizer, "niah_number", 1500, 0.5, SEED, haystack="prose")
    e = make_case(tokenizer, "niah_number", 1500, 0.5, SEED, haystack="essay")
    o = make_case(tokenizer, "niah_number", 1500, 0.5, SEED + 1, haystack="prose")
    assert p.answers == e.answers != o.answers and p.prompt != e.prompt


def test_multiquery_asks_every_key_and_multikey_keeps_distractors(tokenizer):
    mq = make_case(tokenizer, "niah_multiquery", 1500, 0.5, SEED, haystack="essay")
    assert len(mq.answers) == 4 and len(set(mq.answers)) == 4
    for key in mq.meta["keys"]:
        assert key in mq.question
        assert f"for {key} is:" in mq.prompt
    assert mq.score(" " + mq.answers[0]) == 0.25 and not mq.check(" " + mq.answers[0])
    mk = make_case(tokenizer, "niah_multikey", 1500, 0.5, SEED, haystack="prose")
    assert len(mk.meta["distractor_keys"]) == 3
    for key in mk.meta["distractor_keys"]:
        assert key not in mk.question and mk.prompt.count(f"for {key} is:") == 1
    assert mk.meta["key"] in mk.question


def test_aggregation_cases_count_what_they_claim(tokenizer):
    c = make_case(tokenizer, "cwe", 3000, 0.5, SEED)
    items = re.findall(r"\d+\. ([a-z]+)", c.prompt)
    counts = Counter(items)
    assert len(c.answers) == agg.CWE_COMMON
    assert agg.cwe_common_freq(3000) == agg.CWE_COMMON_FREQ == c.meta["common_freq"]
    assert all(counts[w] == agg.CWE_COMMON_FREQ for w in c.answers)
    rare = [w for w in counts if w not in c.answers]
    assert rare and all(counts[w] == agg.CWE_RARE_FREQ for w in rare)
    assert all(len(w) == 6 for w in counts)  # no word inside another
    f = make_case(tokenizer, "fwe", 3000, 0.5, SEED)
    text = f.prompt[:f.prompt.rindex(f.question)].split("\n\n", 1)[1]
    ranked = Counter(text.split()).most_common()
    assert [w for w, _ in ranked[:3]] == f.answers
    assert ranked[2][1] > ranked[3][1]
    assert all(len(w) == 5 for w, _ in ranked)
    counts = agg.fwe_counts(500)
    assert counts == sorted(counts, reverse=True) and sum(counts) <= 500


def test_grid_and_refusals(tokenizer):
    grid = dict(tasks=("niah_number", "qa", "cwe"), lengths=(900,), depths=(0.2, 0.8),
                seeds=(SEED,), haystacks=("noise", "essay"))
    a, b = make_cases(tokenizer, **grid), make_cases(tokenizer, **grid)
    assert fingerprint(a) == fingerprint(b)
    # niah: 2 haystacks x 2 depths; qa: no haystack, 2 depths; cwe: no needle, one case.
    assert [c.task for c in a] == ["niah_number"] * 4 + ["qa"] * 2 + ["cwe"]
    assert {c.haystack for c in a if c.task != "niah_number"} == {"noise"}
    assert "qa" not in HAYSTACK_TASKS
    short = a[-1]  # cwe at 900 tokens: fewer repeats of the common words, still the most
    counts = Counter(re.findall(r"\d+\. ([a-z]+)", short.prompt))
    assert [w for w, _ in counts.most_common(10)] and set(short.answers) == {
        w for w, k in counts.items() if k == short.meta["common_freq"]}
    assert short.meta["common_freq"] > agg.CWE_RARE_FREQ
    with pytest.raises(ValueError):
        make_case(tokenizer, "qa", 900, haystack="prose")
    with pytest.raises(ValueError):
        make_case(tokenizer, "niah_number", 900, haystack="lorem")


# ---- shared context -------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ("plain", "chat"))
def test_shared_cases_share_the_context_prefix(tokenizer, fmt):
    for task in ("kv", "niah"):
        for mode in SHARED_MODES:
            c = make_shared_case(tokenizer, task, 1800, SEED, n_queries=3, mode=mode, fmt=fmt,
                                 haystack="prose")
            again = make_shared_case(tokenizer, task, 1800, SEED, n_queries=3, mode=mode,
                                     fmt=fmt, haystack="prose")
            assert [q.input_ids for q in c.queries] == [q.input_ids for q in again.queries]
            assert 0.85 * 1800 < c.n_tokens <= 1800, (c.name, c.n_tokens)
            answers = [q.answer for q in c.queries]
            assert len(set(answers)) == 3
            for q in c.queries:
                assert q.input_ids[:len(c.context_ids)] == c.context_ids
                assert c.context.count(q.answer) == 1  # each answer once in the context
                assert q.score(f" {q.answer}.") == 1.0 and q.check(f" {q.answer}.")
                assert q.score(" ".join(a for a in answers if a != q.answer)) == 0.0
                assert not q.check(" ".join(answers))  # naming another query's answer
            lens = [len(q.input_ids) for q in c.queries]
            if mode == "multi_turn":
                # Each turn extends the previous prompt and carries its right answer.
                assert lens == sorted(lens) and lens[0] < lens[-1]
                last = tokenizer.decode(c.queries[-1].input_ids[len(c.context_ids):])
                assert all(a in last for a in answers[:-1]) and answers[-1] not in last
            else:
                assert max(lens) - min(lens) < 40
                for q in c.queries:
                    tail = tokenizer.decode(q.input_ids[len(c.context_ids):])
                    assert not any(a in tail for a in answers)


def test_shared_grid_names_and_seeds(tokenizer):
    cases = make_shared_cases(tokenizer, ("kv", "niah"), ("multi_request",), (1200,),
                              (SEED, SEED + 1), n_queries=2, haystacks=("noise", "essay"))
    names = [c.name for c in cases]
    assert len(names) == len(set(names)) == 2 + 4  # kv has no haystack
    kv0, kv1 = cases[0], cases[1]
    assert kv0.queries[0].answer != kv1.queries[0].answer
    with pytest.raises(ValueError):
        make_shared_case(tokenizer, "vt", 1200)


def test_the_recorded_validation_and_test_cases_are_generated_again_byte_for_byte(tokenizer):
    """The validation run of SmolLM2's shipped profile (reporting seed 1000, manual, prose and
    essay haystacks) and its test run (seed 2000, fresh text): the cases their result files
    fingerprint are the cases the generator gives today."""
    import json
    from pathlib import Path

    fidelity = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "fidelity"
    for name in ("eval_smollm2_two_drops_reporting.json", "eval_smollm2_shipped_test_7600.json"):
        meta = json.loads((fidelity / name).read_text())["meta"]
        cases = []
        for spec in meta["tasks"]:
            task, hay = spec.split("/")
            cases += make_cases(tokenizer, [task], meta["lengths"], meta["depths"],
                                meta["seeds"], meta["fmt"], [hay])
        assert fingerprint(cases) == meta["case_fingerprint"], name
