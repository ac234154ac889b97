"""LFM2 on the GPU: gated short-convolution layers after a drop, with SGLang's own GPU kernels.

Skipped without CUDA. Run in a pytest process of its own:

    pytest tests/gpu/test_lfm2_gpu.py -x -q

The model is tests/test_lfm2.py's reduced LFM2 (8 layers, full attention at 2, 4 and 6, gated
short convolutions elsewhere, seeded random weights). With drops at layers 2 and 4, the conv
layers 3, 5 and 7 and the attention layer 6 run on the survivors, the conv layers through
SGLang's causal_conv1d kernels with the survivors' conv-state handle
(backends/short_conv.py), decode through CUDA graphs, in bfloat16, on FlashInfer (SGLang
serves LFM2 on no other GPU attention backend). The checks are hybrid_gpu.py's; the exact check of the conv state over the survivors runs on the CPU in
float32 (tests/test_lfm2.py).
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

LAYER_TYPES = ["conv", "conv", "full_attention", "conv", "full_attention", "conv",
               "full_attention", "conv"]
CONFIG = dict(
    architectures=["Lfm2ForCausalLM"], model_type="lfm2", vocab_size=VOCAB_SIZE, hidden_size=256,
    intermediate_size=512, num_hidden_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES,
    full_attn_idxs=[i for i, t in enumerate(LAYER_TYPES) if t == "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192, norm_eps=1e-5,
    conv_bias=False, conv_L_cache=3, block_multiple_of=32, block_ffn_dim_multiplier=1.0,
    block_auto_adjust_ff_dim=False, initializer_range=0.2, tie_word_embeddings=True,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
ENGINE_KWARGS = engine_kwargs("2,4", mem_fraction_static=0.25)
# SGLang 0.5.17 refuses LFM2 on its Triton backend ("the first layer might not be an attention
# layer"), stock as with the plugin.
UNSUPPORTED = {n: "SGLang serves LFM2 on FlashInfer, not Triton" for n in ENGINES
               if ENGINES[n]["attention_backend"] == "triton"}


@pytest.fixture(scope="module")
def results():
    yield from random_model_results(__file__, CONFIG, ENGINES, TIMEOUT_S, "lfm2_engine_",
                                    unsupported=UNSUPPORTED)


if __name__ == "__main__":
    name, model_dir, out_path = sys.argv[1:4]
    serve_and_record(name, ENGINES, ENGINE_KWARGS, model_dir, out_path, run_workload, 36000)
