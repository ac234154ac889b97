"""Prefix reuse under token dropping (prefix_reuse.py), on the real SmolLM2 and SGLang's CPU
engine, radix cache on.

The reference for a request that hits a cached document is the same prompt with the cache
flushed first: the request then selects for itself. A re-selected follow-up must keep exactly
the positions the reference keeps (`UNIPREFILL_REPORT_KEPT`: a fingerprint of the survivors after
each drop) and answer the same text, float32 on the CPU; the host KV lengths are checked against
the device at every drop and decode step (`UNIPREFILL_CHECK_KV_LENS`), and the pools must be
back to idle with no private prefix slot left.
"""

from __future__ import annotations

import os

import pytest

from uniprefill_sglang.tools.cpu_engine import flush_cache, uniprefill_state

pytestmark = pytest.mark.engine
os.environ["UNIPREFILL_CHECK_KV_LENS"] = "1"
os.environ["UNIPREFILL_REPORT_KEPT"] = "1"

GREEDY = {"temperature": 0.0, "max_new_tokens": 8}
CHUNK = 512


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="module")
def engine(module_engine_factory):
    # Chunked at 512: the document is prefilled in chunks that park at the first drop layer,
    # and a follow-up with a long new part re-selects over its prefix and its own parked chunk.
    # The checkpoint on: verify may re-select, a dense request restore.
    return module_engine_factory(enable_uniprefill=True, chunked_prefill_size=CHUNK,
                                 max_prefill_tokens=CHUNK, uniprefill_prefix_checkpoint=True)


def _ask(engine, ids, policy=None, knobs=None, **params):
    knobs = dict(knobs or {})
    if policy is not None:
        knobs["uniprefill_prefix_policy"] = policy
    out = engine.generate(input_ids=ids, sampling_params={**GREEDY, **params,
                                                          "custom_params": knobs})
    entries = out["meta_info"]["uniprefill"]  # none for a request that generates nothing
    return out, entries[0] if entries else None


def _reference(engine, ids):
    flush_cache(engine)
    return _ask(engine, ids)


def _shipped_top_p() -> float:
    """The first drop's top-p of SmolLM2's shipped profile, which these engines run (prefix
    re-selection uses the first drop's)."""
    from uniprefill_sglang.config import find_shipped_profile

    return find_shipped_profile(["LlamaForCausalLM"], 30, 576).top_p[0]


def _assert_idle(engine):
    flush_cache(engine)
    state = uniprefill_state(engine)
    assert state["idle"] and state["parked_requests"] == 0, state
    assert state["private_prefix_slots"] == 0, state
    assert state["available_kv_tokens"] == state["max_total_num_tokens"], state


def test_reselected_followups_keep_the_uncached_positions(engine, tokenizer):
    from uniprefill_sglang.tools import shared_context

    case = shared_context.make_case(tokenizer, "locker", 1400, num_facts=3, seed=3)
    prompts = [case.prompt_ids(i) for i in range(3)]
    # A follow-up whose new part is itself longer than a chunk: its first chunk parks, and the
    # final chunk re-selects over the cached document and that parked chunk together.
    long_tail = case.document_ids + tokenizer(
        " Here we go." * 150, add_special_tokens=False)["input_ids"] + case.questions[0].input_ids
    refs = [_reference(engine, ids) for ids in prompts + [long_tail]]
    flush_cache(engine)
    first, meta = _ask(engine, prompts[0], "reselect")
    assert meta.get("prefix") is None and first["text"] == refs[0][0]["text"]
    for ids, (ref, ref_meta) in zip(prompts[1:] + [long_tail], refs[1:]):
        out, meta = _ask(engine, ids, "reselect")
        assert out["meta_info"]["cached_tokens"] >= len(case.document_ids) - 1
        assert meta["prefix"]["action"] == "re-selected", meta
        assert meta["kept_digest"] == ref_meta["kept_digest"], (meta, ref_meta)
        assert meta["kept_tokens"] == ref_meta["kept_tokens"]
        assert out["text"] == ref["text"]
    _assert_idle(engine)


def test_verify_reports_its_choice_and_reuse_sparse_does_not_verify(engine, tokenizer):
    from uniprefill_sglang.tools import shared_context

    case = shared_context.make_case(tokenizer, "kv", 1200, num_facts=3, seed=5)
    flush_cache(engine)
    _ask(engine, case.prompt_ids(0), "verify")
    for i, policy in ((1, "verify"), (2, "reuse-sparse")):
        out, meta = _ask(engine, case.prompt_ids(i), policy)
        if policy == "reuse-sparse" and "prefix" not in meta:
            # Nothing to re-select, so the cost rule counts the question's own tokens only:
            # too few, the step runs as stock and reads the cache as it is.
            assert not meta["enabled"] and meta["reason"] == "prompt under the minimum length"
            continue
        prefix = meta["prefix"]
        assert prefix["policy"] == policy and prefix["cached_tokens"] > 0, meta
        if policy == "verify":
            assert prefix["action"] in ("reused", "re-selected") and prefix["why"], prefix
            if "missing_mass" in prefix:
                assert 0 <= prefix["missing_mass"] <= 1 and 0 <= prefix["dropped_mass"] <= 1
                assert prefix["tolerance"] == pytest.approx(1 - _shipped_top_p())
                reused = prefix["missing_mass"] <= prefix["tolerance"]
                assert reused == (prefix["action"] == "reused"), prefix
        else:
            assert prefix["action"] == "reused" and "missing_mass" not in prefix
    _assert_idle(engine)


def test_a_cached_prefix_built_by_a_request_generating_nothing_is_dense(engine, tokenizer):
    """SGLang's frontend caches a fork's shared prefix with max_new_tokens 0: it runs dense, and
    a follow-up then reuses a prefix that holds every token."""
    from uniprefill_sglang.tools import shared_context

    case = shared_context.make_case(tokenizer, "locker", 1200, num_facts=2, seed=7)
    for builder, holds_all in (("dense-prefix", True), ("verify", True), ("reuse-sparse", False)):
        flush_cache(engine)
        _ask(engine, case.document_ids, builder, max_new_tokens=0)
        out, meta = _ask(engine, case.prompt_ids(0), "verify")
        assert meta["prefix"]["cached_tokens"] >= len(case.document_ids) - 1, meta
        # Under reuse-sparse the builder dropped as any request does.
        assert ("holds every token" in meta["prefix"]["why"]) == holds_all, (builder, meta)
    _assert_idle(engine)


def test_a_short_cached_system_turn_is_reselected(engine, tokenizer):
    """Two chats share only the template's system turn, cached by the first: the second selects
    exactly as it would without the cache."""
    from uniprefill_sglang.tools import shared_context

    chats = []
    for seed in (11, 12):
        case = shared_context.make_case(tokenizer, "locker", 900, num_facts=2, seed=seed)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Chat {seed}. " + shared_context.chat_turns(case)[0]}],
            tokenize=False,
            add_generation_prompt=True)
        chats.append(tokenizer(text)["input_ids"])
    ref, ref_meta = _reference(engine, chats[1])
    flush_cache(engine)
    _ask(engine, chats[0], "verify")
    out, meta = _ask(engine, chats[1], "verify")
    assert 0 < meta["prefix"]["cached_tokens"] <= 128, meta
    assert meta["prefix"]["action"] == "re-selected" and meta["prefix"]["why"] == \
        "short cached prefix", meta
    assert meta["kept_digest"] == ref_meta["kept_digest"] and out["text"] == ref["text"]
    _assert_idle(engine)


def test_a_dense_request_gets_back_what_the_cache_dropped(engine, tokenizer):
    """A request that asks for no drop (`uniprefill: false`) over a document an earlier request
    cached sparse: the dropped tokens rejoin (from the checkpoint, onto private slots), so it
    answers as dense on an empty cache. Under reuse-sparse it reads the cache as it is."""
    from uniprefill_sglang.tools import shared_context

    case = shared_context.make_case(tokenizer, "locker", 1200, num_facts=2, seed=9)
    dense = {"uniprefill": False}
    flush_cache(engine)
    ref, _ = _ask(engine, case.prompt_ids(1), knobs=dense)
    for policy, action in (("verify", "restored"), ("reuse-sparse", None)):
        flush_cache(engine)
        _, first = _ask(engine, case.prompt_ids(0), policy)
        assert first["kept_tokens"][-1] < first["kept_tokens"][0], first  # the cache is sparse
        out, meta = _ask(engine, case.prompt_ids(1), policy, knobs=dense)
        assert not meta["enabled"] and meta["reason"] == "disabled by the request", meta
        if action is None:
            assert meta.get("prefix") is None, meta
        else:
            assert meta["prefix"]["action"] == action, meta
            assert meta["kept_tokens"][-1] == meta["kept_tokens"][0], meta  # nothing dropped
            assert out["text"] == ref["text"]
    _assert_idle(engine)
