"""Block-sparse prefill attention (backends/block_sparse.py) in SGLang's CPU engine on the real
SmolLM2-135M-Instruct, through the torch_native adapter.

Two engines: one with the option off at start-up, requests turning it on with their knobs
(against dense, a fixed density, each block estimate, with drops, over the radix cache), and one
with it on by flag (the last-query estimate) and chunked prefill. Each `*_run` fixture starts its engine, runs what the tests need, shuts it
down and returns the outputs (`Engine.shutdown()` kills every child process: engines never
overlap).
"""

from __future__ import annotations

import os
import random

import pytest

from uniprefill_sglang.tools.cpu_engine import flush_cache, idle_state, make_cpu_engine

pytestmark = pytest.mark.engine

os.environ["UNIPREFILL_CHECK_KV_LENS"] = "1"  # host KV lengths checked against the device's

GREEDY = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
BLOCK = 64
MIN_TOKENS = 256  # prompts here are longer: every prefill step runs block-sparse
DENSITY = "uniprefill_block_sparse_density"
ESTIMATE = "uniprefill_block_sparse_estimate"
ALL_KEPT = {"uniprefill_top_p": 1.0}  # drops run and keep every token


def _text(seed: int, n_sentences: int) -> str:
    rng = random.Random(seed)
    names = ["Ada", "Bruno", "Chen", "Dana", "Emil", "Farah"]
    places = ["the harbour", "the library", "a small farm", "the old mill", "the station"]
    things = ["a red kite", "a brass key", "seven apples", "a blue notebook", "a lantern"]
    story = " ".join(f"{rng.choice(names)} walked to {rng.choice(places)} and found "
                     f"{rng.choice(things)}." for _ in range(n_sentences))
    return (f"Read the story and answer.\n\n{story}\nThe secret word is 'marmalade'.\n\n"
            "Question: What is the secret word?\nAnswer:")


PROMPT = _text(1, 90)  # about 1.2K tokens


def _entry(out) -> dict:
    """The request's meta_info entry of its last prefill forward."""
    entries = [e for e in out["meta_info"]["uniprefill"] if e["reason"] != "decode"]
    return entries[-1]


def _assert_no_leak(state) -> None:
    assert state["idle"] and state["protected_kv_tokens"] == 0, state
    assert state["available_kv_tokens"] + state["evictable_kv_tokens"] == state[
        "max_total_num_tokens"], state
    assert state["free_req_slots"] == state["req_slots"] and state["parked_requests"] == 0, state


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="module")
def knob_run(smollm2_path, tokenizer):
    engine = make_cpu_engine(smollm2_path, enable_uniprefill=True,
                             uniprefill_block_sparse_min_tokens=MIN_TOKENS)
    ids = tokenizer(_text(3, 80), add_special_tokens=False)["input_ids"]
    prefix, follow_up = ids[:10 * BLOCK], ids[:10 * BLOCK + 100]  # the prefix ends on a block

    def fresh(prompt, custom_params, **kw):
        flush_cache(engine)
        return engine.generate(prompt, dict(GREEDY, custom_params=custom_params), **kw)

    try:
        run = {
            "dense": fresh(PROMPT, {"uniprefill": False}),
            "full": fresh(PROMPT, {**ALL_KEPT, DENSITY: 1.0}),
            "sparse": fresh(PROMPT, {**ALL_KEPT, DENSITY: 0.3}),
            "top_p": fresh(PROMPT, {**ALL_KEPT, "uniprefill_block_sparse_top_p": 0.9}),
            "last_queries": fresh(PROMPT, {**ALL_KEPT, "uniprefill_block_sparse_top_p": 0.9,
                                           ESTIMATE: "last_queries"}),
            "both": fresh(PROMPT, {**ALL_KEPT, "uniprefill_block_sparse_top_p": 0.9,
                                   ESTIMATE: "both"}),
            "dropped": fresh(PROMPT, {"uniprefill_keep_ratio": 0.5, DENSITY: 0.3}),
        }
        sparse = {**ALL_KEPT, DENSITY: 0.3}
        flush_cache(engine)
        engine.generate(input_ids=prefix,
                        sampling_params=dict(GREEDY, max_new_tokens=1, custom_params=sparse))
        run["cached"] = engine.generate(input_ids=follow_up,
                                        sampling_params=dict(GREEDY, custom_params=sparse))
        run["uncached"] = fresh(None, sparse, input_ids=follow_up)
        try:
            engine.generate(PROMPT, dict(GREEDY, custom_params={DENSITY: 1.5}))
            run["bad_knob"] = None
        except Exception as e:  # noqa: BLE001 - the engine raises what the tokenizer refused
            run["bad_knob"] = str(e)
        try:
            engine.generate(PROMPT, dict(GREEDY, custom_params={DENSITY: 0.3, ESTIMATE: "mean"}))
            run["bad_estimate"] = None
        except Exception as e:  # noqa: BLE001
            run["bad_estimate"] = str(e)
        run["pool"] = idle_state(engine)
        return run
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def chunked_run(smollm2_path, knob_run):
    engine = make_cpu_engine(smollm2_path, enable_uniprefill=True, chunked_prefill_size=256,
                             uniprefill_block_sparse_density=0.3,
                             uniprefill_block_sparse_estimate="last_queries",
                             uniprefill_block_sparse_min_tokens=MIN_TOKENS)
    try:
        return {"out": engine.generate(PROMPT, dict(GREEDY, custom_params=ALL_KEPT)),
                "pooled": engine.generate(PROMPT, dict(GREEDY, custom_params={
                    **ALL_KEPT, ESTIMATE: "pooled"})),
                "pool": idle_state(engine)}
    finally:
        engine.shutdown()


def test_density_one_is_token_identical_to_dense(knob_run):
    full, dense = knob_run["full"], knob_run["dense"]
    assert full["output_ids"] == dense["output_ids"], (full["text"], dense["text"])
    assert _entry(full)["block_sparse_density"] == 1.0
    assert "block_sparse_density" not in _entry(dense)


def test_a_fixed_density_is_realised_and_answers(knob_run):
    out = knob_run["sparse"]
    density = _entry(out)["block_sparse_density"]
    # ceil(0.3 * causal blocks) per query block, at least the sink and the diagonal block:
    # about 0.36 over the ~19 blocks of this prompt
    assert 0.3 <= density <= 0.4, density
    assert len(out["output_ids"]) == GREEDY["max_new_tokens"] and out["text"].strip()
    assert 0.0 < _entry(knob_run["top_p"])["block_sparse_density"] < 1.0


def test_the_last_query_estimate_and_the_union_by_knob(knob_run):
    for name in ("last_queries", "both"):
        out = knob_run[name]
        assert 0.0 < _entry(out)["block_sparse_density"] < 1.0, (name, _entry(out))
        assert len(out["output_ids"]) == GREEDY["max_new_tokens"] and out["text"].strip()
    # the union keeps at least the pooled pick's blocks at the first layer; over the layers
    # the inputs differ, so only a loose comparison holds
    assert _entry(knob_run["both"])["block_sparse_density"] >= 0.9 * _entry(
        knob_run["top_p"])["block_sparse_density"]


def test_drops_and_block_sparse_attention_report_both(knob_run):
    entry = _entry(knob_run["dropped"])
    kept = entry["kept_tokens"]
    assert kept[-1] < 0.8 * kept[0], kept
    assert 0.3 <= entry["block_sparse_density"] < 0.6, entry


def test_a_follow_up_over_the_radix_cache_equals_it_uncached(knob_run):
    cached, uncached = knob_run["cached"], knob_run["uncached"]
    assert cached["meta_info"]["cached_tokens"] == 10 * BLOCK, cached["meta_info"]
    assert uncached["meta_info"]["cached_tokens"] == 0
    assert cached["output_ids"] == uncached["output_ids"], (cached["text"], uncached["text"])


def test_a_bad_knob_is_refused_naming_it(knob_run):
    assert knob_run["bad_knob"] is not None and DENSITY in knob_run["bad_knob"], knob_run["bad_knob"]
    assert knob_run["bad_estimate"] is not None and ESTIMATE in knob_run["bad_estimate"], (
        knob_run["bad_estimate"])


def test_chunked_prefill_by_flag(chunked_run):
    # the flag's last-query estimate (each chunk's last queries), and the pooled one by knob
    for out in (chunked_run["out"], chunked_run["pooled"]):
        assert out["meta_info"]["prompt_tokens"] > 1000
        assert len(out["output_ids"]) == GREEDY["max_new_tokens"] and out["text"].strip()
        # the chunks' queries read their prefix's blocks: the density over every chunk is the
        # whole prompt's, give or take the partial query blocks at chunk starts
        assert 0.3 <= _entry(out)["block_sparse_density"] <= 0.45, _entry(out)


def test_no_kv_slot_leaks(knob_run, chunked_run):
    _assert_no_leak(knob_run["pool"])
    _assert_no_leak(chunked_run["pool"])
