"""The model families UniPrefill serves: one table entry each, no per-model code.

An entry says how SGLang's decoder layer of that family is shaped (`DecoderShape`: where the
attention output joins the residual stream, which layer inputs are computed once per forward
from the positions), which kinds of attention layer it may hold (Hugging Face `layer_types`),
and its default drop schedule. model_integration.py wraps any model through its entry, the
attention adapters read each layer's kind from its RadixAttention (a sliding window attends to
the survivors within the window, measured in original positions), and config.py validates
schedules against it. Another hybrid (e.g. alternating sliding-window and full layers) is one
more entry here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, Optional, Sequence, Tuple

from uniprefill_sglang import environ

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LINEAR_ATTENTION = "linear_attention"
SHORT_CONV = "conv"  # LFM2's gated short convolution layers

# The paper's schedule for the 32-layer Llama-3.1-8B; other depths scale it proportionally.
_REFERENCE_DEPTH = 32
_REFERENCE_DROP_LAYERS = (7, 11, 15, 19, 23, 27)


@dataclasses.dataclass(frozen=True)
class DecoderShape:
    # The norm called as norm(delta, residual) that adds the attention output to the residual
    # stream: the drop gathers both to the survivors there, so the layer's MLP runs on them.
    # None where the layer adds the attention output itself: the next layer's entry gathers
    # its inputs, and the drop layer's own MLP runs on every row.
    residual_norm: Optional[str]
    # Layer keyword inputs computed once per forward from the positions, per name the inner
    # model's module that computes them as module(hidden_states, positions[None]) (Gemma 3's
    # RoPE cos/sin); recomputed for the survivors after a drop.
    position_inputs: Tuple[Tuple[str, str], ...] = ()
    # The layer's MLP (or MoE block): row-wise, so it may run over the rows in pieces.
    mlp: str = "mlp"
    # A linear-attention or short-convolution layer's mixer, called as mixer(hidden_states,
    # forward_batch): it runs over the rows in pieces in position order, each piece starting
    # from the recurrent and convolution state the one before it left, as chunked prefill's
    # chunks do. None: the family has no such layer.
    linear_mixer: Optional[str] = None
    # Multi-head latent attention (DeepSeek-V2/V3): the attention sublayer picks its form per
    # forward (`dispatch_attn_forward_method`). True: from the first drop layer on, every extend
    # runs the absorbed form over the latent KV (model_integration.py says why).
    latent_attention: bool = False


# Llama, Mistral, Qwen2, Qwen3: input_layernorm -> self_attn -> post_attention_layernorm(h, res)
# -> mlp; the layer is called as layer(positions, hidden_states, forward_batch, residual).
LLAMA = DecoderShape(residual_norm="post_attention_layernorm")
# Gemma 3: attention output -> post_attention_layernorm(h) -> pre_feedforward_layernorm(h, res)
# -> mlp -> post_feedforward_layernorm; called with keywords, RoPE cos/sin passed in.
GEMMA3 = DecoderShape(
    residual_norm="pre_feedforward_layernorm",
    position_inputs=(("position_embeddings_global", "rotary_emb"),
                     ("position_embeddings_local", "rotary_emb_local")))

# LFM2: operator_norm -> self_attn or conv -> "+ residual" in the layer's own code -> ffn_norm ->
# feed_forward; called as layer(layer_id=, positions=, hidden_states=, residual=, forward_batch=),
# where `residual` is the previous layer's input (non-None from the second layer on).
LFM2 = DecoderShape(residual_norm=None, mlp="feed_forward", linear_mixer="conv")
# Mixtral: the Llama shape, its MoE block named `block_sparse_moe`. (Qwen2-MoE and Qwen3-MoE keep
# theirs as `mlp`: the Llama shape itself.)
MIXTRAL = DecoderShape(residual_norm="post_attention_layernorm", mlp="block_sparse_moe")
# Qwen3-Next: the Llama shape, and Gated DeltaNet layers whose mixer is `linear_attn`.
QWEN3_NEXT = DecoderShape(residual_norm="post_attention_layernorm", linear_mixer="linear_attn")
# DeepSeek-V2/V3: the Llama shape (its MoE block, or a first layer's dense MLP, is `mlp`) with
# multi-head latent attention.
DEEPSEEK_MLA = DecoderShape(residual_norm="post_attention_layernorm", latent_attention=True)


def scaled_reference_layers(num_layers: int, full_layers: Sequence[int] = ()) -> tuple:
    """The reference schedule scaled to `num_layers` (7/32, 11/32, ... 27/32 of the depth)."""
    layers = sorted({round(d * num_layers / _REFERENCE_DEPTH) for d in _REFERENCE_DROP_LAYERS})
    return tuple(l for l in layers if 0 < l < num_layers - 1)


def full_layers_from_depth(fraction: float) -> Callable[[int, Sequence[int]], tuple]:
    """Drop at every full-attention layer from `fraction` of the depth on, except the last
    layer (nothing after it to save). Gemma-3-12B (48 layers, global every sixth from 5) at
    0.6: 29, 35, 41, the paper's schedule."""
    def rule(num_layers: int, full_layers: Sequence[int]) -> tuple:
        start = math.ceil(fraction * num_layers)
        return tuple(l for l in full_layers if start <= l < num_layers - 1)
    return rule


def scaled_reference_full_layers(num_layers: int, full_layers: Sequence[int]) -> tuple:
    """The reference schedule scaled to `num_layers`, each layer moved on to the first
    full-attention layer at or after it (drops happen there only), except the last layer.
    gpt-oss-20b (24 layers, full attention at the odd ones): 5, 8, 11, 14, 17, 20 become
    5, 9, 11, 15, 17, 21."""
    full = sorted(full_layers)
    moved = {next((f for f in full if f >= l), None)
             for l in scaled_reference_layers(num_layers)}
    return tuple(sorted(l for l in moved if l is not None and l < num_layers - 1))


def full_layers_from_layer(first: int, of_depth: int) -> Callable[[int, Sequence[int]], tuple]:
    """Drop at every full-attention layer from layer `first` of a `of_depth`-layer model on
    (scaled to other depths), except the last layer."""
    def rule(num_layers: int, full_layers: Sequence[int]) -> tuple:
        start = round(first * num_layers / of_depth)
        return tuple(l for l in full_layers if start <= l < num_layers - 1)
    return rule


@dataclasses.dataclass(frozen=True)
class Architecture:
    names: frozenset
    shape: DecoderShape
    # Attention kinds its layers may have; drops happen at full-attention layers only.
    layer_kinds: frozenset = frozenset({FULL_ATTENTION})
    # (num_layers, full-attention layers) -> the default drop layers.
    default_drop_layers: Callable[[int, Sequence[int]], tuple] = scaled_reference_layers
    # Its default top-p where it differs from config.DEFAULT_TOP_P (None: the general default).
    top_p: Optional[float] = None
    # Layers with a recurrent state (linear attention). SGLang caches that state per prefix
    # (its radix cache's state component), and after a drop a later layer's state covers the survivors only, which
    # re-selection over a cached prefix (prefix_reuse.py) cannot recompute: UniPrefill turns the
    # radix cache off for such a family, unless UNIPREFILL_HYBRID_PREFIX_CACHE keeps it with
    # reuse only (server_args.py). Its KV pool holds the full-attention layers only: it keeps
    # the shared KV layout.
    recurrent_state: bool = False
    # Does SGLang serve it on FlashInfer? gpt-oss's learned attention sinks it serves on triton,
    # fa3, trtllm_mha and vendor backends only (it refuses to start on FlashInfer).
    flashinfer: bool = True
    # The attention backends whose adapter serves it (None: every one UniPrefill supports);
    # elsewhere its requests run dense, saying why (config.py).
    attention_backends: Optional[frozenset] = None
    # Backends whose adapter is written for it but has not passed its GPU tests: served only
    # under UNIPREFILL_PREVIEW_BACKENDS (environ.py), otherwise as any backend not named above.
    preview_backends: frozenset = frozenset()

    def served_backends(self) -> Optional[frozenset]:
        """The attention backends it is served on in this process (None: every one)."""
        if self.attention_backends is None or not environ.PREVIEW_BACKENDS.get():
            return self.attention_backends
        return self.attention_backends | self.preview_backends


ARCHITECTURES: Tuple[Architecture, ...] = (
    Architecture(frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                            "Qwen3ForCausalLM"}), LLAMA),
    # Mixtures of experts on the Llama pattern: the router and the top-k experts (and Qwen2-MoE's
    # gated shared expert) run per row, so after a drop they run over the survivors only,
    # through the MoE path SGLang picks (its top-k masks rows past the batch's non-padded count,
    # a bound the survivors stay under). The paper has no MoE run: the default is the Llama rule
    # scaled by depth (Mixtral-8x7B, 32 layers: the paper's 7 ... 27; Qwen3-30B-A3B, 48 layers:
    # 10, 16, 22, 28, 34, 40); not measured.
    Architecture(frozenset({"Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"}), LLAMA),
    Architecture(frozenset({"MixtralForCausalLM"}), MIXTRAL),
    # The paper's Gemma-3 runs: drops at its global layers from 60% depth, top-p 0.975.
    Architecture(frozenset({"Gemma3ForCausalLM"}), GEMMA3,
                 layer_kinds=frozenset({FULL_ATTENTION, SLIDING_ATTENTION}),
                 default_drop_layers=full_layers_from_depth(0.6), top_p=0.975),
    # gpt-oss: sliding-window (128) and full-attention layers alternating, learned attention
    # sinks (a logit per head in every softmax's denominator), a mixture of experts on the
    # Llama pattern. Drops at full-attention layers; the sliding-window layers after a drop
    # attend to the survivors within their window in original positions (as Gemma 3's), the
    # MoE blocks run over the survivors, and every attention after a drop keeps the sinks in its
    # softmax. The paper has no gpt-oss run: the default is the Llama rule scaled by depth,
    # each layer moved on to the next full-attention layer (gpt-oss-20b, 24 layers:
    # 5, 9, 11, 15, 17, 21); not measured.
    Architecture(frozenset({"GptOssForCausalLM"}), LLAMA,
                 layer_kinds=frozenset({FULL_ATTENTION, SLIDING_ATTENTION}),
                 default_drop_layers=scaled_reference_full_layers, flashinfer=False),
    # DeepSeek-V2/V3 (multi-head latent attention, MoE from `first_k_dense_replace` on): from the
    # first drop layer on the attention runs in its absorbed form, one KV head of the latent
    # (kv_lora_rank) and the shared RoPE key, so the drop scores the absorbed queries against
    # the latent KV in the pool (the attention logits themselves; a final chunk scores its
    # earlier chunks' rows there) and a later stage's view lists latent slots. Served on Triton;
    # FA3's MLA prefill (SGLang's pick on Hopper, decoding on Triton) is a preview; SGLang's
    # FlashInfer MLA backend has no adapter. The paper has no MLA run: the default is the Llama
    # rule scaled by depth (DeepSeek-V2-Lite, 27 layers: 6, 9, 13, 16, 19, 23); not measured.
    Architecture(frozenset({"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"}), DEEPSEEK_MLA,
                 attention_backends=frozenset({"triton"}), preview_backends=frozenset({"fa3"})),
    # Qwen3-Next: three Gated DeltaNet layers per full-attention layer, each called as
    # layer(positions=..., hidden_states=..., residual=..., forward_batch=...), its attention
    # output added to the residual stream by post_attention_layernorm. After a drop the linear
    # layers run their convolution and recurrence over the survivors
    # (backends/linear_attention.py). The schedule is the paper's for Qwen3-Next-80B-A3B (48
    # layers, full attention at 3, 7, ..., 47): every full-attention layer from layer 7 on, as
    # its code records (there disabled). On that shape with random weights, one H200, keep
    # 0.5/0.8, it gave 1.11 / 1.65 / 1.94x TTFT at 8K / 32K / 64K, where the Gemma 3 rule
    # (from 60% depth: 31, 35, 39, 43) gave 1.08 / 1.13 / 1.19x (benchmarks/README.md).
    Architecture(frozenset({"Qwen3NextForCausalLM"}), QWEN3_NEXT,
                 layer_kinds=frozenset({FULL_ATTENTION, LINEAR_ATTENTION}),
                 default_drop_layers=full_layers_from_layer(7, of_depth=48),
                 recurrent_state=True),
    # LFM2 (Liquid): gated short-convolution layers with a conv state per request, and
    # full-attention layers. After a drop the conv layers run over the survivors in order
    # (backends/short_conv.py). The paper has no LFM2 run: the default drops at every
    # full-attention layer from 7/32 of the depth on, where the paper's Llama-3.1-8B schedule
    # starts (LFM2-1.2B, 16 layers, attention at 2, 5, 8, 10, 12, 14: drops at 5 ... 14);
    # not measured.
    Architecture(frozenset({"Lfm2ForCausalLM"}), LFM2,
                 layer_kinds=frozenset({FULL_ATTENTION, SHORT_CONV}),
                 default_drop_layers=full_layers_from_layer(7, of_depth=32),
                 recurrent_state=True),
)

BY_NAME: Dict[str, Architecture] = {n: a for a in ARCHITECTURES for n in a.names}
SUPPORTED_NAMES = frozenset(BY_NAME)


def lookup(architectures: Sequence[str]) -> Optional[Architecture]:
    for name in architectures:
        if name in BY_NAME:
            return BY_NAME[name]
    return None


def config_layer_types(text_config) -> Optional[Tuple[str, ...]]:
    """A model config's per-layer attention kinds (Hugging Face `layer_types`, or SGLang's
    `layers_block_type`), or None when it names none (every layer full attention). SGLang's
    own config of a hybrid linear model (Qwen3-Next) keeps no `layer_types` and names its
    full-attention layers "attention"."""
    kinds = (getattr(text_config, "layer_types", None)
             or getattr(text_config, "layers_block_type", None))
    if not kinds:
        return None
    return tuple(FULL_ATTENTION if k == "attention" else k for k in kinds)


def layer_kinds(layer_types: Optional[Sequence[str]], num_layers: int) -> Tuple[str, ...]:
    """Each layer's attention kind (no `layer_types` in the config: every layer full)."""
    if not layer_types:
        return (FULL_ATTENTION,) * num_layers
    return tuple(layer_types)


def full_attention_layers(layer_types: Optional[Sequence[str]], num_layers: int) -> tuple:
    return tuple(i for i, k in enumerate(layer_kinds(layer_types, num_layers))
                 if k == FULL_ATTENTION)
