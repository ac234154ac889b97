"""The FLOP model (uniprefill_sglang/flops.py) against a plain count: rows at explicit positions,
every query's visible keys counted one by one, layer by layer with the rows each stage holds."""

from __future__ import annotations

import random

import pytest

from uniprefill_sglang.architectures import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    SHORT_CONV,
    SLIDING_ATTENTION,
)
from uniprefill_sglang.flops import (
    FlopShape,
    attended_pairs,
    flop_ideal_speedup,
    layer_flops,
    prefill_flops,
)


def _spread(n: int, prompt_len: int) -> list:
    """n survivors evenly spread over a prompt (the model's assumption after a drop)."""
    return [round(i * prompt_len / n) for i in range(n)]


def _pairs_reference(positions: list, window) -> int:
    """Query-key pairs a causal (window: at most that many positions back) mask lets through."""
    return sum(1 for i, p in enumerate(positions) for q in positions[:i + 1]
               if window is None or q >= p - window)


def _prefill_reference(kept: list, drop_layers: list, shape: FlopShape,
                       density: float = 1.0) -> float:
    prompt, total, stage = kept[0], 0.0, 0
    for layer, kind in enumerate(shape.layer_kinds):
        rows = _spread(kept[min(stage, len(kept) - 1)], prompt)
        n = len(rows)
        if kind == LINEAR_ATTENTION:
            total += 2 * shape.linear_params * n + shape.linear_state_flops * n
        elif kind == SHORT_CONV:
            total += 2 * shape.conv_params * n + shape.conv_mix_flops * n
        else:
            window = shape.sliding_window if kind == SLIDING_ATTENTION else None
            share = 1.0 if kind == SLIDING_ATTENTION else density  # block-sparse: full layers
            total += 2 * shape.attention_params * n + \
                4 * shape.num_heads * shape.head_dim * _pairs_reference(rows, window) * share
        if stage < len(drop_layers) and layer == drop_layers[stage]:
            stage += 1
        total += 2 * shape.mlp_params * kept[min(stage, len(kept) - 1)]
    return total


def test_attended_pairs_counts_the_mask_on_fresh_sizes():
    rng = random.Random()
    for _ in range(40):
        n, window = rng.randrange(1, 300), rng.choice([None, rng.randrange(0, 400)])
        # Dense rows: a window of W positions back holds W + 1 rows.
        want = _pairs_reference(list(range(n)), window)
        assert attended_pairs(n, None if window is None else window + 1) == want


def _random_shape(rng, kinds, window=0) -> FlopShape:
    return FlopShape(num_heads=rng.choice((2, 8)), head_dim=rng.choice((16, 64)),
                     attention_params=rng.randrange(1, 10**6), mlp_params=rng.randrange(1, 10**6),
                     layer_kinds=tuple(kinds), sliding_window=window,
                     linear_params=rng.randrange(1, 10**6), linear_state_flops=rng.randrange(1, 10**4),
                     conv_params=rng.randrange(1, 10**6), conv_mix_flops=rng.randrange(1, 10**4))


def _random_case(rng):
    """A model of mixed layer kinds, a prompt, two drops and the rows each stage keeps."""
    depth = rng.randrange(6, 9)
    kinds = [rng.choice((FULL_ATTENTION, SLIDING_ATTENTION, LINEAR_ATTENTION, SHORT_CONV))
             for _ in range(depth)]
    shape = _random_shape(rng, kinds, window=rng.randrange(8, 64))
    prompt = rng.randrange(150, 300)
    drops = sorted(rng.sample(range(1, depth - 1), 2))
    return shape, prompt, drops, [prompt, rng.randrange(60, prompt), rng.randrange(20, 60)]


def test_prefill_flops_equals_the_count_dense_and_after_drops():
    rng = random.Random()
    for _ in range(6):
        shape, prompt, drops, kept = _random_case(rng)
        # Dense: exact.
        assert prefill_flops([prompt], (), shape) == _prefill_reference([prompt], [], shape)
        # After a drop the window's share is an estimate: within 3% of the explicit count.
        got, want = prefill_flops(kept, drops, shape), _prefill_reference(kept, drops, shape)
        assert got == pytest.approx(want, rel=0.03)


def test_block_sparse_density_scales_the_full_attention_pairs_only():
    rng = random.Random()
    for _ in range(6):
        shape, prompt, drops, kept = _random_case(rng)
        density = rng.uniform(0.05, 1.0)
        assert prefill_flops([prompt], (), shape, density) == pytest.approx(
            _prefill_reference([prompt], [], shape, density), rel=1e-12)
        assert prefill_flops(kept, drops, shape, density) == pytest.approx(
            _prefill_reference(kept, drops, shape, density), rel=0.03)
        # Sparser attention never costs more, and density 1 is the dense count.
        assert flop_ideal_speedup([kept], drops, shape, density) >= \
            flop_ideal_speedup([kept], drops, shape) * (1 - 1e-12)
        assert prefill_flops(kept, drops, shape, 1.0) == prefill_flops(kept, drops, shape)


def test_a_window_costs_less_than_full_attention():
    rng = random.Random(7)
    full = _random_shape(rng, [FULL_ATTENTION] * 8)
    sliding = FlopShape(**{**full.__dict__, "layer_kinds": (SLIDING_ATTENTION,) * 7 +
                           (FULL_ATTENTION,), "sliding_window": 128})
    n = 16384
    assert prefill_flops([n], (), sliding) < prefill_flops([n], (), full)
    assert flop_ideal_speedup([[n, n // 4]], (3,), sliding) > 1.0
    # Keeping a quarter of the rows, spread over the prompt, leaves a quarter in each window:
    # both kinds of attention shrink about 16x.
    no_projection = FlopShape(**{**sliding.__dict__, "attention_params": 0})
    for kind, saving in ((SLIDING_ATTENTION, 16), (FULL_ATTENTION, 16)):
        dense = layer_flops(no_projection, kind, n, n)
        assert dense / layer_flops(no_projection, kind, n // 4, n) == pytest.approx(saving, rel=0.02)


def test_shapes_from_configs():
    from transformers import Gemma3TextConfig

    gemma = FlopShape.from_config(Gemma3TextConfig(num_hidden_layers=12, sliding_window=512,
                                                   hidden_size=640, intermediate_size=2048,
                                                   num_attention_heads=4, num_key_value_heads=1,
                                                   head_dim=256))
    assert [i for i, k in enumerate(gemma.layer_kinds) if k == FULL_ATTENTION] == [5, 11]
    assert gemma.sliding_window == 512 and gemma.mlp_params == 3 * 640 * 2048
    # Qwen3-Next (as config.json): linear layers, a gated q, routed and shared experts.
    next_cfg = dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, attn_output_gate=True,
                    intermediate_size=1024, moe_intermediate_size=128, num_experts_per_tok=2,
                    shared_expert_intermediate_size=256, linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                    layer_types=["linear_attention"] * 3 + ["full_attention"])
    shape = FlopShape.from_config(next_cfg)
    assert shape.layer_kinds == (LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,)
    assert shape.mlp_params == 3 * 256 * (2 * 128 + 256) + 256  # the shared expert's gate too
    assert shape.attention_params == 256 * (2 * 4 * 64 + 2 * 2 * 64) + 4 * 64 * 256
    assert shape.linear_state_flops == 4 * 4 * 32 * 32


def test_lfm2_shape_prices_its_conv_layers_and_sglang_mlp_width():
    # LFM2-1.2B as config.json: SGLang's Lfm2MLP runs int(2 * 12288 / 3) = 8192 wide (a
    # multiple of 256), and each conv layer projects to 3h and back (4h^2 parameters) and mixes
    # with a 3-tap depthwise kernel between two gates.
    import json
    from pathlib import Path

    cfg = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "models" /
                      "lfm2-1.2b" / "config.json").read_text())
    shape = FlopShape.from_config(cfg)
    h = 2048
    assert shape.mlp_params == 3 * h * 8192
    assert shape.conv_params == 4 * h * h and shape.conv_mix_flops == 2 * h * 4
    assert [i for i, k in enumerate(shape.layer_kinds) if k == FULL_ATTENTION] == \
        [2, 5, 8, 10, 12, 14]
    # A conv layer costs its projections, far less than attention over a long prompt.
    n = 32768
    assert layer_flops(shape, SHORT_CONV, n, n) == 2.0 * 4 * h * h * n + 2 * h * 4 * n
    assert layer_flops(shape, SHORT_CONV, n, n) < layer_flops(shape, FULL_ATTENTION, n, n) / 4


def _moe_params_per_token(block, top_k: int) -> int:
    """Parameters one token runs through in a transformers MoE block, counted from its modules:
    the router, `top_k` of the experts (stored stacked, one slice per expert) and the shared
    expert and its gate where the block has them."""
    experts = block.experts
    per_expert = sum(p.numel() for p in experts.parameters()) // experts.num_experts
    shared = [m for name in ("shared_expert", "shared_expert_gate")
              if (m := getattr(block, name, None)) is not None]
    return (block.gate.weight.numel() + top_k * per_expert
            + sum(p.numel() for m in shared for p in m.parameters()))


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_moe_block_prices_the_router_active_experts_and_shared_expert(family):
    """An MoE layer per token is its router, top-k experts and shared expert (Qwen2-MoE), on
    fresh random sizes, against the parameters of the block transformers builds for them; the
    config read as an object and as config.json agree."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    rng = random.Random()
    h, width = rng.choice((32, 48, 64)), rng.randrange(8, 40)
    num_experts, top_k = rng.randrange(4, 9), rng.randrange(1, 4)
    sizes = {"qwen3_moe": dict(moe_intermediate_size=width, num_experts=num_experts),
             "qwen2_moe": dict(moe_intermediate_size=width, num_experts=num_experts,
                               shared_expert_intermediate_size=rng.randrange(8, 80)),
             "mixtral": dict(intermediate_size=width, num_local_experts=num_experts)}[family]
    cfg = transformers.AutoConfig.for_model(
        family, vocab_size=64, hidden_size=h, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts_per_tok=top_k, **sizes)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    want = _moe_params_per_token(model.model.layers[0].mlp, top_k)
    shape = FlopShape.from_config(cfg)
    assert shape.mlp_params == want
    assert FlopShape.from_config(cfg.to_dict()).mlp_params == want
    # Dropped rows skip their experts: the MLP share of prefill scales with the kept rows.
    no_attention = FlopShape(**{**shape.__dict__, "attention_params": 0, "num_heads": 0})
    n, kept = rng.randrange(200, 400), rng.randrange(20, 100)
    assert prefill_flops([n, kept], (0,), no_attention) == 2 * want * kept * 2
    assert prefill_flops([n], (), no_attention) == 2 * want * n * 2


def test_gpt_oss_prices_its_router_active_experts_and_windows():
    """gpt-oss's MoE block per token is its router and top-k experts (biases left out, as
    everywhere), on fresh random sizes, against the weights of the block transformers builds;
    its layers alternate sliding-window and full attention. At the gpt-oss-20b shape the
    per-token weights, with one embedding matrix, are the 3.6B active parameters its model
    card states."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    rng = random.Random()
    h, width = rng.choice((32, 48, 64)), rng.randrange(8, 40)
    num_experts, top_k = rng.randrange(4, 9), rng.randrange(1, 4)
    cfg = transformers.AutoConfig.for_model(
        "gpt_oss", vocab_size=64, hidden_size=h, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=width,
        num_local_experts=num_experts, num_experts_per_tok=top_k, sliding_window=8)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    block = model.model.layers[0].mlp

    def weights(module):
        return sum(p.numel() for name, p in module.named_parameters() if "bias" not in name)

    want = weights(block.router) + top_k * weights(block.experts) // num_experts
    shape = FlopShape.from_config(cfg)
    assert shape.mlp_params == want
    assert FlopShape.from_config(cfg.to_dict()).mlp_params == want
    assert shape.layer_kinds == (SLIDING_ATTENTION, FULL_ATTENTION) * 2
    assert shape.sliding_window == 8
    # gpt-oss-20b (its config.json's sizes)
    big = FlopShape.from_config(dict(
        hidden_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        num_hidden_layers=24, intermediate_size=2880, num_local_experts=32,
        num_experts_per_tok=4, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12))
    active = 24 * (big.attention_params + big.mlp_params) + 201088 * 2880
    assert abs(active / 3.61e9 - 1) < 0.01, active


# DeepSeek-V2-Lite's config.json sizes
DEEPSEEK_V2_LITE = dict(
    hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, num_hidden_layers=27,
    q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=64,
    n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, vocab_size=102400)


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_deepseek_prices_latent_attention_dense_first_layers_and_moe(q_lora_rank):
    """DeepSeek-V2's attention (with and without a query bottleneck), its first dense MLP and
    its MoE blocks (router, top-k routed experts, ungated shared experts), on fresh random
    sizes, against the weights of the layers transformers builds (norms left out); attention
    pairs cost qk_nope + qk_rope dims for the logits and v_head_dim for the values. At the
    DeepSeek-V2-Lite shape the per-token weights, with one embedding matrix, are the 2.4B
    activated parameters its model card states."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    rng = random.Random()
    h, width, heads = rng.choice((32, 48, 64)), rng.randrange(8, 40), rng.choice((2, 4))
    num_experts, top_k, shared = rng.randrange(4, 9), rng.randrange(1, 4), rng.randrange(1, 3)
    nope, rope, v = rng.choice((8, 16)), rng.choice((8, 16)), rng.choice((8, 24))
    cfg = transformers.AutoConfig.for_model(
        "deepseek_v2", vocab_size=64, hidden_size=h, num_hidden_layers=3,
        num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=q_lora_rank,
        kv_lora_rank=rng.randrange(16, 48), qk_nope_head_dim=nope, qk_rope_head_dim=rope,
        v_head_dim=v, intermediate_size=rng.randrange(40, 80), moe_intermediate_size=width,
        n_routed_experts=num_experts, n_shared_experts=shared, num_experts_per_tok=top_k,
        first_k_dense_replace=1)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)

    def weights(module):
        return sum(p.numel() for name, p in module.named_parameters()
                   if "bias" not in name and "norm" not in name)

    dense, moe = model.model.layers[0], model.model.layers[1]
    want_moe = (weights(moe.mlp.gate) + top_k * weights(moe.mlp.experts) // num_experts
                + weights(moe.mlp.shared_experts))
    for shape in (FlopShape.from_config(cfg), FlopShape.from_config(cfg.to_dict())):
        assert shape.attention_params == weights(dense.self_attn)
        assert shape.dense_mlp_layers == 1 and shape.dense_mlp_params == weights(dense.mlp)
        assert shape.mlp_params == want_moe
        assert (shape.head_dim, shape.v_head_dim) == (nope + rope, v)
    n = rng.randrange(50, 100)
    attention_only = FlopShape(**{**shape.__dict__, "attention_params": 0, "mlp_params": 0,
                                  "dense_mlp_params": 0})
    assert prefill_flops([n], (), attention_only) == \
        3 * 2 * heads * (nope + rope + v) * attended_pairs(n)
    lite = FlopShape.from_config(DEEPSEEK_V2_LITE)
    active = (27 * lite.attention_params + lite.dense_mlp_params + 26 * lite.mlp_params
              + 102400 * 2048)
    assert abs(active / 2.4e9 - 1) < 0.03, active
