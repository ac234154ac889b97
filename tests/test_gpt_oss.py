"""gpt-oss (`GptOssForCausalLM`) on SGLang's CPU engine: Triton attention through Triton's
interpreter.

The model is reduced (4 layers, sliding-window (16) and full attention alternating, hidden size
64, 4 experts, top-2, learned attention sinks) with random weights, written by transformers.
SGLang serves gpt-oss with the triton, fa3, trtllm_mha (and a few vendor) backends only, so
the Triton kernels run interpreted. SGLang's gpt-oss defaults pick the `triton_kernel` MoE
runner wherever the triton_kernels package imports; on the CPU its weight loading fails (the
experts' weights are laid out for it, but the CPU loader skips its transpose), so the engine
asks for the `triton` MoE runner, which on the CPU runs SGLang's torch MoE path. It also
turns SGLang's separate sliding-window KV pool off (`disable_hybrid_swa_memory`), which the
Triton adapter does not serve (a drop there re-runs the step dense, saying so).

UniPrefill drops at the full-attention layer 1: the sliding-window layer 2 attends to the
survivors within its window in original positions (`kernels.positional_attention`, with the
sinks), the full-attention layer 3 to the survivors through upstream's kernel (with the sinks),
and the MoE blocks of layers 1 to 3 run over the survivors.
* a keep ratio drops (fewer kept tokens than the prompt) and answers;
* top-p 1.0 keeps every token and answers token for token as dense in the same engine;
* the keep ratio over this prompt and a shorter one in one batch: each keeps and answers as it
  does alone (float32; the GPU module allows near ties that bfloat16 rounding flips);
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

LAYER_TYPES = ["sliding_attention", "full_attention"] * 2
CONFIG = dict(
    architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=512, hidden_size=64,
    intermediate_size=64, num_hidden_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
    num_local_experts=4, num_experts_per_tok=2, experts_per_token=2,
    max_position_embeddings=4096, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 150000.0}, attention_bias=True,
    hidden_act="silu", swiglu_limit=7.0, router_aux_loss_coef=0.0, output_router_logits=False,
    initializer_range=0.2, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
    eos_token_id=2)
ENGINE = dict(skip_tokenizer_init=True, context_length=1024, max_total_tokens=2048,
              log_level="warning", attention_backend="triton", moe_runner_backend="triton",
              # one KV pool for every layer: the Triton adapter serves no separate
              # sliding-window pool (SGLang gives gpt-oss one by default)
              disable_hybrid_swa_memory=True,
              # one split per sequence keeps the interpreted decode kernel quick
              triton_attention_num_kv_splits=1,
              enable_uniprefill=True, uniprefill_drop_layers="1", uniprefill_block_size=16,
              uniprefill_sink_tokens=16, uniprefill_last_queries=16)
GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
PROMPT, OTHER = random_prompts(CONFIG["vocab_size"], lengths=(160, 96))
FORCED = dict(GREEDY, custom_params={"uniprefill_keep_ratio": 0.5})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("transformers")
    from uniprefill_sglang.tools.model_zoo import random_model

    model_dir = random_model(tmp_path_factory.mktemp("gpt_oss"), CONFIG)
    os.environ["UNIPREFILL_REPORT_KEPT"] = "1"
    os.environ["UNIPREFILL_CHECK_KV_LENS"] = "1"
    with triton_interpreter():
        engine = make_cpu_engine(model_dir, **ENGINE)
    out = {}
    try:
        out["server"] = engine.get_server_info()
        for name, custom in (("dense", {"uniprefill": False}),
                             ("full", {"uniprefill_top_p": 1.0})):
            flush_cache(engine)  # each request prefills the whole prompt
            out[name] = engine.generate(input_ids=PROMPT,
                                        sampling_params=dict(GREEDY, custom_params=custom))
        for name, ids in (("forced", PROMPT), ("other", OTHER), ("batch", [PROMPT, OTHER])):
            flush_cache(engine)
            out[name] = engine.generate(input_ids=ids, sampling_params=FORCED)
        flush_cache(engine)  # the radix cache lets go of the last request's slots
        out["state"] = idle_state(engine)
    finally:
        engine.shutdown()
    return out


def _last(out) -> dict:
    return out["meta_info"]["uniprefill"][-1]


def test_served_by_the_integration(runs):
    assert runs["state"]["drop_layers"] == [1]
    assert _last(runs["forced"])["reason"] is None, _last(runs["forced"])


def test_top_p_one_is_token_identical_to_dense(runs):
    meta = _last(runs["full"])
    assert meta["enabled"], meta
    assert meta["kept_tokens"] == [len(PROMPT)] * 2, meta
    assert runs["full"]["output_ids"] == runs["dense"]["output_ids"]


def test_a_keep_ratio_drops(runs):
    meta = _last(runs["forced"])
    assert meta["enabled"] and meta["reason"] is None, meta
    kept = meta["kept_tokens"]
    assert kept[0] == len(PROMPT) and kept[1] < 0.75 * kept[0], kept
    assert len(runs["forced"]["output_ids"]) == GREEDY["max_new_tokens"]


def test_a_keep_ratio_batched_keeps_and_answers_as_alone(runs):
    for out, alone in zip(runs["batch"], (runs["forced"], runs["other"]), strict=True):
        kept = _last(alone)["kept_tokens"]
        assert kept[1] < kept[0], kept
        assert _last(out)["kept_tokens"] == kept
        assert out["output_ids"] == alone["output_ids"]


def test_nothing_left_behind(runs):
    state = runs["state"]
    assert state["parked_requests"] == 0 and state["private_prefix_slots"] == 0
    assert state["free_req_slots"] == state["req_slots"]
    assert state["available_kv_tokens"] == state["max_total_num_tokens"]
