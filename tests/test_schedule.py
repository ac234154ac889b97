"""The schedule resolved once from a model's facts (schedule.py): drop layers, KV layout,
checkpoint and the dense reason, for the model families and server settings that decide them."""

import dataclasses
from types import SimpleNamespace

import pytest

from uniprefill_sglang.config import UniPrefillConfigError, build_config
from uniprefill_sglang.schedule import NO_DROP_LAYERS, ModelFacts, resolve

LLAMA = ModelFacts(("LlamaForCausalLM",), 32, 4096, None, frozenset({"flashinfer"}), 8192)
QWEN3_NEXT = ModelFacts(("Qwen3NextForCausalLM",), 48, 2048,
                        tuple((["linear_attention"] * 3 + ["full_attention"]) * 12),
                        frozenset({"flashinfer"}))


def _config(**kwargs):
    base = dict(top_p=None, keep_ratio=None, block_size=64, sink_tokens=128, last_queries=128,
                drop_layers=None, min_prompt_tokens=0)
    return build_config(**{**base, **kwargs})


def _server(**kwargs):
    return SimpleNamespace(**{"disable_radix_cache": False, "attention_backend": "flashinfer",
                              "enable_deterministic_inference": False, **kwargs})


def test_llama_defaults_drop_on_the_shared_layout_without_a_checkpoint():
    schedule = resolve(_config(), LLAMA, _server())
    assert schedule.drop_layers == (7, 11, 15, 19, 23, 27)
    assert schedule.stages.stage(7) == 0 and schedule.stages.stage(8) == 1
    assert not schedule.staged and schedule.stage_layout is None
    assert not schedule.checkpoint and schedule.dense_reason is None


def test_keep_ratios_size_the_staged_pools_and_reselect_keeps_the_checkpoint():
    schedule = resolve(_config(keep_ratio="0.5,0.8", prefix_policy="reselect"), LLAMA, _server())
    assert schedule.staged and schedule.checkpoint
    assert schedule.stage_fractions[:2] == pytest.approx((0.52, 0.42))
    assert schedule.stage_layout.min_slots == LLAMA.context_len + 1
    # Without the radix cache there is no prefix to re-select over.
    assert not resolve(_config(prefix_policy="reselect"), LLAMA,
                       _server(disable_radix_cache=True)).checkpoint


def test_staged_layout_is_refused_where_it_cannot_serve():
    staged = _config(keep_ratio="0.5")
    assert not resolve(staged, LLAMA, _server(), use_mla=True).staged
    triton = dataclasses.replace(LLAMA, attention_backends=frozenset({"triton"}))
    assert resolve(staged, triton, _server(attention_backend="triton")).staged
    assert not resolve(staged, triton, _server(attention_backend="triton",
                                               enable_deterministic_inference=True)).staged


def test_qwen3_next_drops_only_without_the_radix_cache_and_keeps_the_shared_layout():
    on = resolve(_config(keep_ratio="0.5"), QWEN3_NEXT, _server())
    assert on.drop_layers == () and "radix cache is on" in on.dense_reason
    off = resolve(_config(keep_ratio="0.5"), QWEN3_NEXT, _server(disable_radix_cache=True))
    assert off.drop_layers == tuple(range(7, 47, 4)) and not off.staged


def test_no_drop_layers_and_unsupported_models_say_why():
    assert resolve(_config(drop_layers="none"), LLAMA, _server()).dense_reason == NO_DROP_LAYERS
    gpt2 = ModelFacts(("GPT2LMHeadModel",), 12, 768, None, frozenset({"flashinfer"}))
    assert "unsupported architecture GPT2LMHeadModel" in resolve(
        _config(), gpt2, _server()).dense_reason
    with pytest.raises(UniPrefillConfigError, match="out of range"):
        resolve(_config(drop_layers="40"), LLAMA, _server())
