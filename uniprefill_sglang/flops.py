"""Prefill FLOPs with the tokens each drop stage holds, every layer priced at its own kind.

The FLOP-ideal speedup of a drop schedule is dense prefill FLOPs over UniPrefill's, for the
tokens actually kept (`kept[s]`: the rows stage s runs on; `kept[0]` the prompt). Per layer:

* the token mixer on the rows entering the layer: its projections (2 FLOPs per parameter per
  row) plus, by kind, causal attention over all earlier rows (full attention), over the rows
  within its window (sliding-window attention, the window measured in original positions), a
  recurrent state update and read-out per row (linear attention, e.g. Gated DeltaNet), or a
  short depthwise convolution and its two gates per row (LFM2's gated short convolution);
* the MLP on the rows leaving it (at a drop layer the survivors: the drop comes right after the
  layer's attention); an MoE block per row as its router, the top-k experts the row is routed
  to, and a shared expert with its gate where the family has one (Qwen2-MoE, Qwen3-Next).
  SGLang builds every layer of Qwen2-MoE and Qwen3-MoE sparse (`mlp_only_layers` unread);
  DeepSeek's first `first_k_dense_replace` layers keep a dense MLP.

Multi-head latent attention (DeepSeek-V2/V3) is counted as the model defines it: its low-rank
query and latent KV projections, the latent's decompression to per-head keys and values, and
attention with queries and keys of qk_nope + qk_rope dims and values of v_head_dim. (Served
after a drop in the absorbed form, its attention reads kv_lora_rank + rope dims per pair instead,
and the ideal leaves that out.)

After a drop the survivors of a sliding-window layer are spread over the whole prompt; the
model takes them as evenly spread, so a window of W positions holds about W * kept / prompt of
them. Norms, embeddings and the logits are left out (the same on both sides, or small).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Optional, Sequence, Tuple

from uniprefill_sglang.architectures import (
    LINEAR_ATTENTION,
    SHORT_CONV,
    SLIDING_ATTENTION,
    config_layer_types,
    layer_kinds,
)


@dataclasses.dataclass(frozen=True)
class FlopShape:
    """What the FLOP count needs of a model, per token and per layer kind."""
    num_heads: int
    head_dim: int  # of queries and keys
    attention_params: int  # q/k/v/o projections of a (full or sliding) attention layer
    mlp_params: int  # the MLP, or the router and the experts one token runs through
    layer_kinds: Tuple[str, ...]
    sliding_window: int = 0  # a query sees keys at most this many positions back
    linear_params: int = 0  # projections of a linear-attention layer
    linear_state_flops: int = 0  # its state update and read-out, per token
    conv_params: int = 0  # projections of a gated short-convolution layer (LFM2)
    conv_mix_flops: int = 0  # its depthwise convolution and gates, per token
    v_head_dim: int = 0  # of values, where it differs from head_dim (MLA)
    dense_mlp_layers: int = 0  # the first layers, with a dense MLP of dense_mlp_params
    dense_mlp_params: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @classmethod
    def from_config(cls, cfg) -> "FlopShape":
        """From a Hugging Face config object or a config.json dict (its text config for a
        multimodal model). A dict gives layer kinds only where it lists them (`layer_types`);
        transformers' config object derives them (Gemma 3's from its sliding-window pattern)."""
        if isinstance(cfg, dict):
            cfg = SimpleNamespace(**(cfg.get("text_config") or cfg))
        else:
            cfg = getattr(cfg, "text_config", None) or cfg

        def get(key):
            return getattr(cfg, key, None)

        h, heads = get("hidden_size"), get("num_attention_heads")
        kv_heads = get("num_key_value_heads") or heads
        d = get("head_dim") or h // heads
        q_out = heads * d * (2 if get("attn_output_gate") else 1)  # Qwen3-Next gates its output
        attention_params = h * (q_out + 2 * kv_heads * d) + heads * d * h
        v = 0
        if get("kv_lora_rank"):  # multi-head latent attention
            d = get("qk_nope_head_dim") + get("qk_rope_head_dim")
            v = get("v_head_dim")
            attention_params = _latent_attention_params(get, h, heads, d, v)
        first_dense = get("first_k_dense_replace") or 0
        return cls(
            num_heads=heads, head_dim=d, v_head_dim=v,
            attention_params=attention_params,
            mlp_params=_mlp_params(get, h),
            dense_mlp_layers=first_dense,
            dense_mlp_params=3 * h * _mlp_width(get) if first_dense else 0,
            layer_kinds=layer_kinds(config_layer_types(cfg), get("num_hidden_layers")),
            sliding_window=get("sliding_window") or 0,
            linear_params=_linear_params(get, h), linear_state_flops=_linear_state_flops(get),
            conv_params=4 * h * h if get("conv_L_cache") else 0,
            conv_mix_flops=2 * h * (get("conv_L_cache") + 1) if get("conv_L_cache") else 0)


def _latent_attention_params(get, h: int, heads: int, qk: int, v: int) -> int:
    """MLA's projections: queries (through a q_lora_rank bottleneck where the model has one),
    the latent and the shared RoPE key, the latent's decompression to per-head nope keys and
    values, and the output."""
    q_rank, kv_rank, rope = get("q_lora_rank"), get("kv_lora_rank"), get("qk_rope_head_dim")
    q = q_rank * (h + heads * qk) if q_rank else h * heads * qk
    nope = qk - rope
    return q + h * (kv_rank + rope) + kv_rank * heads * (nope + v) + heads * v * h


def _mlp_params(get, h: int) -> int:
    """Parameters one token's MLP runs through (each a gate, up and down projection): the dense
    MLP's, or an MoE block's router, its top-k routed experts (each `moe_intermediate_size`
    wide; Mixtral's `intermediate_size`) and the shared expert and its one-output gate
    (DeepSeek: `n_shared_experts` of the routed experts' width, ungated)."""
    top_k = get("num_experts_per_tok")
    experts = get("num_experts") or get("num_local_experts") or get("n_routed_experts") or 0
    if not top_k or not (experts or get("moe_intermediate_size")):
        return 3 * h * _mlp_width(get)
    expert_width = get("moe_intermediate_size") or get("intermediate_size")
    gated = get("shared_expert_intermediate_size") or 0
    shared = gated + (get("n_shared_experts") or 0) * expert_width
    return h * experts + 3 * h * (top_k * expert_width + shared) + (h if gated else 0)


def _mlp_width(get) -> int:
    """A dense MLP's intermediate width."""
    width = get("intermediate_size")
    if get("block_auto_adjust_ff_dim"):  # LFM2 sizes its SwiGLU as SGLang's Lfm2MLP does
        width = int(2 * width / 3)
        if get("block_ffn_dim_multiplier") is not None:
            m = get("block_multiple_of")
            width = m * -(-int(get("block_ffn_dim_multiplier") * width) // m)
    return width


def _linear_params(get, h: int) -> int:
    """Gated DeltaNet projections: q, k, v and the output gate in, two gates per value head,
    the output back."""
    hk, hv = get("linear_num_key_heads"), get("linear_num_value_heads")
    if not hk or not hv:
        return 0
    dk, dv = get("linear_key_head_dim"), get("linear_value_head_dim")
    return h * (2 * hk * dk + 2 * hv * dv + 2 * hv) + hv * dv * h


def _linear_state_flops(get) -> int:
    """Per token: the state update (a rank-one write) and the read-out, each a dk x dv product
    per value head."""
    hv = get("linear_num_value_heads")
    return 4 * hv * get("linear_key_head_dim") * get("linear_value_head_dim") if hv else 0


def attended_pairs(n: int, window: Optional[int] = None) -> int:
    """Query-key pairs of causal attention over n rows in position order, each row seeing at
    most `window` rows (itself included; None: all earlier rows)."""
    w = n if window is None else max(1, min(n, window))
    return w * (w + 1) // 2 + (n - w) * w


def layer_flops(shape: FlopShape, kind: str, n: int, prompt_len: int,
                attention_density: float = 1.0) -> float:
    """The token mixer of one layer of `kind` on n rows of a prompt of `prompt_len` tokens; a
    full-attention layer attends `attention_density` of its causal pairs (block-sparse
    attention; sliding-window layers stay dense, as served)."""
    if kind == LINEAR_ATTENTION:
        return 2.0 * shape.linear_params * n + shape.linear_state_flops * n
    if kind == SHORT_CONV:
        # in_proj to (B, C, x), out_proj back; B*x, the kernel's taps and C*y per channel.
        return 2.0 * shape.conv_params * n + shape.conv_mix_flops * n
    window, density = None, attention_density
    if kind == SLIDING_ATTENTION and shape.sliding_window:
        window = round((shape.sliding_window + 1) * n / max(prompt_len, 1))
        density = 1.0
    # QK^T and PV: 2 FLOPs per multiply-add, per head and pair the query/key and value dims.
    dims = shape.head_dim + (shape.v_head_dim or shape.head_dim)
    return 2.0 * shape.attention_params * n + 2.0 * shape.num_heads * dims * \
        attended_pairs(n, window) * density


def prefill_flops(kept: Sequence[int], drop_layers: Sequence[int], shape: FlopShape,
                  attention_density: float = 1.0) -> float:
    """Prefill FLOPs of one prompt whose stage s holds `kept[s]` rows (the last repeats), its
    full-attention layers attending `attention_density` of their causal pairs."""
    total, stage = 0.0, 0
    for layer, kind in enumerate(shape.layer_kinds):
        total += layer_flops(shape, kind, kept[min(stage, len(kept) - 1)], kept[0],
                             attention_density)
        if stage < len(drop_layers) and layer == drop_layers[stage]:
            stage += 1
        mlp = shape.dense_mlp_params if layer < shape.dense_mlp_layers else shape.mlp_params
        total += 2.0 * mlp * kept[min(stage, len(kept) - 1)]
    return total


def flop_ideal_speedup(kept_per_prompt: Sequence[Sequence[int]], drop_layers: Sequence[int],
                       shape: FlopShape, attention_density: float = 1.0) -> float:
    """Dense FLOPs over UniPrefill FLOPs (with block-sparse attention at `attention_density`),
    summed over the prompts."""
    dense = sum(prefill_flops([k[0]], (), shape) for k in kept_per_prompt)
    sparse = sum(prefill_flops(k, drop_layers, shape, attention_density) for k in kept_per_prompt)
    return dense / sparse if sparse else 1.0

