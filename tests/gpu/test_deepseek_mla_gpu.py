"""DeepSeek-V2 (multi-head latent attention) on the GPU, at DeepSeek-V2-Lite's attention sizes.

Skipped without CUDA. Run in a pytest process of its own:

    pytest tests/gpu/test_deepseek_mla_gpu.py -x -q

The model is tests/test_deepseek_mla.py's reduced DeepSeek-V2 widened to V2-Lite's attention
(hidden size 2048, 16 heads, kv_lora_rank 512, 128 + 64 query/key dims, 128 value dims, YaRN
RoPE) with fewer, smaller MoE layers (4 layers, the first dense; 8 routed experts top-2 and
2 shared), seeded random weights, in bfloat16. UniPrefill drops at layers 1 and 2: from layer 1
on every extend runs MLA's absorbed form, layers 2 and 3 read the latent KV through their
stage's view, decode through Triton's CUDA graphs with per-stage views. Two backends, whole and
chunked at 512 each:

* `triton_*` ask for Triton, where UniPrefill serves MLA;
* `fa3_*` leave the backend to SGLang (fa3 for MLA on Hopper) with UNIPREFILL_PREVIEW_BACKENDS
  on, so prefill runs FA3's absorbed MLA through the FA3 adapter's views and decode runs on
  Triton (without the preview such a server runs the model dense, saying why:
  tests/test_flags.py).

In each:

* the server runs the backends named above;
* top-p 1.0 is token-identical to dense in the same engine, decode graphs on;
* a forced keep drops (no fallback reason) and answers the same batched with another prompt,
  up to the near ties that its MoE layers' batch-dependent rounding may flip
  (`first_unexplained_difference`; on an H100 the batch parted from the single requests at one
  step in three of the four engines, kept counts within a block);
* chunked keeps the same counts as whole and answers alike as far as dense does (the same
  allowance);
* nothing is left parked and no slot leaks.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_harness import (check_chunked_as_whole, check_forced_keep,  # noqa: E402
                            check_nothing_left, check_top_p_one_as_dense,
                            forced_keep_workload, random_model_results, random_prompts,
                            serve_and_record)
from test_deepseek_mla import CONFIG as CPU_CONFIG  # noqa: E402

CONFIG = dict(CPU_CONFIG, vocab_size=4096, hidden_size=2048, intermediate_size=4096,
              num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
              qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
              moe_intermediate_size=1408, n_routed_experts=8, n_shared_experts=2,
              num_experts_per_tok=2, initializer_range=0.02, max_position_embeddings=8192,
              rope_scaling=dict(CPU_CONFIG["rope_scaling"], original_max_position_embeddings=8192))
ENGINE_KWARGS = dict(
    skip_tokenizer_init=True, enable_uniprefill=True, uniprefill_min_prompt_tokens=0,
    uniprefill_drop_layers="1,2", uniprefill_block_size=16, uniprefill_sink_tokens=16,
    uniprefill_last_queries=16, disable_radix_cache=True, dtype="bfloat16", context_length=8192,
    max_running_requests=8, max_total_tokens=32768, mem_fraction_static=0.2, random_seed=0,
    log_level="info")
ENGINES = {  # (prefill, decode) backends they run
    "triton_whole": dict(chunked_prefill_size=8192, attention_backend="triton"),
    "triton_chunked": dict(chunked_prefill_size=512, attention_backend="triton"),
    "fa3_whole": dict(chunked_prefill_size=8192),
    "fa3_chunked": dict(chunked_prefill_size=512),
}
BACKENDS = {"triton": ("triton", "triton"), "fa3": ("fa3", "triton")}
PROMPT, OTHER = random_prompts(CONFIG["vocab_size"])


@pytest.fixture(scope="module")
def results():
    yield from random_model_results(__file__, CONFIG, ENGINES, 600, "deepseek_mla_engine_")



@pytest.mark.parametrize("name", list(ENGINES))
def test_served_on_its_backends(results, name):
    assert results[name]["backends"] == list(BACKENDS[name.split("_")[0]])


@pytest.mark.parametrize("name", list(ENGINES))
def test_top_p_one_is_token_identical_to_dense(results, name):
    check_top_p_one_as_dense(results[name], len(PROMPT), 3)


@pytest.mark.parametrize("name", list(ENGINES))
def test_forced_keep_drops_and_batches_alike(results, name):
    check_forced_keep(results[name], len(PROMPT), 0.5, no_reason=True,
                      batch_rounding_block=ENGINE_KWARGS["uniprefill_block_size"])


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_chunked_keeps_and_answers_as_whole(results, backend):
    check_chunked_as_whole(results[f"{backend}_whole"], results[f"{backend}_chunked"],
                           batch_rounding_block=ENGINE_KWARGS["uniprefill_block_size"])


@pytest.mark.parametrize("name", list(ENGINES))
def test_no_parked_state_or_slot_left(results, name):
    check_nothing_left(results[name]["state"])


def _workload(engine) -> dict:
    res = forced_keep_workload(engine, PROMPT, OTHER, top2=True)
    info = engine.get_server_info()
    prefill = info.get("prefill_attention_backend") or info["attention_backend"]
    res["backends"] = [prefill, info.get("decode_attention_backend") or prefill]
    return res


if __name__ == "__main__":
    name, model_dir, out_path = sys.argv[1:4]
    if name.startswith("fa3"):
        os.environ["UNIPREFILL_PREVIEW_BACKENDS"] = "1"  # the engine's processes inherit it
    serve_and_record(name, ENGINES, ENGINE_KWARGS, model_dir, out_path, _workload, 38000)
