"""The workloads of the reduced random-weight models (the hybrids Qwen3-Next and LFM2, the
mixtures of experts).

* `run_hybrid_workload` (CPU engine): one prompt dense (UniPrefill off per request), at top-p
  1.0 and at a forced keep; another prompt at the forced keep; both batched; then, on an engine
  chunking at 128 tokens, the first prompt at the forced keep, at top-p 1.0 and dense (the last
  two with log-probabilities). Each engine's idle state is recorded after its requests. With the
  radix cache on, each request finds it empty, and the idle state is the flushed cache's.
* `block_sparse_requests` / `assert_block_sparse_over_full_attention` (CPU engine): block-sparse
  attention at the full-attention layers of a model whose other layers have none, at density
  1.0 (every causal block: dense's answer) and at 0.3 over a forced keep.
* `prefix_cache_workload` (CPU engine and GPU, the radix cache on): a cached document and a
  second conversation turn, asked dense and with UniPrefill over the same cached prefix
  (test_hybrid_prefix_cache.py says what each record is for).
"""

from __future__ import annotations

import random

import torch

from uniprefill_sglang.tools.cpu_engine import flush_cache, idle_state


def random_prompts(vocab_size: int, lengths=(300, 220)) -> list:
    """Seeded random token ids, one prompt per length (seeds 1, 2, ...)."""
    rngs = [random.Random(seed) for seed in range(1, len(lengths) + 1)]
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for rng, n in zip(rngs, lengths)]


def run_hybrid_workload(make_engine, prompt: list, other: list, greedy: dict,
                        forced: dict, more=None) -> dict:
    """`make_engine(chunked_prefill_size=...)` starts an engine of the model under test;
    `more(engine)`, if given, returns more records from the first engine, asked after the rest
    and before its idle state."""
    out = {}
    engine = make_engine(chunked_prefill_size=4096)
    try:
        out["server"] = engine.get_server_info()
        ask = _on_an_empty_cache(engine, out["server"])
        out["dense"] = ask(input_ids=prompt, sampling_params=dict(
            greedy, custom_params={"uniprefill": False}))
        out["full"] = ask(input_ids=prompt, sampling_params=dict(
            greedy, custom_params={"uniprefill_top_p": 1.0}))
        out["forced"] = ask(input_ids=prompt, sampling_params=forced)
        out["other"] = ask(input_ids=other, sampling_params=forced)
        out["batch"] = ask(input_ids=[prompt, other], sampling_params=forced)
        if more is not None:
            out.update(more(engine))
        out["state"] = _flushed_idle_state(engine, out["server"])
    finally:
        engine.shutdown()
    engine = make_engine(chunked_prefill_size=128)  # several chunks for prompts of 200+ tokens
    try:
        server = engine.get_server_info()
        ask = _on_an_empty_cache(engine, server)
        out["chunked"] = ask(input_ids=prompt, sampling_params=forced)
        out["chunked_full"] = ask(input_ids=prompt, sampling_params=dict(
            greedy, custom_params={"uniprefill_top_p": 1.0}), return_logprob=True)
        out["chunked_dense"] = ask(input_ids=prompt, sampling_params=dict(
            greedy, custom_params={"uniprefill": False}), return_logprob=True)
        out["chunked_state"] = _flushed_idle_state(engine, server)
    finally:
        engine.shutdown()
    return out


def _on_an_empty_cache(engine, server_info: dict):
    """engine.generate, the radix cache (if on) flushed before each request."""
    if server_info["disable_radix_cache"]:
        return engine.generate

    def ask(**kwargs):
        flush_cache(engine)
        return engine.generate(**kwargs)

    return ask


def _flushed_idle_state(engine, server_info: dict) -> dict:
    if not server_info["disable_radix_cache"]:
        flush_cache(engine)
    return idle_state(engine)


def assert_nothing_left(runs: dict) -> None:
    """Both engines idle with no parked request, request slot, private prefix slot or KV slot
    held."""
    for key in ("state", "chunked_state"):
        state = runs[key]
        assert state["parked_requests"] == 0 and state["private_prefix_slots"] == 0
        assert state["free_req_slots"] == state["req_slots"]
        assert state["available_kv_tokens"] == state["max_total_num_tokens"]


# The engine flags under which a reduced model's prompts (200-300 tokens) attend block-sparse.
BLOCK_SPARSE_ENGINE = dict(uniprefill_block_sparse_block_size=16,
                           uniprefill_block_sparse_min_tokens=16)


def block_sparse_requests(engine, prompt: list, greedy: dict, forced: dict) -> dict:
    """`prompt` asking for block-sparse attention at density 1.0 with top-p 1.0, and at density
    0.3 over the `forced` keep (an engine started with BLOCK_SPARSE_ENGINE)."""
    density = "uniprefill_block_sparse_density"
    return {
        "block_sparse_all": engine.generate(input_ids=prompt, sampling_params=dict(
            greedy, custom_params={"uniprefill_top_p": 1.0, density: 1.0})),
        "block_sparse": engine.generate(input_ids=prompt, sampling_params=dict(
            forced, custom_params={**forced["custom_params"], density: 0.3}))}


def assert_block_sparse_over_full_attention(runs: dict) -> None:
    """Every causal block answers as dense; density 0.3 is realised over the forced keep, which
    it leaves as it was, and answers."""
    meta = runs["block_sparse_all"]["meta_info"]["uniprefill"][-1]
    assert meta["block_sparse_density"] == 1.0 and meta["reason"] is None, meta
    assert runs["block_sparse_all"]["output_ids"] == runs["dense"]["output_ids"]
    meta = runs["block_sparse"]["meta_info"]["uniprefill"][-1]
    assert 0.3 <= meta["block_sparse_density"] < 0.7 and meta["reason"] is None, meta
    assert meta["kept_tokens"] == runs["forced"]["meta_info"]["uniprefill"][-1]["kept_tokens"]
    assert len(runs["block_sparse"]["output_ids"]) == len(runs["forced"]["output_ids"])


def prefix_cache_workload(engine, doc: list, question: list, second: list, greedy: dict,
                          forced: dict) -> dict:
    """Records (JSON-serialisable) of `engine`'s answers with and without its radix cache:

    * `doc_follow` / `doc_dense_cached`: `doc` cached by a request generating nothing, then
      `doc + question` at top-p 1.0 / dense over it; `doc_dense`: dense with the cache empty;
    * for `full` (top-p 1.0) and `forced`: the first turn `doc`, the second turn (the first's
      prompt and answer, then `second`) over the first's cache, the same again over its own
      cache (`again`), and dense with the cache empty (`turn2_dense`);
    * `full_turn2_dense_cached`: the second turn dense over the first turn's cache at top-p 1.0;
    * `state`: the idle state after a flush."""
    full = dict(greedy, custom_params={"uniprefill_top_p": 1.0})
    dense = dict(greedy, custom_params={"uniprefill": False})

    def ask(ids, params) -> dict:
        out = engine.generate(input_ids=ids, sampling_params=params)
        return {"output_ids": out["output_ids"], "meta_info": {
            "cached_tokens": out["meta_info"]["cached_tokens"],
            "uniprefill": out["meta_info"]["uniprefill"]}}

    def cache_then_ask(cached: list, ids: list, params: dict, first_params=None) -> dict:
        flush_cache(engine)
        ask(cached, first_params or dict(greedy, max_new_tokens=0))
        return ask(ids, params)

    info = engine.get_server_info()
    out = {"server": {k: info.get(k) for k in ("disable_radix_cache",
                                                 "mamba_radix_cache_strategy")}}
    out["doc_follow"] = cache_then_ask(doc, doc + question, full)
    out["doc_dense_cached"] = cache_then_ask(doc, doc + question, dense)
    flush_cache(engine)
    out["doc_dense"] = ask(doc + question, dense)
    turns = {}
    for name, params in (("full", full), ("forced", forced)):
        flush_cache(engine)
        first = ask(doc, params)
        turns[name] = doc + first["output_ids"] + second
        out[f"{name}_first"], out[f"{name}_turn2"] = first, ask(turns[name], params)
        out[f"{name}_again"] = ask(turns[name], params)
        flush_cache(engine)
        out[f"{name}_turn2_dense"] = ask(turns[name], dense)
    out["full_turn2_dense_cached"] = cache_then_ask(doc, turns["full"], dense, first_params=full)
    flush_cache(engine)
    out["state"] = idle_state(engine)
    return out


def assert_mixers_ran_in_pieces(runs: dict) -> None:
    """Chunked at 128, the final chunk's step carries the parked rows too (more than 128 after
    the drop), so the linear-attention or conv layers after it run in pieces of 128 rows, each
    continuing the state the one before left (model_integration.py). Greedy tokens of a random
    model hardly move; the log-probabilities of the chosen ones show a piece that starts from an
    empty state (Qwen3-Next: 7e-3 off). Dense in the same engine chunks at the same 128-row
    boundaries, so the two differ by rounding only."""
    assert runs["chunked_state"]["pieced_mixer_calls"] > 0
    assert runs["state"]["pieced_mixer_calls"] == 0  # chunks of 4096: one piece
    top_p_1, dense = (torch.tensor([lp for lp, _, _ in runs[key]["meta_info"][
        "output_token_logprobs"]]) for key in ("chunked_full", "chunked_dense"))
    assert torch.isfinite(top_p_1).all()
    torch.testing.assert_close(top_p_1, dense, rtol=0, atol=1e-4)
