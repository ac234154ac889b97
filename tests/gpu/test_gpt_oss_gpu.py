"""gpt-oss on the GPU: sliding-window layers with learned sinks after a drop, on fa3 (SGLang's
pick on Hopper, given no backend flag) and on Triton.

Skipped without CUDA. Run in a pytest process of its own:

    pytest tests/gpu/test_gpt_oss_gpu.py -x -q

The model is tests/test_gpt_oss.py's reduced gpt-oss widened to GPU head sizes (4 layers,
sliding-window (16) and full attention alternating, learned sinks, 4 experts, top-2, seeded
random weights), stored and run in bfloat16 (SGLang's gpt-oss builds its projections in the
checkpoint's dtype). UniPrefill drops at the full-attention layer 1: the
sliding-window layer 2 runs `kernels.positional_attention` over the survivors in original
positions with the sinks, the full-attention layer 3 the backend's kernel over the stage view
(FA3 through its page table, with the sinks), decode on Triton through CUDA graphs (SGLang
serves gpt-oss on neither FlashInfer nor torch_native). Per engine, whole and chunked at 512:

* top-p 1.0 is token-identical to dense in the same engine;
* a forced keep drops (no fallback reason) and answers the same batched with another prompt,
  up to the near ties its MoE layers' batch-dependent rounding may flip
  (`first_unexplained_difference`, as for DeepSeek);
* chunked keeps the same counts as whole and answers alike as far as dense does (the same
  allowance);
* nothing is left parked and no slot leaks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_harness import (check_chunked_as_whole, check_forced_keep,  # noqa: E402
                            check_nothing_left, check_top_p_one_as_dense,
                            forced_keep_workload, random_model_results, random_prompts,
                            serve_and_record)
from test_gpt_oss import CONFIG as CPU_CONFIG  # noqa: E402

CONFIG = dict(CPU_CONFIG, hidden_size=256, intermediate_size=256, head_dim=64,
              max_position_embeddings=8192)
ENGINE_KWARGS = dict(
    skip_tokenizer_init=True, enable_uniprefill=True, uniprefill_min_prompt_tokens=0,
    uniprefill_drop_layers="1", uniprefill_block_size=16, uniprefill_sink_tokens=16,
    uniprefill_last_queries=16, disable_radix_cache=True, dtype="bfloat16", context_length=8192,
    max_running_requests=8, max_total_tokens=32768, mem_fraction_static=0.3, random_seed=0,
    log_level="info")
ENGINES = {
    "pick_whole": dict(chunked_prefill_size=8192),  # no backend flag: fa3 on Hopper
    "pick_chunked": dict(chunked_prefill_size=512),
    "tr_whole": dict(attention_backend="triton", chunked_prefill_size=8192),
    "tr_chunked": dict(attention_backend="triton", chunked_prefill_size=512),
}
PAIRS = [("pick_whole", "pick_chunked"), ("tr_whole", "tr_chunked")]
PROMPT, OTHER = random_prompts(CONFIG["vocab_size"])


@pytest.fixture(scope="module")
def results():
    yield from random_model_results(__file__, CONFIG, ENGINES, 420, "gpt_oss_engine_",
                                    dtype=ENGINE_KWARGS["dtype"])



@pytest.mark.parametrize("name", list(ENGINES))
def test_top_p_one_is_token_identical_to_dense(results, name):
    check_top_p_one_as_dense(results[name], len(PROMPT), 2)


@pytest.mark.parametrize("name", list(ENGINES))
def test_forced_keep_drops_and_batches_alike(results, name):
    check_forced_keep(results[name], len(PROMPT), 0.5, no_reason=True,
                      batch_rounding_block=ENGINE_KWARGS["uniprefill_block_size"])


@pytest.mark.parametrize("pair", PAIRS, ids=[p[1] for p in PAIRS])
def test_chunked_keeps_and_answers_as_whole(results, pair):
    check_chunked_as_whole(*(results[n] for n in pair),
                           batch_rounding_block=ENGINE_KWARGS["uniprefill_block_size"])


@pytest.mark.parametrize("name", list(ENGINES))
def test_no_parked_state_or_slot_left(results, name):
    check_nothing_left(results[name]["state"])


if __name__ == "__main__":
    name, model_dir, out_path = sys.argv[1:4]
    serve_and_record(name, ENGINES, ENGINE_KWARGS, model_dir, out_path,
                     lambda engine: forced_keep_workload(engine, PROMPT, OTHER, top2=True), 37000)
