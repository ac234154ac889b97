"""The CPU-engine workload of the reduced hybrid models (Qwen3-Next, LFM2): one prompt dense
(UniPrefill off per request), at top-p 1.0 and at a forced keep; another prompt at the forced
keep; both batched; then, on an engine chunking at 128 tokens, the first prompt at the forced
keep and at top-p 1.0. Each engine's idle state is recorded after its requests."""

from __future__ import annotations

import random

from uniprefill_sglang.tools.cpu_engine import idle_state


def random_prompts(vocab_size: int, lengths=(300, 220)) -> list:
    """Seeded random token ids, one prompt per length (seeds 1, 2, ...)."""
    rngs = [random.Random(seed) for seed in range(1, len(lengths) + 1)]
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for rng, n in zip(rngs, lengths)]


def run_hybrid_workload(make_engine, prompt: list, other: list, greedy: dict,
                        forced: dict) -> dict:
    """`make_engine(chunked_prefill_size=...)` starts an engine of the model under test."""
    out = {}
    engine = make_engine(chunked_prefill_size=4096)
    try:
        out["server"] = engine.get_server_info()
        out["dense"] = engine.generate(input_ids=prompt, sampling_params=dict(
            greedy, custom_params={"uniprefill": False}))
        out["full"] = engine.generate(input_ids=prompt, sampling_params=dict(
            greedy, custom_params={"uniprefill_top_p": 1.0}))
        out["forced"] = engine.generate(input_ids=prompt, sampling_params=forced)
        out["other"] = engine.generate(input_ids=other, sampling_params=forced)
        out["batch"] = engine.generate(input_ids=[prompt, other], sampling_params=forced)
        out["state"] = idle_state(engine)
    finally:
        engine.shutdown()
    engine = make_engine(chunked_prefill_size=128)  # several chunks for prompts of 200+ tokens
    try:
        out["chunked"] = engine.generate(input_ids=prompt, sampling_params=forced)
        out["chunked_full"] = engine.generate(input_ids=prompt, sampling_params=dict(
            greedy, custom_params={"uniprefill_top_p": 1.0}))
        out["chunked_state"] = idle_state(engine)
    finally:
        engine.shutdown()
    return out


def assert_nothing_left(runs: dict) -> None:
    """Both engines idle with no parked request, request slot or KV slot held."""
    for key in ("state", "chunked_state"):
        state = runs[key]
        assert state["parked_requests"] == 0
        assert state["free_req_slots"] == state["req_slots"]
        assert state["available_kv_tokens"] == state["max_total_num_tokens"]
