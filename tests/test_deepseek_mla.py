"""DeepSeek-V2 (`DeepseekV2ForCausalLM`: multi-head latent attention, MoE) and DeepSeek-V3
(`DeepseekV3ForCausalLM`) on SGLang's CPU engine: Triton attention through Triton's interpreter.

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
* both prompts at the keep ratio in one batch: each keeps and answers as it does alone;
* a follow-up whose prompt begins with the 120-token prompt, cached by a request that dropped
  (the radix tree's hit runs every layer absorbed, an extend over a cached prefix): under
  `verify` (the engine keeps the prefix checkpoint) a top-p 1.0 follow-up re-selects and a dense
  one gets the dropped tokens back, both answering token for token as dense on an empty cache;
  under `reuse-sparse` both read the latent KV the cache holds, and top-p 1.0 answers as dense
  over that same cache;
* a request asking for block-sparse attention attends densely, saying why (MLA has no
  block-sparse path), and answers as dense;
* nothing is left parked, no request, private prefix slot or KV slot held (host KV lengths
  checked against the device at every drop and decode step, UNIPREFILL_CHECK_KV_LENS).

DeepSeek-V3 shares V2's attention and SGLang model code; its router differs (`noaux_tc`: sigmoid
scores, the `e_score_correction_bias` weight (transformers writes zeros), expert groups, scaled
and normalised top-k weights). A second engine of the same sizes serves the 120-token prompt
only: a keep ratio drops, top-p 1.0 answers as dense, nothing is left behind.
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
V3_CONFIG = dict(CONFIG, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
                 topk_method="noaux_tc", scoring_func="sigmoid", n_group=2, topk_group=1,
                 routed_scaling_factor=2.5, norm_topk_prob=True)
CHUNK = 128
ENGINE = dict(skip_tokenizer_init=True, context_length=1024, max_total_tokens=2048,
              log_level="warning", attention_backend="triton",
              # one split per sequence keeps the interpreted decode kernel quick
              triton_attention_num_kv_splits=1,
              chunked_prefill_size=CHUNK, max_prefill_tokens=CHUNK,
              enable_uniprefill=True, uniprefill_drop_layers="1,2", uniprefill_block_size=16,
              uniprefill_sink_tokens=16, uniprefill_last_queries=16,
              uniprefill_prefix_checkpoint=True)
GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
KNOBS = {"dense": {"uniprefill": False}, "full": {"uniprefill_top_p": 1.0},
         "forced": {"uniprefill_keep_ratio": 0.5}}
SHORT, LONG, TAIL = random_prompts(CONFIG["vocab_size"], lengths=(120, 300, 40))
PROMPTS = {"short": SHORT, "long": LONG}
FOLLOW_UP = SHORT + TAIL  # its first 120 tokens cached by a request that dropped
PREFIX_POLICIES = ("verify", "reuse-sparse")


def _generate(engine, ids, custom) -> dict:
    return engine.generate(input_ids=ids, sampling_params=dict(GREEDY, custom_params=custom))


def _last(out) -> dict:
    return out["meta_info"]["uniprefill"][-1]


def _serve(folder, config, requests) -> dict:
    """Start an engine of `config` and record `requests(engine)`, its server info and its idle
    state once the radix cache let go of the last request's slots."""
    pytest.importorskip("transformers")
    from uniprefill_sglang.tools.model_zoo import random_model

    model_dir = random_model(folder, config)
    os.environ["UNIPREFILL_REPORT_KEPT"] = "1"
    os.environ["UNIPREFILL_CHECK_KV_LENS"] = "1"
    with triton_interpreter():
        engine = make_cpu_engine(model_dir, **ENGINE)
    try:
        out = {"server": engine.get_server_info(), **requests(engine)}
        flush_cache(engine)
        out["state"] = idle_state(engine)
    finally:
        engine.shutdown()
    return out


def _on_an_empty_cache(engine, prompts) -> dict:
    out = {}
    for prompt, ids in prompts.items():
        for knob, custom in KNOBS.items():
            flush_cache(engine)  # each request prefills the whole prompt
            out[prompt, knob] = _generate(engine, ids, custom)
    return out


def _v2_requests(engine) -> dict:
    out = _on_an_empty_cache(engine, PROMPTS)
    flush_cache(engine)
    out["batch", "forced"] = engine.generate(  # both prompts dropping in one batch
        input_ids=[LONG, SHORT], sampling_params=dict(GREEDY, custom_params=KNOBS["forced"]))
    flush_cache(engine)
    out["short", "block-sparse"] = _generate(engine, SHORT, dict(
        KNOBS["full"], uniprefill_block_sparse_density=0.3))
    flush_cache(engine)
    out["follow-up", "empty cache"] = _generate(engine, FOLLOW_UP, KNOBS["dense"])
    for policy in PREFIX_POLICIES:
        for knob in ("full", "dense"):
            flush_cache(engine)
            out["cached", policy, knob] = _generate(engine, SHORT, KNOBS["forced"])
            out["follow-up", policy, knob] = _generate(
                engine, FOLLOW_UP, dict(KNOBS[knob], uniprefill_prefix_policy=policy))
    return out


@pytest.fixture(scope="module")
def v2(tmp_path_factory):
    return _serve(tmp_path_factory.mktemp("deepseek_v2"), CONFIG, _v2_requests)


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    return _serve(tmp_path_factory.mktemp("deepseek_v3"), V3_CONFIG,
                  lambda engine: _on_an_empty_cache(engine, {"short": SHORT}))


# (model, prompt) served on an empty cache with every knob.
# DeepSeek-V3 runs the same MLA path as V2 with a different router: a CI-extended case.
V3 = pytest.param("v3", marks=pytest.mark.extended)
SERVED = [("v2", "long"), ("v2", "short"),
          pytest.param("v3", "short", marks=pytest.mark.extended)]


@pytest.mark.parametrize("model", ["v2", V3])
def test_served_by_the_integration_on_triton(request, model):
    runs = request.getfixturevalue(model)
    assert runs["server"]["attention_backend"] == "triton"
    assert runs["state"]["drop_layers"] == [1, 2]
    assert _last(runs["short", "forced"])["reason"] is None, _last(runs["short", "forced"])


@pytest.mark.parametrize("model,prompt", SERVED)
def test_top_p_one_is_token_identical_to_dense(request, model, prompt):
    runs = request.getfixturevalue(model)
    meta = _last(runs[prompt, "full"])
    assert meta["enabled"], meta
    assert meta["kept_tokens"] == [len(PROMPTS[prompt])] * 3, meta
    assert runs[prompt, "full"]["output_ids"] == runs[prompt, "dense"]["output_ids"]


@pytest.mark.parametrize("model,prompt", SERVED)
def test_a_keep_ratio_drops_and_answers(request, model, prompt):
    runs = request.getfixturevalue(model)
    meta = _last(runs[prompt, "forced"])
    assert meta["enabled"] and meta["reason"] is None, meta
    kept = meta["kept_tokens"]
    assert kept[0] == len(PROMPTS[prompt]) and kept[1] < 0.75 * kept[0], kept
    assert kept[2] < kept[1], kept
    assert len(runs[prompt, "forced"]["output_ids"]) == GREEDY["max_new_tokens"]


def test_a_forced_keep_batched_keeps_and_answers_as_alone(v2):
    """Two prompts that drop in one batch (the long one chunked) keep and answer as each does
    alone: float32 on the CPU engine. The GPU module allows near ties that bfloat16 rounding
    flips (tests/gpu/test_deepseek_mla_gpu.py)."""
    for out, prompt in zip(v2["batch", "forced"], ("long", "short"), strict=True):
        alone = v2[prompt, "forced"]
        assert _last(out)["kept_tokens"] == _last(alone)["kept_tokens"], prompt
        assert _last(out)["kept_tokens"][-1] < len(PROMPTS[prompt]), prompt
        assert out["output_ids"] == alone["output_ids"], prompt


def test_block_sparse_attention_is_refused_per_request_saying_why(v2):
    out = v2["short", "block-sparse"]
    meta = _last(out)
    assert "multi-head latent attention has no block-sparse path" in meta["reason"], meta
    assert meta["block_sparse_density"] == 1.0, meta
    assert out["output_ids"] == v2["short", "dense"]["output_ids"]


def test_the_long_prompt_ran_chunked_and_rejoined_in_pieces(v2):
    assert len(LONG) > 2 * CHUNK
    assert v2["state"]["pieced_mlp_calls"] > 0


@pytest.mark.parametrize("policy", PREFIX_POLICIES)
@pytest.mark.parametrize("knob", ["full", "dense"])
def test_a_follow_up_hits_the_prefix_a_dropping_request_cached(v2, policy, knob):
    cached = _last(v2["cached", policy, knob])
    assert cached["kept_tokens"][-1] < cached["kept_tokens"][0], cached  # the cache is sparse
    out = v2["follow-up", policy, knob]
    assert out["meta_info"]["cached_tokens"] >= len(SHORT) - 1, out["meta_info"]
    assert len(out["output_ids"]) == GREEDY["max_new_tokens"]


def test_under_verify_the_follow_ups_answer_as_dense_on_an_empty_cache(v2):
    """Top-p 1.0 tolerates no missing mass: it re-selects over prefix and new tokens, keeping
    all; a dense request gets the tokens the cache dropped back. Both rejoin the prefix from
    its checkpoint at layer 1, on private latent slots."""
    reference = v2["follow-up", "empty cache"]["output_ids"]
    for knob, action in (("full", "re-selected"), ("dense", "restored")):
        meta = _last(v2["follow-up", "verify", knob])
        assert meta["prefix"]["action"] == action, meta
        assert meta["kept_tokens"] == [len(FOLLOW_UP)] * 3, meta
        assert v2["follow-up", "verify", knob]["output_ids"] == reference, knob


def test_under_reuse_sparse_top_p_one_answers_as_dense_over_the_same_cache(v2):
    """Both read the latent KV the cache holds (the dropped request's survivors past layer 1)
    through their stage's view; top-p 1.0 keeps every new token."""
    full, dense = (v2["follow-up", "reuse-sparse", knob] for knob in ("full", "dense"))
    meta = _last(full)
    assert meta["enabled"] and meta["prefix"]["action"] == "reused", meta
    assert meta["kept_tokens"] == [len(TAIL)] * 3, meta
    assert _last(dense).get("prefix") is None, _last(dense)
    assert full["output_ids"] == dense["output_ids"]


@pytest.mark.parametrize("model", ["v2", V3])
def test_nothing_left_behind(request, model):
    state = request.getfixturevalue(model)["state"]
    assert state["parked_requests"] == 0 and state["private_prefix_slots"] == 0
    assert state["free_req_slots"] == state["req_slots"]
    assert state["available_kv_tokens"] == state["max_total_num_tokens"]
