"""LFM2 on SGLang's CPU engine: gated short-convolution layers after a drop run over the survivors.

The model is a reduced LFM2 with random weights (`Lfm2ForCausalLM`: 8 layers, full attention at
2, 4 and 6, gated short convolutions elsewhere), written by transformers. SGLang runs its conv
layers through Triton's interpreter. The layer adds its attention output to the residual stream
in its own code, so the drop's gather happens at the next layer's entry (architectures.LFM2).

With drops at layers 2 and 4, the conv layers 3, 5 and 7 and the attention layer 6 run on the
survivors:
* top-p 1.0 answers token for token as dense, unchunked and chunked;
* a forced keep ratio answers the same unchunked and under chunked prefill, where the earlier
  chunks park at the first drop and no row of theirs reaches a later conv layer before the final
  chunk: a later layer's conv state covers the survivors in order, or the two would differ;
* two prompts batched answer as each alone (the survivors' rows are packed per request).
* chunked at 128, the conv layers after the rejoin run its rows in pieces of 128, each
  continuing the conv state the one before left (hybrid_workload.assert_mixers_ran_in_pieces).
* block-sparse attention at its full-attention layers: every causal block answers as dense, a
  density of 0.3 over the forced keep is realised and answers.
"""

from __future__ import annotations

import pytest
from hybrid_workload import (BLOCK_SPARSE_ENGINE, assert_block_sparse_over_full_attention,
                             assert_mixers_ran_in_pieces, assert_nothing_left,
                             block_sparse_requests, random_prompts, run_hybrid_workload)

from uniprefill_sglang.tools.cpu_engine import make_cpu_engine, triton_interpreter

LAYER_TYPES = ["conv", "conv", "full_attention", "conv", "full_attention", "conv",
               "full_attention", "conv"]
CONFIG = dict(
    architectures=["Lfm2ForCausalLM"], model_type="lfm2", vocab_size=512, hidden_size=128,
    intermediate_size=256, num_hidden_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES,
    full_attn_idxs=[i for i, t in enumerate(LAYER_TYPES) if t == "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, norm_eps=1e-5,
    conv_bias=False, conv_L_cache=3, block_multiple_of=32, block_ffn_dim_multiplier=1.0,
    block_auto_adjust_ff_dim=False, initializer_range=0.2, tie_word_embeddings=True,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
ENGINE = dict(skip_tokenizer_init=True, context_length=2048, log_level="warning",
              enable_uniprefill=True, uniprefill_drop_layers="2,4", uniprefill_block_size=16,
              uniprefill_sink_tokens=16, uniprefill_last_queries=16)
GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
FORCED = dict(GREEDY, custom_params={"uniprefill_keep_ratio": [0.15, 0.6]})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    from uniprefill_sglang.tools.model_zoo import random_model

    return random_model(tmp_path_factory.mktemp("lfm2"), CONFIG)


PROMPT, OTHER = random_prompts(CONFIG["vocab_size"])


def _engine(model_dir, **kwargs):
    with triton_interpreter():  # SGLang's causal_conv1d kernels are Triton's on a CPU
        return make_cpu_engine(model_dir, **ENGINE, **kwargs)


@pytest.fixture(scope="module")
def runs(model_dir):
    return run_hybrid_workload(
        lambda **kw: _engine(model_dir, **BLOCK_SPARSE_ENGINE, **kw), PROMPT, OTHER, GREEDY,
        FORCED, more=lambda engine: block_sparse_requests(engine, PROMPT, GREEDY, FORCED))


def _last(out) -> dict:
    return out["meta_info"]["uniprefill"][-1]


@pytest.mark.engine
def test_served_without_radix_cache_on_the_shared_layout(runs):
    assert runs["server"]["disable_radix_cache"] is True
    assert runs["state"]["drop_layers"] == [2, 4]
    assert runs["state"]["kv_layout"] == "shared"


@pytest.mark.engine
def test_top_p_one_is_token_identical_to_dense(runs):
    assert _last(runs["full"])["enabled"], _last(runs["full"])
    assert _last(runs["full"])["kept_tokens"] == [len(PROMPT)] * 3
    assert runs["full"]["output_ids"] == runs["dense"]["output_ids"]
    assert runs["chunked_full"]["output_ids"] == runs["dense"]["output_ids"]


@pytest.mark.engine
def test_forced_drop_answers_the_same_chunked_and_batched(runs):
    meta = _last(runs["forced"])
    kept = meta["kept_tokens"]
    assert meta["enabled"] and meta["reason"] is None, meta
    assert kept[0] == len(PROMPT) and kept[2] < 0.25 * len(PROMPT), kept
    assert runs["forced"]["output_ids"] != runs["dense"]["output_ids"]  # the drop took effect
    # Earlier chunks parked at layer 2 and the final chunk scored the whole prompt (kept[0]).
    assert _last(runs["chunked"])["kept_tokens"] == kept
    assert runs["chunked"]["output_ids"] == runs["forced"]["output_ids"]
    assert [o["output_ids"] for o in runs["batch"]] == \
        [runs["forced"]["output_ids"], runs["other"]["output_ids"]]
    assert [_last(o)["kept_tokens"] for o in runs["batch"]] == \
        [kept, _last(runs["other"])["kept_tokens"]]


@pytest.mark.engine
def test_conv_layers_after_a_rejoin_run_in_pieces(runs):
    assert_mixers_ran_in_pieces(runs)


@pytest.mark.engine
def test_block_sparse_attention_at_its_full_attention_layers(runs):
    assert_block_sparse_over_full_attention(runs)


@pytest.mark.engine
def test_nothing_left_behind(runs):
    assert_nothing_left(runs)


@pytest.mark.engine
def test_parking_is_priced_at_the_costlier_layer_kind(runs):
    """A rejoining row costs what the costlier layer kind holds alive (parking.RejoinCost): the
    conv layer (hidden state, residual, norm output and its projections once: B, C and x in,
    one out; the mixer runs in pieces) or the attention layer (q/k/v projection, two partial
    outputs, KV row). float32 on the CPU engine."""
    hidden, heads = CONFIG["hidden_size"], CONFIG["num_attention_heads"]
    kv_row = 2 * CONFIG["num_key_value_heads"] * (hidden // heads) * 4
    attention = (4 * hidden + 3 * hidden) * 4 + kv_row
    assert runs["state"]["rejoin_row_bytes"] == max(attention, (4 * hidden + 4 * hidden) * 4)
