"""Gemma 3 on the GPU: sliding-window layers after a drop on Triton and FlashInfer, against
torch_native.

Skipped without CUDA. Run in a pytest process of its own:

    pytest tests/gpu/test_gemma3_gpu.py -x -q

The model is a reduced Gemma 3 (8 layers, sliding window 128 except the global layers 1, 3 and
6, seeded random weights), in bfloat16 (SGLang's Gemma RMSNorm kernel has no float32 path on
the GPU). UniPrefill drops at layers 3 and 6 with a forced keep, so the sliding layers 4, 5 and
7 attend to survivors whose window is counted in original positions: on Triton through
`kernels.positional_attention` in prefill and the per-stage window lists in decode (CUDA
graphs on), on FlashInfer through `kernels.positional_attention` in both (its full layers
through per-stage wrappers), on torch_native through its masks (the engine tests/test_gemma3_reference.py holds
to a float64 reference on the CPU). Checked, under the staged and the shared KV layouts:

* top-p 1.0 is token-identical to dense in the same engine;
* a forced keep gives the same kept counts and tokens unchunked, chunked at 512 (the earlier
  chunks park and rejoin) and batched with another prompt;
* Triton and FlashInfer keep what torch_native keeps and answer as it does (the selection and
  the sliding layers computed by different kernels: equal answers say the window lists are the
  model's);
* nothing is left parked and no slot leaks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_harness import (forced_keep_workload, random_model_results,  # noqa: E402
                            random_prompts, serve_and_record)

LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention",
               "sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
CONFIG = dict(
    architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=512,
    hidden_size=256, intermediate_size=512, num_hidden_layers=len(LAYER_TYPES),
    layer_types=LAYER_TYPES, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    query_pre_attn_scalar=64, sliding_window=128, hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=8192, rms_norm_eps=1e-6,
    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    attention_bias=False, tie_word_embeddings=True, initializer_range=0.2,
    pad_token_id=0, bos_token_id=2, eos_token_id=1)
ENGINE_KWARGS = dict(
    skip_tokenizer_init=True, enable_uniprefill=True, uniprefill_min_prompt_tokens=0,
    uniprefill_drop_layers="3,6", uniprefill_block_size=16, uniprefill_sink_tokens=16,
    uniprefill_last_queries=16, disable_radix_cache=True, dtype="bfloat16",
    context_length=8192, max_running_requests=8, max_total_tokens=32768,
    mem_fraction_static=0.4, random_seed=0, log_level="info")
STAGED = dict(uniprefill_kv_layout="staged")
ENGINES = {
    "tn_whole": dict(attention_backend="torch_native", chunked_prefill_size=8192, **STAGED),
    "tr_whole": dict(attention_backend="triton", chunked_prefill_size=8192, **STAGED),
    "tr_chunked": dict(attention_backend="triton", chunked_prefill_size=512, **STAGED),
    "tr_shared": dict(attention_backend="triton", chunked_prefill_size=512,
                      uniprefill_kv_layout="shared"),
    "fi_whole": dict(attention_backend="flashinfer", chunked_prefill_size=8192, **STAGED),
    "fi_chunked": dict(attention_backend="flashinfer", chunked_prefill_size=512, **STAGED),
    "fi_shared": dict(attention_backend="flashinfer", chunked_prefill_size=512,
                      uniprefill_kv_layout="shared"),
}
GPU_BACKENDS = [n for n in ENGINES if not n.startswith("tn_")]
TIMEOUT_S = 420


PROMPT, OTHER = random_prompts(CONFIG["vocab_size"])


def run_workload(engine) -> dict:
    return forced_keep_workload(engine, PROMPT, OTHER)


@pytest.fixture(scope="module")
def results():
    yield from random_model_results(__file__, CONFIG, ENGINES, TIMEOUT_S, "gemma3_engine_")


def _meta(rec) -> dict:
    return rec["uniprefill"][-1]


@pytest.mark.parametrize("name", list(ENGINES))
def test_top_p_one_is_token_identical_to_dense(results, name):
    res = results[name]
    assert _meta(res["full"])["enabled"], _meta(res["full"])
    assert _meta(res["full"])["kept_tokens"] == [len(PROMPT)] * 3
    assert res["full"]["output_ids"] == res["dense"]["output_ids"]


@pytest.mark.parametrize("name", list(ENGINES))
def test_forced_keep_drops_and_batches_alike(results, name):
    res = results[name]
    meta = _meta(res["forced"])
    assert meta["enabled"] and meta["reason"] is None, meta
    kept = meta["kept_tokens"]
    assert kept[0] == len(PROMPT) and kept[-1] < 0.25 * len(PROMPT), kept
    assert [_meta(o)["kept_tokens"] for o in res["batch"]] == \
        [kept, _meta(res["other"])["kept_tokens"]]
    assert [o["output_ids"] for o in res["batch"]] == \
        [res["forced"]["output_ids"], res["other"]["output_ids"]]


@pytest.mark.parametrize("name", GPU_BACKENDS)
def test_gpu_backends_answer_as_torch_native(results, name):
    want, res = results["tn_whole"], results[name]
    assert res["cuda_graph"]
    for key in ("dense", "forced", "other"):
        assert res[key]["output_ids"] == want[key]["output_ids"], key
    # A forced keep's final chunk reports the whole prompt (its parked chunks rejoined).
    for key in ("forced", "other"):
        assert _meta(res[key])["kept_tokens"] == _meta(want[key])["kept_tokens"], key


@pytest.mark.parametrize("name", list(ENGINES))
def test_no_parked_state_or_slot_left(results, name):
    state = results[name]["state"]
    assert state["idle"] and state["parked_requests"] == 0, state
    assert state.get("kv_pool_problems", []) == [], state  # reported under the staged layout
    assert state["available_kv_tokens"] == state["max_total_num_tokens"], state


if __name__ == "__main__":
    import os

    os.environ["UNIPREFILL_FLASHINFER_SLIDING_WINDOW"] = "1"  # the fi_* engines' drops
    name, model_dir, out_path = sys.argv[1:4]
    serve_and_record(name, ENGINES, ENGINE_KWARGS, model_dir, out_path, run_workload, 35000)
