"""Multi-head latent attention (DeepSeek-V2/V3) without an engine: the layers from the first drop
on run every extend absorbed, the drop reads the absorbed queries whole however the model passes
them, and an MLA pool's slot is priced by its one latent buffer a layer. The engine test is
test_deepseek_mla.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from uniprefill_sglang.model_integration import _run_absorbed, query_rows
from uniprefill_sglang.stage_pools import slot_bytes_per_layer


def test_the_absorbed_form_replaces_the_multi_head_forms_only():
    forward_methods = pytest.importorskip(
        "sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods")
    method = forward_methods.AttnForwardMethod
    picked = {}
    sublayer = SimpleNamespace(dispatch_attn_forward_method=lambda fb: picked["method"])
    _run_absorbed(sublayer)
    for upstream, served in ((method.MHA, method.MLA), (method.MHA_ONE_SHOT, method.MLA),
                             (method.MHA_CHUNKED_KV, method.MLA), (method.MLA, method.MLA),
                             (method.MLA_FUSED_ROPE_CPU, method.MLA_FUSED_ROPE_CPU)):
        picked["method"] = upstream
        assert sublayer.dispatch_attn_forward_method(None) is served


def test_an_mla_slot_holds_its_latent_and_rope_key_once_per_layer():
    latent = [torch.empty(8, 1, 48 + 16, dtype=torch.bfloat16) for _ in range(3)]
    mla_pool = SimpleNamespace(kv_buffer=latent)
    assert slot_bytes_per_layer(mla_pool) == [(48 + 16) * 2] * 3
    k = [torch.empty(8, 2, 16) for _ in range(2)]
    assert slot_bytes_per_layer(SimpleNamespace(k_buffer=k, v_buffer=k)) == [2 * 2 * 16 * 4] * 2


@pytest.mark.parametrize("seed", range(3))
def test_the_drop_reads_absorbed_queries_whole_when_the_rope_part_comes_apart(seed):
    """Triton gets the absorbed query as one tensor, FA3 its latent part and RoPE part apart:
    the rows the drop scores against the pool's latent-then-RoPE keys are the same."""
    gen = torch.Generator().manual_seed(seed)
    tokens, heads, latent, rope = 1 + seed * 7, 3, 48, 16
    attn = SimpleNamespace(tp_q_head_num=heads, qk_head_dim=latent + rope, v_head_dim=latent)
    whole = torch.randn(tokens, heads, latent + rope, generator=gen)
    want = whole.reshape(tokens, heads * (latent + rope))
    assert torch.equal(query_rows(attn, whole), want)
    q_nope, q_rope = whole[..., :latent].contiguous(), whole[..., latent:].contiguous()
    got = query_rows(attn, q_nope.reshape(tokens, heads * latent), q_rope)
    assert torch.equal(got, want)
    gemma_shaped = whole.reshape(1, tokens, heads, latent + rope)
    assert torch.equal(query_rows(attn, gemma_shaped), want)
