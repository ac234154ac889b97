"""The UniPrefill flags on stock SGLang entry points, and their start-up validation."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from uniprefill_sglang.config import (
    UniPrefillConfigError,
    build_config,
    default_drop_layers,
    unsupported_architecture_reason,
    validate_for_model,
)
from uniprefill_sglang.request_plan import decide
from uniprefill_sglang.schedule import NO_DROP_LAYERS

DEFAULTS = dict(top_p=None, keep_ratio=None, block_size=64, sink_tokens=128, last_queries=128,
                drop_layers=None, min_prompt_tokens=0)


def test_default_schedule_matches_the_paper_for_llama_31_8b_and_scales():
    assert default_drop_layers(32) == (7, 11, 15, 19, 23, 27)
    assert default_drop_layers(30) == (7, 10, 14, 18, 22, 25)
    assert default_drop_layers(64) == (14, 22, 30, 38, 46, 54)
    for depth in (4, 12, 24, 48, 80):
        layers = default_drop_layers(depth)
        assert all(0 < l < depth - 1 for l in layers)
        assert list(layers) == sorted(set(layers))


@pytest.mark.parametrize("override, layout", [
    ({}, "shared"),  # top-p: every stage pool would be full-size, nothing to give back
    ({"keep_ratio": "0.5,0.8"}, "staged"),
    ({"stage_kv_fraction": "0.6"}, "staged"),
    ({"keep_ratio": "0.5", "kv_layout": "shared"}, "shared"),
    ({"kv_layout": "staged"}, "staged"),
])
def test_the_layout_is_staged_by_default_only_where_it_saves_memory(override, layout):
    assert build_config(**{**DEFAULTS, **override}).kv_layout == layout


def test_the_checkpoint_is_kept_on_request_or_for_reselect():
    assert not build_config(**DEFAULTS).prefix_checkpoint  # verify without it reuses the cache
    assert build_config(**DEFAULTS, prefix_checkpoint=True).prefix_checkpoint
    assert build_config(**DEFAULTS, prefix_policy="reselect").prefix_checkpoint


@pytest.mark.parametrize(
    "override, flag",
    [
        (dict(top_p=0.0), "--uniprefill-top-p"),
        (dict(top_p=1.5), "--uniprefill-top-p"),
        (dict(keep_ratio=0.0), "--uniprefill-keep-ratio"),
        (dict(keep_ratio=1.2), "--uniprefill-keep-ratio"),
        (dict(top_p=0.9, keep_ratio=0.5), "mutually exclusive"),
        (dict(block_size=48), "--uniprefill-block-size"),
        (dict(block_size=0), "--uniprefill-block-size"),
        (dict(sink_tokens=-1), "--uniprefill-sink-tokens"),
        (dict(last_queries=0), "--uniprefill-last-queries"),
        (dict(neighbor_blocks=-1), "--uniprefill-neighbor-blocks"),
        (dict(min_prompt_tokens=-5), "--uniprefill-min-prompt-tokens"),
        (dict(drop_layers="7,x"), "--uniprefill-drop-layers"),
        (dict(drop_layers="11,7"), "--uniprefill-drop-layers"),
        (dict(drop_layers="-1"), "--uniprefill-drop-layers"),
        (dict(kv_layout="paged"), "--uniprefill-kv-layout"),
        (dict(stage_kv_fraction="0.5,0"), "--uniprefill-stage-kv-fraction"),
        (dict(stage_kv_fraction="1.5"), "--uniprefill-stage-kv-fraction"),
        (dict(max_dropped_mass=-0.01), "--uniprefill-max-dropped-mass must be in \\[0, 1\\]"),
        (dict(max_dropped_mass=1.5), "--uniprefill-max-dropped-mass must be in \\[0, 1\\]"),
        (dict(max_dropped_mass=float("nan")), "--uniprefill-max-dropped-mass"),
        (dict(block_sparse_density=0.0), "--uniprefill-block-sparse-density must be in"),
        (dict(block_sparse_density=1.5), "--uniprefill-block-sparse-density must be in"),
        (dict(block_sparse_top_p=float("nan")), "--uniprefill-block-sparse-top-p must be in"),
        (dict(block_sparse_density=0.3, block_sparse_top_p=0.9), "mutually exclusive"),
        (dict(block_sparse_block_size=8), "--uniprefill-block-sparse-block-size"),
        (dict(block_sparse_block_size=48), "--uniprefill-block-sparse-block-size"),
        (dict(block_sparse_min_tokens=-1), "--uniprefill-block-sparse-min-tokens"),
        (dict(block_sparse_top_p=0.9, block_sparse_estimate="mean"),
         "--uniprefill-block-sparse-estimate must be one of pooled, last_queries, both"),
    ],
)
def test_invalid_knobs_name_the_flag(override, flag):
    with pytest.raises(UniPrefillConfigError, match=flag):
        build_config(**{**DEFAULTS, **override})


def test_drop_layers_checked_against_the_model():
    cfg = build_config(**{**DEFAULTS, "drop_layers": "7,40"})
    with pytest.raises(UniPrefillConfigError, match="out of range.*0..29"):
        validate_for_model(cfg, ["LlamaForCausalLM"], 30)
    cfg = build_config(**{**DEFAULTS, "drop_layers": "5,11"})
    with pytest.raises(UniPrefillConfigError, match="not a full-attention layer"):
        validate_for_model(cfg, ["LlamaForCausalLM"], 30, full_attention_layers=[5, 17, 23])
    # An architecture without an integration runs dense unless layers were forced.
    default = build_config(**DEFAULTS)
    assert validate_for_model(default, ["Gemma2ForCausalLM"], 18) == ()
    with pytest.raises(UniPrefillConfigError, match="no UniPrefill integration"):
        validate_for_model(cfg, ["Gemma2ForCausalLM"], 18)
    assert validate_for_model(default, ["Qwen3ForCausalLM"], 28) == default_drop_layers(28)
    none = build_config(**{**DEFAULTS, "drop_layers": "none"})
    assert validate_for_model(none, ["LlamaForCausalLM"], 30) == ()


GEMMA3_LAYER_TYPES = (["sliding_attention"] * 5 + ["full_attention"]) * 3


def test_gemma3_drops_at_its_global_layers_from_60_percent_depth():
    default = build_config(**DEFAULTS)
    # Gemma-3-270M: global layers 5, 11, 17 of 18; 17 is the last layer.
    assert validate_for_model(default, ["Gemma3ForCausalLM"], 18,
                              layer_types=GEMMA3_LAYER_TYPES) == (11,)
    # Gemma-3-12B: global every sixth layer from 5 of 48 -> the paper's 29, 35, 41.
    assert validate_for_model(default, ["Gemma3ForCausalLM"], 48,
                              layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 8
                              ) == (29, 35, 41)
    assert unsupported_architecture_reason(["Gemma3ForCausalLM"], GEMMA3_LAYER_TYPES,
                                           ["torch_native"]) is None
    with pytest.raises(UniPrefillConfigError, match="not a full-attention layer"):
        validate_for_model(build_config(**{**DEFAULTS, "drop_layers": "5,9"}),
                           ["Gemma3ForCausalLM"], 18, layer_types=GEMMA3_LAYER_TYPES)


def test_gpt_oss_drops_at_full_attention_layers_by_the_scaled_llama_rule():
    default = build_config(**DEFAULTS)
    # gpt-oss-20b: 24 layers, full attention at the odd ones; the Llama rule scaled to 24
    # layers (5, 8, 11, 14, 17, 20), each moved on to the next full-attention layer.
    kinds = ("sliding_attention", "full_attention") * 12
    assert validate_for_model(default, ["GptOssForCausalLM"], 24,
                              layer_types=kinds) == (5, 9, 11, 15, 17, 21)
    # gpt-oss-120b: 36 layers.
    assert validate_for_model(default, ["GptOssForCausalLM"], 36,
                              layer_types=("sliding_attention", "full_attention") * 18
                              ) == (9, 13, 17, 21, 27, 31)
    assert unsupported_architecture_reason(["GptOssForCausalLM"], kinds, ["triton"]) is None
    with pytest.raises(UniPrefillConfigError, match="not a full-attention layer"):
        validate_for_model(build_config(**{**DEFAULTS, "drop_layers": "4"}),
                           ["GptOssForCausalLM"], 24, layer_types=kinds)


def test_deepseek_drops_by_the_scaled_llama_rule_on_triton_only(monkeypatch):
    monkeypatch.delenv("UNIPREFILL_PREVIEW_BACKENDS", raising=False)
    default = build_config(**DEFAULTS)
    # DeepSeek-V2-Lite: 27 layers; DeepSeek-V3: 61.
    for arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        assert validate_for_model(default, [arch], 27, attention_backends=["triton"]) == \
            (6, 9, 13, 16, 19, 23)
    assert validate_for_model(default, ["DeepseekV3ForCausalLM"], 61,
                              attention_backends=["triton"]) == (13, 21, 29, 36, 44, 51)
    # SGLang's MLA backends on a GPU (FA3, FlashInfer's MLA) have no adapter: dense, saying
    # why, or refused where drop layers were asked for.
    reason = unsupported_architecture_reason(["DeepseekV2ForCausalLM"], None, ["fa3", "triton"])
    assert reason is not None and "triton attention backend only (not fa3)" in reason
    assert reason.endswith("--attention-backend triton; fa3 under UNIPREFILL_PREVIEW_BACKENDS=1 "
                           "(a preview)")
    assert validate_for_model(default, ["DeepseekV2ForCausalLM"], 27,
                              attention_backends=["flashinfer"]) == ()
    with pytest.raises(UniPrefillConfigError, match="triton attention backend only"):
        validate_for_model(build_config(**{**DEFAULTS, "drop_layers": "6"}),
                           ["DeepseekV2ForCausalLM"], 27, attention_backends=["fa3"])


def test_deepseek_on_fa3_prefill_is_a_preview_served_only_when_asked_for(monkeypatch):
    default = build_config(**DEFAULTS)
    monkeypatch.setenv("UNIPREFILL_PREVIEW_BACKENDS", "1")
    assert unsupported_architecture_reason(["DeepseekV2ForCausalLM"], None,
                                           ["fa3", "triton"]) is None
    assert validate_for_model(default, ["DeepseekV2ForCausalLM"], 27,
                              attention_backends=["fa3", "triton"]) == (6, 9, 13, 16, 19, 23)
    # FlashInfer's MLA backend has no adapter, preview or not.
    reason = unsupported_architecture_reason(["DeepseekV2ForCausalLM"], None, ["flashinfer"])
    assert reason.endswith("(not flashinfer): --attention-backend fa3 or triton")
    monkeypatch.setenv("UNIPREFILL_PREVIEW_BACKENDS", "0")
    assert "(not fa3)" in unsupported_architecture_reason(["DeepseekV2ForCausalLM"], None,
                                                          ["fa3", "triton"])


def test_qwen3_next_drops_at_its_full_attention_layers_named_either_way():
    from types import SimpleNamespace

    from uniprefill_sglang.architectures import config_layer_types

    default = build_config(**DEFAULTS)
    # Qwen3-Next-80B: 48 layers, full attention every fourth from 3; SGLang's own config names
    # the kinds in layers_block_type ("attention" / "linear_attention"), transformers' in
    # layer_types.
    blocks = (["linear_attention"] * 3 + ["attention"]) * 12
    kinds = config_layer_types(SimpleNamespace(layers_block_type=blocks))
    assert kinds == tuple((["linear_attention"] * 3 + ["full_attention"]) * 12)
    assert config_layer_types(SimpleNamespace(layer_types=list(kinds))) == kinds
    assert config_layer_types(SimpleNamespace()) is None
    # The paper's schedule: every full-attention layer from 7 on (the last layer excepted).
    assert validate_for_model(default, ["Qwen3NextForCausalLM"], 48,
                              layer_types=kinds) == tuple(range(7, 47, 4))
    with pytest.raises(UniPrefillConfigError, match="not a full-attention layer"):
        validate_for_model(build_config(**{**DEFAULTS, "drop_layers": "30"}),
                           ["Qwen3NextForCausalLM"], 48, layer_types=kinds)


def test_sliding_window_layers_need_an_integration_and_a_backend_that_serve_them():
    default = build_config(**DEFAULTS)
    # Gemma 3 on a backend whose adapter has no sliding-window view: dense, saying why.
    reason = unsupported_architecture_reason(["Gemma3ForCausalLM"], GEMMA3_LAYER_TYPES,
                                             ["torch_native", "trtllm_mha"])
    assert "sliding-window layers" in reason and "torch_native" in reason
    assert "(not trtllm_mha)" in reason
    assert validate_for_model(default, ["Gemma3ForCausalLM"], 18, layer_types=GEMMA3_LAYER_TYPES,
                              attention_backends=["torch_native", "trtllm_mha"]) == ()
    # torch_native, Triton, FlashInfer and FA3 all serve them (Gemma-3-270M's default drop:
    # layer 11); gpt-oss's full-attention drop layer on fa3 (SGLang's pick on Hopper) too.
    assert unsupported_architecture_reason(["Gemma3ForCausalLM"], GEMMA3_LAYER_TYPES,
                                           ["torch_native", "triton", "flashinfer", "fa3"]) is None
    assert unsupported_architecture_reason(["GptOssForCausalLM"],
                                           ["sliding_attention", "full_attention"] * 2,
                                           ["fa3", "triton"]) is None
    assert validate_for_model(default, ["Gemma3ForCausalLM"], 18, layer_types=GEMMA3_LAYER_TYPES,
                              attention_backends=["torch_native", "triton"]) == (11,)
    # A Llama-shaped decoder configured with sliding-window layers (e.g. Qwen2 with
    # use_sliding_window) is refused; all-full layer_types are fine.
    reason = unsupported_architecture_reason(["Qwen2ForCausalLM"], GEMMA3_LAYER_TYPES)
    assert "unsupported architecture Qwen2ForCausalLM" in reason and "sliding_attention" in reason
    assert validate_for_model(default, ["Qwen2ForCausalLM"], 18,
                              layer_types=GEMMA3_LAYER_TYPES) == ()
    forced = build_config(**{**DEFAULTS, "drop_layers": "5,11"})
    with pytest.raises(UniPrefillConfigError, match="sliding_attention"):
        validate_for_model(forced, ["Qwen2ForCausalLM"], 18, layer_types=GEMMA3_LAYER_TYPES)
    assert unsupported_architecture_reason(["Qwen2ForCausalLM"], ["full_attention"] * 4) is None
    assert unsupported_architecture_reason(["LlamaForCausalLM"]) is None
    assert unsupported_architecture_reason(["Gemma2ForCausalLM"], GEMMA3_LAYER_TYPES).startswith(
        "unsupported architecture Gemma2ForCausalLM (sliding-window hybrid)")


class _Req:
    def __init__(self, custom_params=None):
        self.sampling_params = type("SP", (), {"custom_params": custom_params})()
        self.rid = "r"


def test_requests_say_why_a_model_without_schedule_runs_dense():
    cfg = build_config(**DEFAULTS)
    assert decide(_Req(), 4096, cfg, NO_DROP_LAYERS, None).reason == NO_DROP_LAYERS
    reason = unsupported_architecture_reason(["Gemma2ForCausalLM"], GEMMA3_LAYER_TYPES)
    d = decide(_Req(), 4096, cfg, reason, None)
    assert not d.enabled and d.reason == reason
    # Switching it off per request still says so.
    assert decide(_Req({"uniprefill": False}), 4096, cfg, reason, None).reason == (
        "disabled by the request")
    assert decide(_Req(), 4096, cfg, None, None).enabled


def test_the_dropped_mass_bound_reaches_the_decision():
    assert build_config(**DEFAULTS).max_dropped_mass is None  # off unless asked for
    cfg = build_config(**DEFAULTS, max_dropped_mass=0.05)
    assert cfg.max_dropped_mass == 0.05
    assert decide(_Req(), 4096, cfg, None, None).max_dropped_mass == 0.05
    knob = {"uniprefill_max_dropped_mass": 0}
    assert decide(_Req(knob), 4096, cfg, None, None).max_dropped_mass == 0.0
    assert decide(_Req(knob), 4096, build_config(**DEFAULTS), None, None).max_dropped_mass == 0.0


def _prepare(argv):
    from launcher_args import launcher_server_args

    return launcher_server_args(argv)


def test_cli_accepts_the_flags(smollm2_path):
    args = _prepare([
        "--model-path", smollm2_path, "--device", "cpu", "--enable-uniprefill",
        "--uniprefill-keep-ratio", "0.5", "--uniprefill-drop-layers", "3,9",
        "--uniprefill-block-size", "32", "--uniprefill-min-prompt-tokens", "1024",
        "--uniprefill-max-dropped-mass", "0.05",
    ])
    assert args.enable_uniprefill and args.uniprefill_keep_ratio == "0.5"
    assert args.attention_backend == "torch_native"  # chosen for the CPU path
    cfg = args.uniprefill_config()
    assert cfg.drop_layers == (3, 9) and cfg.block_size == 32 and cfg.min_tokens_to_drop == 1024
    assert cfg.keep_ratio == (0.5,) and cfg.max_dropped_mass == 0.05
    assert cfg.kv_layout == "staged" and cfg.stage_kv_fraction is None
    assert not cfg.block_sparse and cfg.block_sparse_block_size == 64
    assert cfg.block_sparse_estimate == "pooled"
    cfg = _prepare(["--model-path", smollm2_path, "--device", "cpu", "--enable-uniprefill",
                    "--uniprefill-block-sparse-density", "0.3",
                    "--uniprefill-block-sparse-block-size", "32",
                    "--uniprefill-block-sparse-min-tokens", "256",
                    "--uniprefill-block-sparse-estimate", "both"]).uniprefill_config()
    assert cfg.block_sparse and (cfg.block_sparse_density, cfg.block_sparse_top_p) == (0.3, None)
    assert (cfg.block_sparse_block_size, cfg.block_sparse_min_tokens) == (32, 256)
    assert cfg.block_sparse_estimate == "both"
    cfg = _prepare(["--model-path", smollm2_path, "--device", "cpu", "--enable-uniprefill",
                    "--uniprefill-kv-layout", "shared", "--uniprefill-stage-kv-fraction",
                    "0.6,0.3"]).uniprefill_config()
    assert cfg.kv_layout == "shared" and cfg.stage_kv_fraction == (0.6, 0.3)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--uniprefill-top-p", "1.5"], "--uniprefill-top-p must be in \\(0, 1\\]"),
        (["--uniprefill-drop-layers", "7,40"], "layer 40 is out of range"),
        (["--uniprefill-max-dropped-mass", "2"], "--uniprefill-max-dropped-mass must be in"),
        (["--attention-backend", "flex_attention"], "does not support --attention-backend flex_attention"),
        (["--uniprefill-block-sparse-density", "0.3", "--attention-backend", "flashinfer"],
         "the prefill attention backend flashinfer \\(--attention-backend\\) has no block-sparse"),
        (["--uniprefill-block-sparse-top-p", "2"], "--uniprefill-block-sparse-top-p must be in"),
        (["--pp-size", "2"], "does not support --pp-size > 1"),
        (["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"],
         "cannot be combined with --enable-dp-attention"),
    ],
)
def test_cli_refuses_invalid_flags(smollm2_path, extra, message):
    with pytest.raises(UniPrefillConfigError, match=message):
        _prepare(["--model-path", smollm2_path, "--device", "cpu", "--enable-uniprefill", *extra])


def test_launch_server_refuses_a_bad_flag_at_start_up(smollm2_path):
    """The real `python -m sglang.launch_server` exits before loading anything."""
    from uniprefill_sglang.tools.cpu_engine import cpu_engine_env

    cpu_env = cpu_engine_env()
    proc = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", smollm2_path,
         "--device", "cpu", "--enable-uniprefill", "--uniprefill-block-size", "48"],
        env={**os.environ, **cpu_env}, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode != 0
    assert "--uniprefill-block-size must be a power of two" in proc.stderr + proc.stdout
