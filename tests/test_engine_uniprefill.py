"""UniPrefill inside SGLang's real CPU engine, on the real SmolLM2-135M-Instruct.

The CPU engine needs a test-only `sgl_kernel` stand-in (tests/stubs, see its docstring): PyPI has
no CPU build of sgl-kernel. Everything else (scheduler, radix cache, chunked prefill, mixed
batches, torch_native attention, the model) is stock SGLang 0.5.17 with the plugin loaded
through its entry point.

`Engine.shutdown()` kills every child process of this process, so engines never overlap: each
`*_run` fixture starts one engine, runs everything the tests need from that configuration,
shuts it down and returns the outputs; the tests compare them.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import time

import pytest

from uniprefill_sglang.tools.cpu_engine import flush_cache, make_cpu_engine

pytestmark = pytest.mark.engine

GREEDY = {"temperature": 0.0, "max_new_tokens": 16}
DECODE_48 = {"temperature": 0.0, "max_new_tokens": 64, "ignore_eos": True}
META = "uniprefill"
SINKS_PLUS_WINDOW = 128 + 128
# Engines started by this module report a fingerprint of each request's kept positions per
# stage (meta_info["uniprefill"][i]["kept_digest"]), so kept tokens compare position for
# position, not only in number.
os.environ["UNIPREFILL_REPORT_KEPT"] = "1"
# ... and check at every drop and decode step that the per-stage KV lengths kept on the host
# (what FlashInfer plans with, without a device sync) equal what the slots say on the device.
os.environ["UNIPREFILL_CHECK_KV_LENS"] = "1"


def _story(seed: int, n_sentences: int) -> str:
    rng = random.Random(seed)
    names = ["Ada", "Bruno", "Chen", "Dana", "Emil", "Farah", "Goran", "Hana"]
    places = ["the harbour", "the library", "a small farm", "the old mill", "the station"]
    things = ["a red kite", "a brass key", "seven apples", "a blue notebook", "a lantern"]
    return " ".join(
        f"{rng.choice(names)} walked to {rng.choice(places)} and found {rng.choice(things)}."
        for _ in range(n_sentences)
    )


def _prompt(seed: int, n_sentences: int, question: str) -> str:
    return (
        f"Read the story and answer the question.\n\n{_story(seed, n_sentences)}\n\n"
        f"The secret word is 'marmalade'. {_story(seed + 1, n_sentences // 4)}\n\n"
        f"Question: {question}\nAnswer:"
    )


LONG_PROMPTS = [  # about 1.2K and 1.6K tokens
    _prompt(1, 80, "What is the secret word?"),
    _prompt(2, 110, "Who walked to the harbour first?"),
]
SHORT_PROMPT = "The capital of France is"
# Shares no first token with LONG_PROMPTS[0], so serving both at once reuses no cached prefix.
OTHER_PROMPT = "Harbour log.\n" + LONG_PROMPTS[1]
PREFIX_DOC = _prompt(7, 90, "")
PREFIX_QUESTIONS = [" What is the secret word?", " Who found a lantern?"]


def _kept(out) -> list:
    """Kept tokens per stage of the request's (last) prefill forward.

    With mixed batches SGLang also reports the forwards in which the request was a decode row
    beside someone else's prefill; those are skipped.
    """
    entries = [e for e in out["meta_info"].get(META, []) if e["reason"] != "decode"]
    assert entries, f"no {META!r} prefill entry in meta_info: {out['meta_info']}"
    return entries[-1]["kept_tokens"]


def _kept_positions(out) -> list:
    """Per drop, the fingerprint of the positions the request kept (UNIPREFILL_REPORT_KEPT)."""
    entries = [e for e in out["meta_info"].get(META, []) if e["reason"] != "decode"]
    digest = entries[-1].get("kept_digest")
    assert digest, entries[-1]
    return digest


def _pool_state(engine, timeout_s: float = 30.0) -> dict:
    """The KV pool accounting once the scheduler is idle (it finishes a request after replying)."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = engine.get_server_info()["internal_states"][0][META]
        if state["idle"] or time.monotonic() > deadline:
            return state
        time.sleep(0.2)


def _assert_no_leak(state) -> None:
    assert state["idle"], state
    assert state["protected_kv_tokens"] == 0, state
    assert state["available_kv_tokens"] + state["evictable_kv_tokens"] == state[
        "max_total_num_tokens"
    ], state
    assert state["free_req_slots"] == state["req_slots"], state
    assert state["parked_requests"] == 0, state


def _prefix_sequence(engine):
    return [engine.generate(PREFIX_DOC + q, GREEDY) for q in PREFIX_QUESTIONS]


def _run_together(engine, first_prompt, first_params, second_prompt, second_params):
    """Start the first request, wait for its first streamed token, then send the second."""

    async def both():
        stream = await engine.async_generate(first_prompt, first_params, stream=True)
        last = await stream.__anext__()
        second = asyncio.ensure_future(engine.async_generate(second_prompt, second_params))
        async for chunk in stream:
            last = chunk
        return last, await second

    return asyncio.get_event_loop().run_until_complete(both())


@pytest.fixture(scope="module")
def dense_run(smollm2_path):
    engine = make_cpu_engine(smollm2_path)
    try:
        return {
            "long": [engine.generate(p, GREEDY) for p in LONG_PROMPTS],
            "short": engine.generate(SHORT_PROMPT, DECODE_48),
        }
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def up_run(smollm2_path, dense_run):
    engine = make_cpu_engine(smollm2_path, enable_uniprefill=True, enable_mixed_chunk=True)
    try:
        def fresh(prompt, params):  # no radix hit from an earlier request of this fixture
            flush_cache(engine)
            return engine.generate(prompt, params)

        run = {
            "drop_layers": _pool_state(engine)["drop_layers"],
            "p1": [fresh(p, dict(GREEDY, custom_params={"uniprefill_top_p": 1.0}))
                   for p in LONG_PROMPTS],
            "p099": [fresh(p, GREEDY) for p in LONG_PROMPTS],
            "ratio": fresh(LONG_PROMPTS[0],
                           dict(GREEDY, custom_params={"uniprefill_keep_ratio": 0.5})),
            "off": fresh(LONG_PROMPTS[0], dict(GREEDY, custom_params={"uniprefill": False})),
            "short": fresh(SHORT_PROMPT, DECODE_48),
        }
        flush_cache(engine)
        run["prefix"] = _prefix_sequence(engine)
        run["pool"] = _pool_state(engine)
        return run
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def fresh_prefix_run(smollm2_path, up_run):
    engine = make_cpu_engine(smollm2_path, enable_uniprefill=True, enable_mixed_chunk=True)
    try:
        return {"prefix": _prefix_sequence(engine), "pool": _pool_state(engine)}
    finally:
        engine.shutdown()


def test_top_p_one_is_token_identical_to_dense(up_run, dense_run):
    for out, dense in zip(up_run["p1"], dense_run["long"]):
        assert out["output_ids"] == dense["output_ids"], (out["text"], dense["text"])
        kept = _kept(out)
        assert all(k == kept[0] for k in kept), kept  # p = 1 keeps every block


def test_top_p_drops_and_reports_kept_tokens_per_stage(up_run):
    for out in up_run["p099"]:
        kept = _kept(out)
        assert out["meta_info"]["cached_tokens"] == 0
        assert kept[0] == out["meta_info"]["prompt_tokens"]
        assert len(kept) == len(up_run["drop_layers"]) + 1
        assert all(a >= b for a, b in zip(kept, kept[1:])), kept  # drops are cumulative
        assert kept[-1] < kept[0], f"p=0.99 dropped nothing: {kept}"
        assert kept[-1] >= SINKS_PLUS_WINDOW  # sinks and the last queries always survive
        assert len(out["output_ids"]) == GREEDY["max_new_tokens"]


def test_keep_ratio_per_request(up_run):
    kept = _kept(up_run["ratio"])
    blocks = -(-kept[0] // 64)
    # Stage 1 keeps ceil(0.5 * blocks) blocks plus sinks and the last window.
    assert kept[1] <= (-(-blocks // 2)) * 64 + SINKS_PLUS_WINDOW, kept
    assert kept[1] < 0.75 * kept[0], kept


def test_per_request_disable_and_short_prompts_run_dense(up_run, dense_run):
    off = up_run["off"]["meta_info"][META][0]
    assert off["enabled"] is False and off["reason"] == "disabled by the request"
    assert up_run["off"]["output_ids"] == dense_run["long"][0]["output_ids"]
    short = up_run["short"]["meta_info"][META][0]
    assert short["enabled"] is False and "minimum length" in short["reason"]
    assert up_run["short"]["output_ids"] == dense_run["short"]["output_ids"]


def test_prefix_reuse_matches_a_fresh_engine(up_run, fresh_prefix_run):
    first, second = up_run["prefix"]
    assert second["meta_info"]["cached_tokens"] > 1000, second["meta_info"]
    assert _kept(second)[0] == second["meta_info"]["prompt_tokens"] - second["meta_info"][
        "cached_tokens"]
    f_first, f_second = fresh_prefix_run["prefix"]
    assert f_first["output_ids"] == first["output_ids"]
    assert f_second["output_ids"] == second["output_ids"]
    assert f_second["meta_info"]["cached_tokens"] == second["meta_info"]["cached_tokens"]
    assert _kept(f_first) == _kept(first) and _kept(f_second) == _kept(second)


def test_no_kv_slot_leaks(up_run, fresh_prefix_run):
    _assert_no_leak(up_run["pool"])
    _assert_no_leak(fresh_prefix_run["pool"])


def test_server_counts_the_keep_ratio_it_realised(up_run):
    """The scheduler's cumulative scored/kept counters (what bench_serving_sweep reports)."""
    pool = up_run["pool"]
    dropped = [_kept(o) for o in up_run["p099"] + [up_run["ratio"]]]
    assert pool["scored_tokens"] >= sum(k[0] for k in dropped)
    assert 0 < pool["kept_tokens"] < pool["scored_tokens"]


def test_no_drop_layers_is_token_identical_to_dense(smollm2_path, dense_run, fresh_prefix_run):
    engine = make_cpu_engine(smollm2_path, enable_uniprefill=True, uniprefill_drop_layers="none")
    try:
        outs = [engine.generate(p, GREEDY) for p in LONG_PROMPTS]
    finally:
        engine.shutdown()
    for out, dense in zip(outs, dense_run["long"]):
        assert out["output_ids"] == dense["output_ids"]
        assert out["meta_info"][META][0]["reason"] == "no drop layers"


# ---- chunked prefill (issue 4): the question decides, whatever the chunk size ----------------
CHUNK = 128


def _abort_mid_prefill(engine, prompt, rid="abort-me"):
    """Send a long chunked prompt, abort it while its chunks are still being prefilled."""

    async def run():
        task = asyncio.ensure_future(engine.async_generate(prompt, GREEDY, rid=rid))
        await asyncio.sleep(1.0)
        engine.tokenizer_manager.abort_request(rid=rid)
        return await task

    return asyncio.get_event_loop().run_until_complete(run())


@pytest.fixture(scope="module")
def chunked_run(smollm2_path, fresh_prefix_run):
    engine = make_cpu_engine(smollm2_path, enable_uniprefill=True, enable_mixed_chunk=True,
                             chunked_prefill_size=CHUNK)
    try:
        run = {"alone": []}
        for prompt in LONG_PROMPTS:
            flush_cache(engine)
            run["alone"].append(engine.generate(prompt, GREEDY))
        flush_cache(engine)
        run["alone_b"] = engine.generate(OTHER_PROMPT, GREEDY)
        flush_cache(engine)
        run["together"] = engine.generate([LONG_PROMPTS[0], OTHER_PROMPT], GREEDY)
        flush_cache(engine)
        run["aborted"] = _abort_mid_prefill(engine, LONG_PROMPTS[1] + " Think twice.")
        run["pool_after_abort"] = _pool_state(engine)
        flush_cache(engine)
        run["after_abort"] = engine.generate(LONG_PROMPTS[0], GREEDY)
        run["pool"] = _pool_state(engine)
        flush_cache(engine)
        run["logprobs"] = engine.generate(LONG_PROMPTS[0], GREEDY, return_logprob=True,
                                          logprob_start_len=0)
        flush_cache(engine)
        run["output_logprobs"] = engine.generate(LONG_PROMPTS[0], GREEDY, return_logprob=True,
                                                 top_logprobs_num=2)
        flush_cache(engine)
        mixed_before = _pool_state(engine)["mixed_forwards"]
        run["mixed_short"], run["mixed_long"] = _run_together(
            engine, SHORT_PROMPT, DECODE_48, LONG_PROMPTS[1], GREEDY)
        run["mixed_forwards"] = _pool_state(engine)["mixed_forwards"] - mixed_before
        return run
    finally:
        engine.shutdown()


def test_chunked_prefill_keeps_what_unchunked_keeps(chunked_run, up_run):
    for chunked, whole in zip(chunked_run["alone"], up_run["p099"]):
        assert chunked["meta_info"]["prompt_tokens"] > 8 * CHUNK
        assert _kept(chunked) == _kept(whole)
        assert _kept_positions(chunked) == _kept_positions(whole)
        assert chunked["output_ids"] == whole["output_ids"]


def test_two_chunked_requests_in_flight_do_not_disturb_each_other(chunked_run):
    alones = [chunked_run["alone"][0], chunked_run["alone_b"]]
    for together, alone in zip(chunked_run["together"], alones):
        assert _kept(together) == _kept(alone)
        assert _kept_positions(together) == _kept_positions(alone)
        assert together["output_ids"] == alone["output_ids"]


def test_aborted_chunked_request_frees_every_slot(chunked_run):
    assert chunked_run["aborted"]["meta_info"]["finish_reason"]["type"] == "abort"
    _assert_no_leak(chunked_run["pool_after_abort"])
    _assert_no_leak(chunked_run["pool"])
    assert chunked_run["after_abort"]["output_ids"] == chunked_run["alone"][0]["output_ids"]


def test_mixed_prefill_decode_batch_matches_each_alone(chunked_run, dense_run):
    # The long prompt's chunks were prefilled in mixed batches beside the short request's decode.
    assert chunked_run["mixed_forwards"] > 0
    assert chunked_run["mixed_short"]["output_ids"] == dense_run["short"]["output_ids"]
    assert _kept(chunked_run["mixed_long"]) == _kept(chunked_run["alone"][1])
    assert chunked_run["mixed_long"]["output_ids"] == chunked_run["alone"][1]["output_ids"]


def test_input_logprobs_fall_back_to_dense(chunked_run):
    out = chunked_run["logprobs"]
    reasons = {e["reason"] for e in out["meta_info"][META]}
    assert reasons == {"input logprobs requested in the batch"}, reasons
    assert len(out["meta_info"]["input_token_logprobs"]) == out["meta_info"]["prompt_tokens"]


def test_output_logprobs_keep_uniprefill(chunked_run):
    # Logprobs of the generated tokens only (OpenAI's `logprobs`) come from the last row, which
    # the drop keeps: the same selection and tokens as without them, and a greedy token is its
    # step's most likely one.
    out, plain = chunked_run["output_logprobs"], chunked_run["alone"][0]
    assert _kept(out) == _kept(plain) and _kept_positions(out) == _kept_positions(plain)
    assert out["meta_info"][META][-1]["enabled"], out["meta_info"][META][-1]
    assert out["output_ids"] == plain["output_ids"]
    meta = out["meta_info"]
    assert not meta.get("input_token_logprobs")
    lps = meta["output_token_logprobs"]
    assert [tok for _, tok, _ in lps] == out["output_ids"]
    for (lp, tok, _), top in zip(lps, meta["output_top_logprobs"]):
        assert math.isfinite(lp) and lp <= 0.0
        assert top[0][1] == tok and top[0][0] == pytest.approx(lp, abs=1e-5)
        assert top[0][0] >= top[1][0]


# ---- the parking budget: past it, the documented fallback -------------------------------------
PARK_BUDGET = 512


@pytest.fixture(scope="module")
def over_budget_run(smollm2_path):
    engine = make_cpu_engine(smollm2_path, enable_uniprefill=True, chunked_prefill_size=CHUNK,
                             uniprefill_max_parked_tokens=PARK_BUDGET)
    try:
        out = engine.generate(LONG_PROMPTS[0], GREEDY)
        return {"out": out, "pool": _pool_state(engine)}
    finally:
        engine.shutdown()


def test_prompt_over_the_parking_budget_falls_back_to_its_final_chunk(over_budget_run):
    """--uniprefill-max-parked-tokens bounds the parked state: a longer prompt parks nothing,
    its earlier chunks run dense and only its final chunk's tokens are candidates (within the
    budget every prompt token is: test_chunked_prefill_keeps_what_unchunked_keeps)."""
    out = over_budget_run["out"]
    prompt_tokens = out["meta_info"]["prompt_tokens"]
    assert prompt_tokens > PARK_BUDGET + CHUNK
    assert _kept(out)[0] <= CHUNK < prompt_tokens
    final_chunk = [e for e in out["meta_info"][META] if e["reason"] != "decode"][-1]
    # Its 40 tokens are too few to score (the cost rule counts the step's own tokens and its
    # earlier chunks, which ran dense and are cached): dense, saying why its chunks did not park
    # (on the final chunk, not on the chunk before it, also too short to drop).
    assert "max-parked-tokens" in final_chunk["reason"], final_chunk
    assert len(out["output_ids"]) > 0
    state = over_budget_run["pool"]
    assert state["parked_requests"] == 0
    _assert_no_leak(state)
