"""The staged KV layout (stage_pools.py) on the real SmolLM2 and SGLang's CPU engine.

The same workload runs on the shared layout (every layer a slot per token) and on the staged
layout with a stage pool too small for the concurrent requests' prompts (the scheduler must
wait and evict, never crash): radix cache on, chunked prefill at 512 with parking, a cached
document asked twice, six long requests at once, an abort mid-prefill. Outputs must be
identical, the pools sound at every idle point (`kv_pool_problems`) and back to their full
size after a flush; the host KV lengths are checked against the device at every step.
"""

from __future__ import annotations

import asyncio
import math
import os
import random

import pytest

from uniprefill_sglang.tools.cpu_engine import flush_cache, idle_state

pytestmark = pytest.mark.engine
os.environ["UNIPREFILL_CHECK_KV_LENS"] = "1"

CONTEXT = 3072
# One drop at layer 8 whatever the shipped profile says: the pools' split (9 layers, then 21)
# and the admission pressure below are sized for it.
COMMON = dict(enable_uniprefill=True, uniprefill_drop_layers="8", uniprefill_keep_ratio="0.5",
              chunked_prefill_size=512, max_prefill_tokens=512, context_length=CONTEXT)
# Of the full pool: a stage pool that holds one prompt in prefill plus one that has dropped, so
# the second prompt waits for the first one's drops (not its end) and the third waits again.
STAGE_FRACTION = 0.12
GREEDY = {"temperature": 0.0, "max_new_tokens": 8}
LINGER = {"temperature": 0.0, "max_new_tokens": 32}


def _ids(rng, n):
    return [rng.randrange(100, 40000) for _ in range(n)]


def _abort_mid_prefill(engine, ids, rid):
    async def run():
        task = asyncio.ensure_future(engine.async_generate(input_ids=ids, sampling_params=GREEDY,
                                                           rid=rid))
        await asyncio.sleep(0.5)  # a chunk or two in (a 2900-token prompt takes ~3 s here)
        engine.tokenizer_manager.abort_request(rid=rid)
        return await task

    return asyncio.get_event_loop().run_until_complete(run())


def _workload(engine):
    rng = random.Random(17)
    doc = _ids(rng, 2000)
    run = {"follow": [engine.generate(input_ids=doc + _ids(rng, 150), sampling_params=GREEDY)
                      ["output_ids"] for _ in range(2)]}
    run["idle_after_follow"] = idle_state(engine)
    batch = [_ids(rng, rng.randint(1900, 2300)) for _ in range(6)]
    run["batch_tokens"] = sum(len(ids) for ids in batch)
    run["batch"] = [out["output_ids"] for out in engine.generate(input_ids=batch,
                                                                  sampling_params=LINGER)]
    run["idle_after_batch"] = idle_state(engine)
    run["aborted"] = _abort_mid_prefill(engine, _ids(rng, 2900), "staged-abort")
    run["idle_after_abort"] = idle_state(engine)
    run["after_abort"] = engine.generate(input_ids=batch[0], sampling_params=LINGER)["output_ids"]
    flush_cache(engine)
    run["flushed"] = idle_state(engine)
    return run


@pytest.fixture(scope="module")
def runs(smollm2_path):
    from uniprefill_sglang.tools.cpu_engine import make_cpu_engine

    out = {}
    for layout, extra in (("shared", {}),
                          ("staged", {"uniprefill_stage_kv_fraction": str(STAGE_FRACTION)})):
        engine = make_cpu_engine(smollm2_path, uniprefill_kv_layout=layout, **COMMON, **extra)
        try:
            out[layout] = _workload(engine)
        finally:
            engine.shutdown()
    return out


def test_staged_layout_answers_exactly_as_the_shared_one(runs):
    for key in ("follow", "batch", "after_abort"):
        assert runs["staged"][key] == runs["shared"][key], key


def test_stage_pool_too_small_for_the_batch_makes_requests_wait(runs):
    pools = runs["staged"]["flushed"]["kv_pools"]
    assert runs["staged"]["flushed"]["kv_layout"] == "staged"
    assert [p["layers"] for p in pools] == [9, 21]
    assert pools[1]["size"] == max(math.ceil(pools[0]["size"] * STAGE_FRACTION), CONTEXT + 1)
    assert pools[1]["size"] < runs["staged"]["batch_tokens"] / 3  # not 2 of the 6 prompts
    # SGLang stops admitting after a failure until a request leaves; a drop's room re-opens it.
    assert runs["staged"]["idle_after_batch"]["admission_retries"] > 0
    assert pools[1]["bytes_per_slot"] == pools[0]["bytes_per_slot"] // 9 * 21
    assert runs["staged"]["aborted"]["meta_info"]["finish_reason"]["type"] == "abort"


@pytest.mark.parametrize("point", ["idle_after_follow", "idle_after_batch", "idle_after_abort",
                                   "flushed"])
def test_every_pool_is_sound_when_idle_and_whole_after_a_flush(runs, point):
    state = runs["staged"][point]
    assert state["kv_pool_problems"] == []
    assert state["available_kv_tokens"] + state["evictable_kv_tokens"] == \
        state["max_total_num_tokens"]
    if point == "flushed":
        assert all(p["free"] == p["size"] for p in state["kv_pools"])
    else:  # cached tokens hold stage slots only where they survived
        full, stage = state["kv_pools"]
        cached = state["evictable_kv_tokens"]
        assert full["size"] - full["free"] == cached
        assert stage["size"] - stage["free"] <= cached
        if point != "idle_after_abort":  # (the aborted prompt may have evicted everything)
            assert 0 < stage["size"] - stage["free"] < cached


def test_a_fault_after_some_drops_reruns_dense_with_every_stage_slot_back(smollm2_path,
                                                                          monkeypatch):
    """The last of three drop layers raises after the first two gave dropped tokens' stage
    slots back: the forward runs again dense, so every token needs its slots again."""
    from uniprefill_sglang.tools.cpu_engine import make_cpu_engine

    monkeypatch.setenv("UNIPREFILL_TEST_FAULT", "last_drop")
    rng = random.Random(5)
    prompts = [_ids(rng, 1200), _ids(rng, 1500)]
    engine = make_cpu_engine(smollm2_path, **{**COMMON, "uniprefill_drop_layers": "4,12,20"},
                             uniprefill_stage_kv_fraction="0.6,0.4")
    try:
        faulted = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        state = idle_state(engine)
        assert engine.flush_cache().success
        dense = [engine.generate(input_ids=p, sampling_params={
            **GREEDY, "custom_params": {"uniprefill": False}}) for p in prompts]
    finally:
        engine.shutdown()
    assert [o["output_ids"] for o in faulted] == [o["output_ids"] for o in dense]
    for out in faulted:
        assert any("UniPrefill error, re-prefilled dense" in (e.get("reason") or "")
                   for e in out["meta_info"]["uniprefill"]), out["meta_info"]["uniprefill"]
        # Re-prefilled from the first token: the device slot map lacks no token in any stage.
        assert out["meta_info"]["uniprefill"][-1]["kv_missing"] == [0, 0, 0]
    assert state["kv_pool_problems"] == []
    assert [p["layers"] for p in state["kv_pools"]] == [5, 8, 8, 9]
