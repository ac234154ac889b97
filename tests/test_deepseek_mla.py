"""DeepSeek-V2 (`DeepseekV2ForCausalLM`: multi-head latent attention, MoE) on SGLang's CPU
engine: Triton attention through Triton's interpreter.

The model is reduced (4 layers, hidden size 64, 4 heads, kv_lora_rank 48 with 16 RoPE dims,
4 routed experts top-2 and a shared one from layer 1 on) with random weights, written by
transformers. SGLang runs MLA on the CPU engine with the triton backend only (torch_native's
prefill fails on its head sizes), and its decode kernel needs kv_lora_rank + RoPE dims to round
to the same power of two as kv_lora_rank (48 + 16 does, 32 + 16 does not). Its rotary
embedding must be DeepSeek's YaRN one (SGLang's default rotary path for this model needs a CUDA
kernel).

UniPrefill drops at layers 1 and 2; from layer 1 on every extend runs MLA's absorbed form
(model_integration._run_absorbed), so the drop scores the absorbed queries against the latent
KV, the latent KV of the survivors is written at their own slots, and layers 2 and 3 read the
latent pool through their stage's view. One engine chunking at 128 tokens serves:
* a 120-token prompt (one chunk): a keep ratio drops and answers; top-p 1.0 keeps every token
  and answers token for token as dense in the same engine;
* a 300-token prompt (three chunks, the first two parked at layer 1): the same, the rejoined
  rows running layers 2 and 3 in pieces of 128 over the latent KV the earlier pieces wrote;
* nothing is left parked, no request or KV slot held (host KV lengths checked against the
  device at every drop and decode step, UNIPREFILL_CHECK_KV_LENS).
"""

from __future__ import annotations

import os

import pytest
from hybrid_workload import random_prompts

from uniprefill_sglang.tools.cpu_engine import (
    flush_cache,
    idle_state,
    make_cpu_engine,
    triton_interpreter,
)

pytestmark = pytest.mark.engine

CONFIG = dict(
    architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=512,
    hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=48, q_lora_rank=None,
    qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=4,
    n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, moe_layer_freq=1,
    topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0,
    norm_topk_prob=False, scoring_func="softmax", aux_loss_alpha=0.0, seq_aux=False,
    hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0,
    rope_scaling={"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 4096,
                  "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    attention_bias=False, attention_dropout=0.0, initializer_range=0.2,
    tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
CHUNK = 128
ENGINE = dict(skip_tokenizer_init=True, context_length=1024, max_total_tokens=2048,
              log_level="warning", attention_backend="triton",
              # one split per sequence keeps the interpreted decode kernel quick
              triton_attention_num_kv_splits=1,
              chunked_prefill_size=CHUNK, max_prefill_tokens=CHUNK,
              enable_uniprefill=True, uniprefill_drop_layers="1,2", uniprefill_block_size=16,
              uniprefill_sink_tokens=16, uniprefill_last_queries=16)
GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
KNOBS = {"dense": {"uniprefill": False}, "full": {"uniprefill_top_p": 1.0},
         "forced": {"uniprefill_keep_ratio": 0.5}}
SHORT, LONG = random_prompts(CONFIG["vocab_size"], lengths=(120, 300))
PROMPTS = {"short": SHORT, "long": LONG}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("transformers")
    from uniprefill_sglang.tools.model_zoo import random_model

    model_dir = random_model(tmp_path_factory.mktemp("deepseek_v2"), CONFIG)
    os.environ["UNIPREFILL_REPORT_KEPT"] = "1"
    os.environ["UNIPREFILL_CHECK_KV_LENS"] = "1"
    with triton_interpreter():
        engine = make_cpu_engine(model_dir, **ENGINE)
    out = {}
    try:
        out["server"] = engine.get_server_info()
        for prompt, ids in PROMPTS.items():
            for knob, custom in KNOBS.items():
                flush_cache(engine)  # each request prefills the whole prompt
                out[prompt, knob] = engine.generate(
                    input_ids=ids, sampling_params=dict(GREEDY, custom_params=custom))
        flush_cache(engine)  # the radix cache lets go of the last request's slots
        out["state"] = idle_state(engine)
    finally:
        engine.shutdown()
    return out


def _last(out) -> dict:
    return out["meta_info"]["uniprefill"][-1]


def test_served_by_the_integration_on_triton(runs):
    assert runs["server"]["attention_backend"] == "triton"
    assert runs["state"]["drop_layers"] == [1, 2]
    assert _last(runs["short", "forced"])["reason"] is None, _last(runs["short", "forced"])


@pytest.mark.parametrize("prompt", sorted(PROMPTS))
def test_top_p_one_is_token_identical_to_dense(runs, prompt):
    meta = _last(runs[prompt, "full"])
    assert meta["enabled"], meta
    assert meta["kept_tokens"] == [len(PROMPTS[prompt])] * 3, meta
    assert runs[prompt, "full"]["output_ids"] == runs[prompt, "dense"]["output_ids"]


@pytest.mark.parametrize("prompt", sorted(PROMPTS))
def test_a_keep_ratio_drops_and_answers(runs, prompt):
    meta = _last(runs[prompt, "forced"])
    assert meta["enabled"] and meta["reason"] is None, meta
    kept = meta["kept_tokens"]
    assert kept[0] == len(PROMPTS[prompt]) and kept[1] < 0.75 * kept[0], kept
    assert kept[2] < kept[1], kept
    assert len(runs[prompt, "forced"]["output_ids"]) == GREEDY["max_new_tokens"]


def test_the_long_prompt_ran_chunked_and_rejoined_in_pieces(runs):
    assert len(LONG) > 2 * CHUNK
    assert runs["state"]["pieced_mlp_calls"] > 0


def test_nothing_left_behind(runs):
    state = runs["state"]
    assert state["parked_requests"] == 0 and state["private_prefix_slots"] == 0
    assert state["free_req_slots"] == state["req_slots"]
    assert state["available_kv_tokens"] == state["max_total_num_tokens"]
