"""Qwen3-Next on the GPU: Gated DeltaNet layers after a drop, with SGLang's own GPU kernels.

Skipped without CUDA. Run in a pytest process of its own:

    pytest tests/gpu/test_qwen3_next_gpu.py -x -q

The model is tests/test_qwen3_next.py's reduced Qwen3-Next (full attention every second layer,
MoE with a shared expert, seeded random weights), at 6 layers here so that two linear layers
follow the drop at layer 1 (linear 0, full 1, linear 2, full 3, linear 4, full 5). SGLang runs
its GDN layers through its Triton (FLA) kernels and decode through CUDA graphs, in bfloat16
(SGLang's Gemma-style RMSNorm kernel has no float32 path on the GPU). The checks are
hybrid_gpu.py's.

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
pytest.register_assert_rewrite("hybrid_gpu")  # its checks report values when they fail

from engine_harness import random_model_results, serve_and_record  # noqa: E402
from hybrid_gpu import (ENGINES, TIMEOUT_S, VOCAB_SIZE, engine_kwargs,  # noqa: E402,F401
                        run_workload, test_forced_keep_answers_the_same_chunked,
                        test_linear_mixers_rejoin_in_pieces,
                        test_forced_keep_drops_and_batches_alike, test_no_parked_state_or_slot_left,
                        test_top_p_one_is_token_identical_to_dense)

CONFIG = dict(
    architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=VOCAB_SIZE,
    hidden_size=256, intermediate_size=512, num_hidden_layers=6, full_attention_interval=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_act="silu",
    max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0,
    partial_rotary_factor=0.25, linear_conv_kernel_dim=4, linear_key_head_dim=64,
    linear_value_head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
    decoder_sparse_step=1, moe_intermediate_size=128, shared_expert_intermediate_size=128,
    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[],
    tie_word_embeddings=False, initializer_range=0.2, bos_token_id=1, eos_token_id=2)
ENGINE_KWARGS = engine_kwargs("1,3", mem_fraction_static=0.25)


@pytest.fixture(scope="module")
def results():
    yield from random_model_results(__file__, CONFIG, ENGINES, TIMEOUT_S, "qwen3_next_engine_")


if __name__ == "__main__":
    name, model_dir, out_path = sys.argv[1:4]
    serve_and_record(name, ENGINES, ENGINE_KWARGS, model_dir, out_path, run_workload, 34000)
