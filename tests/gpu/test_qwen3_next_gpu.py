"""Qwen3-Next on the GPU: Gated DeltaNet layers after a drop, with SGLang's own GPU kernels.

Skipped without CUDA. Run in a pytest process of its own:

    pytest tests/gpu/test_qwen3_next_gpu.py -x -q

The model is tests/test_qwen3_next.py's reduced Qwen3-Next (full attention every second layer,
MoE with a shared expert, seeded random weights), at 6 layers here so that two linear layers
follow the drop at layer 1 (linear 0, full 1, linear 2, full 3, linear 4, full 5). SGLang runs
its GDN layers through its Triton (FLA) kernels and decode through CUDA graphs, in bfloat16
(SGLang's Gemma-style RMSNorm kernel has no float32 path on the GPU). On FlashInfer and Triton:

* top-p 1.0 is token-identical to dense in the same engine (nothing is dropped);
* a forced keep gives the same kept counts and greedy tokens unchunked, under chunked prefill
  (the earlier chunks park at layer 1 and rejoin at the final chunk's first drop), and batched
  with another prompt, each backend compared with itself (bfloat16 noise differs between
  attention kernels).

This random model is insensitive to what is dropped: on the H200 (2026-12-01) a keep of 18% of
the prompt gave dense's 16 greedy tokens on both backends. So the token checks here catch a
crash, a lost request or a broken batch layout, not a subtly wrong recurrent state; that is
checked exactly on the CPU in float32 (tests/test_qwen3_next.py), against torch references.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_harness import (forced_keep_workload, random_model_results,  # noqa: E402
                            random_prompts, serve_and_record)

CONFIG = dict(
    architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=512,
    hidden_size=256, intermediate_size=512, num_hidden_layers=6, full_attention_interval=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_act="silu",
    max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0,
    partial_rotary_factor=0.25, linear_conv_kernel_dim=4, linear_key_head_dim=64,
    linear_value_head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
    decoder_sparse_step=1, moe_intermediate_size=128, shared_expert_intermediate_size=128,
    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[],
    tie_word_embeddings=False, initializer_range=0.2, bos_token_id=1, eos_token_id=2)
ENGINE_KWARGS = dict(
    skip_tokenizer_init=True, enable_uniprefill=True, uniprefill_min_prompt_tokens=0,
    uniprefill_drop_layers="1,3", uniprefill_block_size=16, uniprefill_sink_tokens=16,
    uniprefill_last_queries=16, disable_radix_cache=True, disable_prefill_cuda_graph=True,
    dtype="bfloat16",
    context_length=8192, max_running_requests=8, max_total_tokens=32768,
    mem_fraction_static=0.25, random_seed=0, log_level="info")
ENGINES = {
    "fi_whole": dict(attention_backend="flashinfer", chunked_prefill_size=8192),
    "fi_chunked": dict(attention_backend="flashinfer", chunked_prefill_size=512),
    "tr_whole": dict(attention_backend="triton", chunked_prefill_size=8192),
    "tr_chunked": dict(attention_backend="triton", chunked_prefill_size=512),
}
PAIRS = [("fi_whole", "fi_chunked"), ("tr_whole", "tr_chunked")]
TIMEOUT_S = 360


PROMPT, OTHER = random_prompts(CONFIG["vocab_size"])


def run_workload(engine) -> dict:
    return forced_keep_workload(engine, PROMPT, OTHER)


@pytest.fixture(scope="module")
def results():
    yield from random_model_results(__file__, CONFIG, ENGINES, TIMEOUT_S, "qwen3_next_engine_")


def _meta(rec) -> dict:
    return rec["uniprefill"][-1]


@pytest.mark.parametrize("name", list(ENGINES))
def test_top_p_one_is_token_identical_to_dense(results, name):
    res = results[name]
    assert res["full"]["output_ids"] == res["dense"]["output_ids"]
    assert _meta(res["full"])["kept_tokens"] == [len(PROMPT)] * 3
    assert res["cuda_graph"]


@pytest.mark.parametrize("name", list(ENGINES))
def test_forced_keep_drops_and_batches_alike(results, name):
    res = results[name]
    kept = _meta(res["forced"])["kept_tokens"]
    assert _meta(res["forced"])["enabled"] and kept[0] == len(PROMPT), kept
    assert kept[-1] < 0.25 * len(PROMPT), kept
    assert [_meta(o)["kept_tokens"] for o in res["batch"]] == \
        [kept, _meta(res["other"])["kept_tokens"]]
    print(f"{name}: forced {res['forced']['output_ids']}, dense {res['dense']['output_ids']}")
    assert [o["output_ids"] for o in res["batch"]] == \
        [res["forced"]["output_ids"], res["other"]["output_ids"]]


@pytest.mark.parametrize("pair", PAIRS, ids=[p[1] for p in PAIRS])
def test_forced_keep_answers_the_same_chunked(results, pair):
    whole, chunked = (results[n] for n in pair)
    # The final chunk scored the whole prompt with its last queries: stage 0 holds every token.
    assert _meta(chunked["forced"])["kept_tokens"] == _meta(whole["forced"])["kept_tokens"]
    assert chunked["forced"]["output_ids"] == whole["forced"]["output_ids"]
    assert chunked["full"]["output_ids"] == whole["full"]["output_ids"]


@pytest.mark.parametrize("name", list(ENGINES))
def test_no_parked_state_or_slot_left(results, name):
    state = results[name]["state"]
    assert state["idle"] and state["parked_requests"] == 0, state
    assert state["available_kv_tokens"] == state["max_total_num_tokens"], state


if __name__ == "__main__":
    name, model_dir, out_path = sys.argv[1:4]
    serve_and_record(name, ENGINES, ENGINE_KWARGS, model_dir, out_path, run_workload, 34000)
