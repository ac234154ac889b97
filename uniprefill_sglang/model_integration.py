"""Teach a built SGLang model the drop, without copying its code.

SGLang's Llama, Qwen2 and Qwen3 models share one decoder-layer shape:
    layer(positions, hidden_states, forward_batch, residual)
      input_layernorm -> self_attn(positions, ...) -> RadixAttention(q, k, v, forward_batch)
      -> post_attention_layernorm(hidden_states, residual) -> mlp
so three per-instance wrappers are enough:
  * every RadixAttention of a drop layer runs the drop right after its attention;
  * the drop layer's post_attention_layernorm gathers hidden states and residual to the
    survivors, so that layer's MLP already runs on them;
  * every decoder layer, while the batch is compacted, gets the survivors' original positions
    (RoPE) and, as a fallback, gathers inputs that still have the pre-drop row count.
"""

from __future__ import annotations

import functools
import logging

from torch import nn

from uniprefill_sglang.context import current

logger = logging.getLogger(__name__)


def find_decoder_layers(model: nn.Module):
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None) if inner is not None else None
    if isinstance(layers, nn.ModuleList):
        return layers
    return None


def _find_radix_attention(layer: nn.Module):
    from sglang.srt.layers.radix_attention import RadixAttention

    for module in layer.modules():
        if isinstance(module, RadixAttention):
            return module
    return None


def _wrap_layer_entry(layer: nn.Module) -> None:
    original = layer.forward

    @functools.wraps(original)
    def forward(positions, hidden_states, forward_batch, residual=None, *args, **kwargs):
        ctx = current()
        if ctx is not None and ctx.compacted:
            if residual is not None:
                hidden_states, residual = ctx.apply_pending(hidden_states, residual)
            ctx.finish_pending()
            positions = ctx.positions
        return original(positions, hidden_states, forward_batch, residual, *args, **kwargs)

    layer.forward = forward


def _wrap_post_attention_norm(norm: nn.Module) -> None:
    original = norm.forward

    @functools.wraps(original)
    def forward(hidden_states, residual=None, *args, **kwargs):
        ctx = current()
        if ctx is not None and ctx.pending_rows is not None and residual is not None:
            hidden_states, residual = ctx.apply_pending(hidden_states, residual)
            ctx.finish_pending()
        return original(hidden_states, residual, *args, **kwargs)

    norm.forward = forward


def _wrap_drop_attention(attn: nn.Module, runtime) -> None:
    original = attn.forward

    @functools.wraps(original)
    def forward(q, k, v, forward_batch, *args, **kwargs):
        out = original(q, k, v, forward_batch, *args, **kwargs)
        ctx = current()
        if ctx is not None and ctx.is_extend and ctx.plan is not None and ctx.plan.any_enabled:
            runtime.drop(ctx, attn, q)
        return out

    attn.forward = forward


def install(model: nn.Module, runtime) -> bool:
    """Wrap the model's layers for `runtime`'s schedule. False if the model has no known shape."""
    layers = find_decoder_layers(model)
    if layers is None:
        return False
    drop_layers = set(runtime.stages.drop_layers)
    for i, layer in enumerate(layers):
        attn = _find_radix_attention(layer)
        if attn is None:
            continue  # e.g. a pipeline-parallel placeholder
        _wrap_layer_entry(layer)
        if attn.layer_id in drop_layers:
            _wrap_drop_attention(attn, runtime)
            norm = getattr(layer, "post_attention_layernorm", None)
            if norm is not None:
                _wrap_post_attention_norm(norm)
                if attn.layer_id == runtime.stages.drop_layers[0]:
                    # Parking needs the state right after the drop layer's attention.
                    runtime.parking.enabled = True
    logger.info("UniPrefill: drop layers %s installed on %d decoder layers",
                sorted(drop_layers), len(layers))
    return True
