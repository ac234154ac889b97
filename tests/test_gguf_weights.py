"""The model zoo's GGUF reader (tools/gguf_weights.py): llama.cpp's row order undone, names
mapped, and the tensors of the shipped SmolLM2 GGUF equal to transformers' own GGUF loader."""

from __future__ import annotations

import numpy as np
import pytest

from uniprefill_sglang.tools import gguf_weights


@pytest.mark.parametrize("n_heads,head_dim,hidden", [(1, 4, 3), (3, 64, 17), (9, 8, 5)])
def test_rope_rows_round_trip(n_heads, head_dim, hidden):
    rng = np.random.default_rng()
    weight = rng.standard_normal((n_heads * head_dim, hidden)).astype(np.float32)
    stored = gguf_weights.permute_rope_rows(weight, n_heads)
    assert not np.array_equal(stored, weight) or head_dim == 2
    np.testing.assert_array_equal(gguf_weights.unpermute_rope_rows(stored, n_heads), weight)


def test_rope_rows_interleave_the_halves():
    # One head of dim 4: Hugging Face rows (x0, x1 | y0, y1) rotate x_i with y_i; llama.cpp
    # keeps each rotated pair adjacent: (x0, y0, x1, y1).
    weight = np.arange(8, dtype=np.float32).reshape(4, 2)
    stored = gguf_weights.permute_rope_rows(weight, 1)
    np.testing.assert_array_equal(stored[:, 0], [0, 4, 2, 6])


def test_names():
    assert gguf_weights.hf_name("blk.7.attn_q.weight", "llama") == \
        "model.layers.7.self_attn.q_proj.weight"
    assert gguf_weights.hf_name("blk.0.ffn_norm.weight", "llama") == \
        "model.layers.0.post_attention_layernorm.weight"
    assert gguf_weights.hf_name("blk.0.ffn_norm.weight", "gemma3") == \
        "model.layers.0.pre_feedforward_layernorm.weight"
    assert gguf_weights.hf_name("token_embd.weight", "gemma3") == "model.embed_tokens.weight"
    assert gguf_weights.hf_name("rope_freqs.weight", "llama") is None
    with pytest.raises(KeyError, match="blk.0.attn_mystery.weight"):
        gguf_weights.hf_name("blk.0.attn_mystery.weight", "llama")


@pytest.mark.slow
def test_smollm2_tensors_equal_transformers_loader():
    pytest.importorskip("accelerate")  # transformers' GGUF loader wants it from 5.19 on
    import torch
    from transformers import AutoModelForCausalLM

    from uniprefill_sglang.tools.model_zoo import find_smollm2_gguf

    gguf = find_smollm2_gguf()
    arch, ours = gguf_weights.read_state_dict(gguf)
    assert arch == "llama"
    reference = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).state_dict()
    # The output projection is tied to the embedding (the GGUF stores one tensor).
    assert set(reference) - set(ours) == {"lm_head.weight"}
    for name, values in ours.items():
        expected = reference[name].float().numpy()
        assert np.isfinite(values).all(), name
        np.testing.assert_array_equal(values, expected, err_msg=name)
