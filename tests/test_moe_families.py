"""The mixture-of-experts families on SGLang's CPU engine: Qwen3-MoE, Qwen2-MoE (routed experts
and a gated shared expert) and Mixtral (its MoE block named `block_sparse_moe`).

Each model is reduced (4 layers, hidden size 64, 8 experts, top-2) with random weights, written
by transformers, and dropped at layers 1 and 2: the MoE blocks of layers 1 to 3 route and run
the survivors only, through SGLang's own MoE path for the CPU. The workload is
hybrid_workload.py's, with the radix cache on (each of its requests on an empty cache):
* a keep ratio drops (the kept tokens shrink per stage) and top-p 1.0 answers token for token as
  dense in the same engine, unchunked and chunked at 128 tokens;
* chunked, the forced keep keeps the positions the unchunked prefill keeps (fingerprinted by
  UNIPREFILL_REPORT_KEPT) and answers the same, and the MoE blocks after the rejoin run their
  rows in pieces of 128 (model_integration._wrap_mlp, the forward's extra arguments passed on);
* two prompts batched answer as each alone;
* radix-cache follow-ups over a document an earlier request cached sparse: re-selected, the
  follow-up keeps the positions and answers the text of the same prompt on an empty cache; a
  dense follow-up gets the dropped tokens back and answers as dense; at top-p 1.0 a follow-up
  answers as dense;
* nothing is left parked, no request or KV slot held (host KV lengths checked against the
  device at every drop and decode step, UNIPREFILL_CHECK_KV_LENS).
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from hybrid_workload import assert_nothing_left, random_prompts, run_hybrid_workload

from uniprefill_sglang.tools.cpu_engine import flush_cache, make_cpu_engine, triton_interpreter

pytestmark = pytest.mark.engine
os.environ["UNIPREFILL_REPORT_KEPT"] = "1"
os.environ["UNIPREFILL_CHECK_KV_LENS"] = "1"

_SHARED = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
               rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu", initializer_range=0.2,
               tie_word_embeddings=False, num_experts_per_tok=2, pad_token_id=0,
               bos_token_id=1, eos_token_id=2)
CONFIGS = {
    "qwen3_moe": dict(_SHARED, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                      num_experts=8, moe_intermediate_size=32, intermediate_size=128,
                      norm_topk_prob=True),
    "qwen2_moe": dict(_SHARED, architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe",
                      num_experts=8, moe_intermediate_size=32, intermediate_size=128,
                      shared_expert_intermediate_size=64, norm_topk_prob=False),
    "mixtral": dict(_SHARED, architectures=["MixtralForCausalLM"], model_type="mixtral",
                    num_local_experts=8, intermediate_size=32),
}
# SGLang gates Qwen2-MoE's shared expert with a fused Triton kernel (on a CPU without Intel AMX
# too): it runs through Triton's interpreter.
NEEDS_TRITON = {"qwen2_moe"}
ENGINE = dict(skip_tokenizer_init=True, context_length=2048, log_level="warning",
              enable_uniprefill=True, uniprefill_drop_layers="1,2", uniprefill_block_size=16,
              uniprefill_sink_tokens=16, uniprefill_last_queries=16,
              uniprefill_prefix_checkpoint=True)
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
FORCED = dict(GREEDY, custom_params={"uniprefill_keep_ratio": 0.5})
FULL = dict(GREEDY, custom_params={"uniprefill_top_p": 1.0})
DENSE = dict(GREEDY, custom_params={"uniprefill": False})
RESELECT = dict(GREEDY, custom_params={"uniprefill_keep_ratio": 0.5,
                                       "uniprefill_prefix_policy": "reselect"})
PROMPT, OTHER = random_prompts(CONFIGS["mixtral"]["vocab_size"])
FOLLOWUP = PROMPT + OTHER[:40]  # a question after the document PROMPT


def _followups(engine) -> dict:
    """Follow-ups over PROMPT cached by a request at the forced keep (its later layers hold the
    survivors only), and their references asked on an empty cache."""
    def ask(ids, params, cached=None):
        flush_cache(engine)
        if cached is not None:
            engine.generate(input_ids=cached, sampling_params=params)
        return engine.generate(input_ids=ids, sampling_params=params)

    out = {"reselected": ask(FOLLOWUP, RESELECT, cached=PROMPT),
           "reselected_ref": ask(FOLLOWUP, FORCED)}
    flush_cache(engine)
    engine.generate(input_ids=PROMPT, sampling_params=FORCED)
    out["restored"] = engine.generate(input_ids=FOLLOWUP, sampling_params=DENSE)
    out["full_followup"] = ask(FOLLOWUP, FULL, cached=PROMPT)
    out["dense_followup"] = ask(FOLLOWUP, DENSE)
    flush_cache(engine)
    return out


# Qwen2-MoE (its shared expert served through Triton's interpreter) is a CI-extended case:
# Qwen3-MoE and Mixtral carry the MoE integration in CI.
@pytest.fixture(scope="module", params=[pytest.param(f, marks=pytest.mark.extended)
                                        if f in NEEDS_TRITON else f for f in sorted(CONFIGS)])
def runs(request, tmp_path_factory):
    pytest.importorskip("transformers")
    from uniprefill_sglang.tools.model_zoo import random_model

    family = request.param
    model_dir = random_model(tmp_path_factory.mktemp(family), CONFIGS[family])

    def engine(**kwargs):
        with triton_interpreter() if family in NEEDS_TRITON else contextlib.nullcontext():
            return make_cpu_engine(model_dir, **ENGINE, **kwargs)

    return run_hybrid_workload(engine, PROMPT, OTHER, GREEDY, FORCED, more=_followups)


def _last(out) -> dict:
    return out["meta_info"]["uniprefill"][-1]


def test_served_with_the_radix_cache_on_the_shared_layout(runs):
    assert runs["server"]["disable_radix_cache"] is False
    assert runs["state"]["drop_layers"] == [1, 2]
    assert runs["state"]["kv_layout"] == "shared"


def test_top_p_one_is_token_identical_to_dense(runs):
    assert _last(runs["full"])["enabled"], _last(runs["full"])
    assert _last(runs["full"])["kept_tokens"] == [len(PROMPT)] * 3
    assert runs["full"]["output_ids"] == runs["dense"]["output_ids"]
    assert runs["chunked_full"]["output_ids"] == runs["chunked_dense"]["output_ids"]


def test_a_keep_ratio_drops_and_answers_the_same_chunked_and_batched(runs):
    meta = _last(runs["forced"])
    kept = meta["kept_tokens"]
    assert meta["enabled"] and meta["reason"] is None, meta
    assert kept[0] == len(PROMPT) and kept[2] < kept[1] < 0.75 * kept[0], kept
    assert len(runs["forced"]["output_ids"]) == GREEDY["max_new_tokens"]
    chunked = _last(runs["chunked"])
    assert chunked["kept_tokens"] == kept
    assert chunked["kept_digest"] == meta["kept_digest"]
    assert runs["chunked"]["output_ids"] == runs["forced"]["output_ids"]
    assert [o["output_ids"] for o in runs["batch"]] == \
        [runs["forced"]["output_ids"], runs["other"]["output_ids"]]
    assert [_last(o)["kept_digest"] for o in runs["batch"]] == \
        [meta["kept_digest"], _last(runs["other"])["kept_digest"]]


def test_moe_blocks_after_a_rejoin_run_in_pieces(runs):
    """Chunked at 128, the final chunk's step carries the parked rows of the earlier chunks too
    (more than 128 after the first drop): the MoE blocks from the first drop on run 128 rows at
    a time. At top-p 1.0 the chosen tokens' log-probabilities are dense's within rounding (dense
    runs each chunk through every layer, UniPrefill the parked rows' later layers in the final
    chunk's step)."""
    assert runs["chunked_state"]["pieced_mlp_calls"] > 0
    assert runs["state"]["pieced_mlp_calls"] == 0  # chunks of 4096: one piece
    top_p_1, dense = (torch.tensor([lp for lp, _, _ in runs[key]["meta_info"][
        "output_token_logprobs"]]) for key in ("chunked_full", "chunked_dense"))
    assert torch.isfinite(top_p_1).all()
    torch.testing.assert_close(top_p_1, dense, rtol=0, atol=1e-4)


def test_radix_cache_followups(runs):
    followup, ref = runs["reselected"], runs["reselected_ref"]
    assert followup["meta_info"]["cached_tokens"] >= len(PROMPT) - 1, followup["meta_info"]
    meta, ref_meta = _last(followup), _last(ref)
    assert meta["prefix"]["action"] == "re-selected", meta
    assert meta["kept_tokens"] == ref_meta["kept_tokens"]
    assert ref_meta["kept_tokens"][-1] < len(FOLLOWUP)
    assert meta["kept_digest"] == ref_meta["kept_digest"]
    assert followup["output_ids"] == ref["output_ids"]
    restored = runs["restored"]
    assert restored["meta_info"]["cached_tokens"] >= len(PROMPT) - 1, restored["meta_info"]
    assert restored["output_ids"] == runs["dense_followup"]["output_ids"]
    full = runs["full_followup"]
    assert full["meta_info"]["cached_tokens"] >= len(PROMPT) - 1, full["meta_info"]
    assert full["output_ids"] == runs["dense_followup"]["output_ids"]


def test_nothing_left_behind(runs):
    assert_nothing_left(runs)
