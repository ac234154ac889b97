"""What the hybrid-model GPU tests share (test_qwen3_next_gpu.py, test_lfm2_gpu.py): the engines
(FlashInfer and Triton, one prompt per step and chunked at 512), the workload and the checks. A
model's module defines its config, its engine arguments and a `results` fixture, and imports
the tests below (pytest collects them there).

On both backends, in bfloat16, with decode CUDA graphs:

* top-p 1.0 is token-identical to dense in the same engine (nothing is dropped);
* a forced keep gives the same kept counts and greedy tokens batched with another prompt, and
  under chunked prefill (the earlier chunks park at the first drop and rejoin at the final
  chunk's) as unchunked, as far as dense itself answers the same chunked and unchunked, each
  backend compared with itself (bfloat16 rounding differs between attention kernels and
  between chunkings);
* nothing is left parked and no slot leaks.
"""

from __future__ import annotations

import pytest
from engine_harness import (check_chunked_as_whole, check_forced_keep, check_nothing_left,
                            check_top_p_one_as_dense, forced_keep_workload, random_prompts)

VOCAB_SIZE = 512
ENGINES = {
    "fi_whole": dict(attention_backend="flashinfer", chunked_prefill_size=8192),
    "fi_chunked": dict(attention_backend="flashinfer", chunked_prefill_size=512),
    "tr_whole": dict(attention_backend="triton", chunked_prefill_size=8192),
    "tr_chunked": dict(attention_backend="triton", chunked_prefill_size=512),
}
PAIRS = [("fi_whole", "fi_chunked"), ("tr_whole", "tr_chunked")]
TIMEOUT_S = 360

PROMPT, OTHER = random_prompts(VOCAB_SIZE)


def engine_kwargs(drop_layers: str, **model_specific) -> dict:
    """The engines' common arguments: UniPrefill on every prompt with a 16-token block and
    query window, radix cache off (both families keep a recurrent state per request)."""
    return dict(
        skip_tokenizer_init=True, enable_uniprefill=True, uniprefill_min_prompt_tokens=0,
        uniprefill_drop_layers=drop_layers, uniprefill_block_size=16, uniprefill_sink_tokens=16,
        uniprefill_last_queries=16, disable_radix_cache=True, disable_prefill_cuda_graph=True,
        dtype="bfloat16", context_length=8192, max_running_requests=8, max_total_tokens=32768,
        random_seed=0, log_level="info", **model_specific)


def run_workload(engine) -> dict:
    return forced_keep_workload(engine, PROMPT, OTHER)



@pytest.mark.parametrize("name", list(ENGINES))
def test_top_p_one_is_token_identical_to_dense(results, name):
    check_top_p_one_as_dense(results[name], len(PROMPT), 3)


@pytest.mark.parametrize("name", list(ENGINES))
def test_forced_keep_drops_and_batches_alike(results, name):
    res = results[name]
    print(f"{name}: forced {res['forced']['output_ids']}, dense {res['dense']['output_ids']}")
    check_forced_keep(res, len(PROMPT), 0.25)


@pytest.mark.parametrize("pair", PAIRS, ids=[p[1] for p in PAIRS])
def test_forced_keep_answers_the_same_chunked(results, pair):
    check_chunked_as_whole(*(results[n] for n in pair))


@pytest.mark.parametrize("name", list(ENGINES))
def test_no_parked_state_or_slot_left(results, name):
    check_nothing_left(results[name]["state"])


@pytest.mark.parametrize("pair", PAIRS, ids=[p[1] for p in PAIRS])
def test_linear_mixers_rejoin_in_pieces(results, pair):
    # Chunked at 512, the final chunk's rejoining rows (the whole prompt at top-p 1.0) pass the
    # linear layers in pieces of the chunk size; unchunked, one piece of at most 8192 rows.
    whole, chunked = (results[n]["state"] for n in pair)
    assert chunked["pieced_mixer_calls"] > 0, chunked
    assert whole["pieced_mixer_calls"] == 0, whole
    # Each rejoin measured its device-memory peak (parking.RejoinCost's count is checked
    # against such peaks at scale, benchmarks/results/qwen3_next/README.md; a few hundred rows
    # here are dominated by one piece's activations, which the per-row count leaves to
    # SGLang's own reserve).
    rejoin = chunked["last_rejoin"]
    assert rejoin and rejoin["rows"] > 0 and rejoin["peak_bytes"] > 0, rejoin
