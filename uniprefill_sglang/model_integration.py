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
The first drop layer's post-attention norm also saves every row's residual stream for prefix
re-selection (prefix_checkpoint.py).
"""

from __future__ import annotations

import functools
import logging

import torch
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


def query_size(model: nn.Module):
    """Query values per token of one attention layer on this rank (None: no known layer)."""
    for layer in find_decoder_layers(model) or []:
        attn = _find_radix_attention(layer)
        if attn is not None:
            return attn.tp_q_head_num * attn.qk_head_dim
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


def _wrap_post_attention_norm(norm: nn.Module, runtime, first_drop: bool) -> None:
    original = norm.forward

    @functools.wraps(original)
    def forward(hidden_states, residual=None, *args, **kwargs):
        ctx = current()
        if first_drop and residual is not None:
            _save_checkpoint(runtime, ctx, hidden_states, residual)
        if ctx is not None and ctx.pending_rows is not None and residual is not None:
            hidden_states, residual = ctx.apply_pending(hidden_states, residual)
            ctx.finish_pending()
        return original(hidden_states, residual, *args, **kwargs)

    norm.forward = forward


def _checkpointing(runtime, ctx, fb) -> bool:
    """Save the first drop layer's rows (prefix_checkpoint.py)? Eager forwards (they have a
    context) and decode-graph capture do; a prefill graph does not (its slots stay without a
    checkpoint)."""
    if runtime.checkpoint is None or fb is None or torch.compiler.is_compiling():
        return False
    return ctx is not None or fb.forward_mode.is_decode()


def _save_checkpoint(runtime, ctx, hidden_states, residual) -> None:
    """Rows of the first drop layer, before the drop gathers them: one per slot the forward
    writes."""
    fb = runtime.checkpoint_batch
    if not _checkpointing(runtime, ctx, fb):
        return
    slots = fb.out_cache_loc
    if slots is not None and slots.shape[0] == hidden_states.shape[0]:
        runtime.checkpoint.save(slots, hidden_states, residual)


def _wrap_drop_attention(attn: nn.Module, runtime, first_drop: bool) -> None:
    original = attn.forward

    @functools.wraps(original)
    def forward(q, k, v, forward_batch, *args, **kwargs):
        if first_drop and not torch.compiler.is_compiling():
            saving = _checkpointing(runtime, current(), forward_batch)
            # The norm hook of this layer saves with this batch's slots.
            runtime.checkpoint_batch = forward_batch if saving else None
            slots = forward_batch.out_cache_loc
            if saving and slots is not None and slots.shape[0] == q.shape[0]:
                runtime.checkpoint.save_queries(slots, q)
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
            first_drop = attn.layer_id == runtime.stages.drop_layers[0]
            _wrap_drop_attention(attn, runtime, first_drop)
            norm = getattr(layer, "post_attention_layernorm", None)
            if norm is not None:
                _wrap_post_attention_norm(norm, runtime, first_drop)
                if first_drop:
                    # Parking needs the state right after the drop layer's attention.
                    runtime.parking.enabled = True
    logger.info("UniPrefill: drop layers %s installed on %d decoder layers",
                sorted(drop_layers), len(layers))
    return True
