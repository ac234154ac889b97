"""Teach a built SGLang model the drop, without copying its code.

Every supported family's decoder layer runs input_layernorm -> self_attn(...) ->
RadixAttention(q, k, v, forward_batch) -> a norm that adds the attention output to the residual
stream, norm(delta, residual) -> mlp; architectures.py names that norm and the per-forward layer
inputs of each family. Three per-instance wrappers are enough:
  * every RadixAttention of a drop layer runs the drop right after its attention;
  * the drop layer's residual norm gathers hidden states and residual to the survivors, so that
    layer's MLP already runs on them (a family whose layer adds the attention output itself,
    LFM2, has no such norm: the next layer's entry gathers);
  * every decoder layer, while the batch is compacted, gets the survivors' original positions
    and position inputs (RoPE cos/sin recomputed for them) and, as a fallback, gathers inputs
    that still have the pre-drop row count.
The drop context comes with the forward batch (context.drop_context): the drop layer's
RadixAttention and each decoder layer receive it; the wrappers on a layer's sublayers, which
SGLang calls without it, read it from the layer's `LayerCall`, set by the layer's entry.
The first drop layer's residual norm also saves every row's residual stream for prefix
re-selection (prefix_checkpoint.py). From the first drop layer on, the MLP (and after it a
linear-attention layer's mixer, in position order, and an attention layer's attention sublayer,
in row order) runs in pieces of at most the chunk size while the batch is compacted: the rows
of earlier chunks that rejoin at the final chunk's first drop must not make a step's
activations there larger than a chunk's. Beyond the rows' hidden state and residual (and, at a
drop layer, the queries its drop scores with) a step then holds one piece's activations
(pieces.py: the drop context's `pieces` names the rows a piece runs). A family with
multi-head latent attention (DeepSeek-V2/V3) runs its attention in the absorbed form from the
first drop layer on (`_run_absorbed`).
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch
from torch import nn

from uniprefill_sglang.context import drop_context
from uniprefill_sglang.drop import drop
from uniprefill_sglang.pieces import in_pieces

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


def drop_attention(model: nn.Module, layer_id: int):
    """The RadixAttention of layer `layer_id` (None: the model has no such layer)."""
    for layer in find_decoder_layers(model) or []:
        attn = _find_radix_attention(layer)
        if attn is not None and attn.layer_id == layer_id:
            return attn
    return None


def query_size(model: nn.Module):
    """Query values per token of one attention layer on this rank (None: no known layer)."""
    for layer in find_decoder_layers(model) or []:
        attn = _find_radix_attention(layer)
        if attn is not None:
            return attn.tp_q_head_num * attn.qk_head_dim
    return None


def mixer_size(model: nn.Module, mlp: str = "mlp") -> int:
    """Outputs per token of the projections (a convolution's included) of the widest decoder
    layer without attention on this rank: a linear-attention or short-convolution layer, its
    MLP left out. 0 for a model whose every layer attends."""
    widest = 0
    for layer in find_decoder_layers(model) or []:
        if _find_radix_attention(layer) is not None:
            continue
        block = getattr(layer, mlp, None)
        inside_mlp = set(block.modules()) if isinstance(block, nn.Module) else set()
        widest = max(widest, sum(_output_width(m) for m in layer.modules()
                                 if m not in inside_mlp))
    return widest


def _output_width(module: nn.Module) -> int:
    """Outputs per token of a linear projection on this rank (SGLang's parallel linears or
    torch's); 0 for any other module."""
    if isinstance(module, nn.Linear):
        return module.out_features
    if not (hasattr(module, "input_size") and hasattr(module, "output_size")):
        return 0  # not a linear of SGLang's either
    # Column-parallel linears shard their outputs; row-parallel and replicated ones do not.
    return int(getattr(module, "output_size_per_partition", module.output_size))


class LayerCall:
    """The drop context of a decoder layer's call while it runs, for the wrappers on its
    sublayers (residual norm, MLP, mixer, attention sublayer), which SGLang calls without the
    forward batch: the layer's entry sets it from its `forward_batch` argument and clears it
    when the layer returns."""
    __slots__ = ("ctx",)

    def __init__(self):
        self.ctx = None


def _forward_batch_argument(signature):
    """A function that finds the `forward_batch` argument of a call to a decoder layer's
    forward: by position or by name (every family passes it one way or the other)."""
    names = list(signature.parameters)
    position = names.index("forward_batch") if "forward_batch" in names else None

    def find(args, kwargs):
        if position is not None and position < len(args):
            return args[position]
        return kwargs.get("forward_batch")

    return find


def _wrap_layer_entry(layer: nn.Module, inner: nn.Module, shape, call: LayerCall) -> None:
    original = layer.forward
    signature = inspect.signature(original)
    forward_batch_of = _forward_batch_argument(signature)
    position_inputs = [(name, getattr(inner, attr, None)) for name, attr in shape.position_inputs]

    @functools.wraps(original)
    def forward(*args, **kwargs):
        ctx = call.ctx = drop_context(forward_batch_of(args, kwargs))
        try:
            return on_survivors(ctx, args, kwargs)
        finally:
            call.ctx = None

    def on_survivors(ctx, args, kwargs):
        if ctx is None or not ctx.survivors.compacted:
            return original(*args, **kwargs)
        survivors = ctx.survivors
        bound = signature.bind(*args, **kwargs)
        inputs = bound.arguments
        if inputs.get("residual") is not None:
            inputs["hidden_states"], inputs["residual"] = survivors.apply_pending(
                inputs["hidden_states"], inputs["residual"], ctx.parking)
        survivors.finish_pending()
        # A layer may take the positions by name or through **kwargs (Qwen3-Next's linear
        # layers, which do not use them).
        named = inputs if "positions" in inputs else _var_keywords(signature, inputs)
        positions = named.get("positions")
        if positions is not None:  # [n] (Llama) or [1, n] (Gemma 3)
            named["positions"] = survivors.positions.reshape(*positions.shape[:-1], -1)
        for name, module in position_inputs:
            if inputs.get(name) is not None and module is not None:
                inputs[name] = _survivor_position_input(survivors, name, module,
                                                        inputs["hidden_states"])
        return original(*bound.args, **bound.kwargs)

    layer.forward = forward


def _var_keywords(signature, inputs) -> dict:
    """The dict a signature's **kwargs parameter collected in `inputs` (empty if none)."""
    for name, param in signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            return inputs.setdefault(name, {})
    return {}


def _survivor_position_input(survivors, name, module, hidden_states):
    """A per-forward position input (RoPE cos/sin) for the current survivors, computed once per
    drop and shared by the layers after it."""
    cache = survivors.position_inputs
    hit = cache.get(name)
    if hit is None or hit[0] is not survivors.positions:
        hit = (survivors.positions, module(hidden_states, survivors.positions.unsqueeze(0)))
        cache[name] = hit
    return hit[1]


def _wrap_residual_norm(norm: nn.Module, runtime, first_drop: bool, call: LayerCall) -> None:
    original = norm.forward

    @functools.wraps(original)
    def forward(hidden_states, residual=None, *args, **kwargs):
        ctx = call.ctx
        if first_drop and residual is not None:
            _save_checkpoint(runtime, ctx, hidden_states, residual)
        if ctx is not None and ctx.survivors.pending_rows is not None and residual is not None:
            hidden_states, residual = ctx.survivors.apply_pending(hidden_states, residual,
                                                                  ctx.parking)
            ctx.survivors.finish_pending()
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


def query_rows(attn: nn.Module, q: torch.Tensor, q_rope=None) -> torch.Tensor:
    """The attention's queries, a row per token of all its heads' query vectors as its logits
    read them (Gemma 3 passes [1, n, H, D]). MLA's absorbed form on a backend that takes the
    RoPE part apart (FA3) passes the latent part as `q` and the RoPE part as `q_rope`: rejoined
    here, in the order of the pool's latent-then-RoPE keys."""
    heads = attn.tp_q_head_num
    if q_rope is not None:
        q = torch.cat([q.reshape(-1, heads, attn.v_head_dim),
                       q_rope.reshape(-1, heads, attn.qk_head_dim - attn.v_head_dim)], dim=-1)
    return q.reshape(-1, heads * attn.qk_head_dim)


def _wrap_drop_attention(attn: nn.Module, runtime, first_drop: bool) -> None:
    """Drop right after the layer's attention; where the layer runs in pieces (never the first
    drop layer), after the last piece's."""
    original = attn.forward

    @functools.wraps(original)
    def forward(q, k, v, forward_batch, *args, **kwargs):
        q_rows = query_rows(attn, q, kwargs.get("q_rope"))
        if first_drop and not torch.compiler.is_compiling():
            saving = _checkpointing(runtime, drop_context(forward_batch), forward_batch)
            # The norm hook of this layer saves with this batch's slots.
            runtime.checkpoint_batch = forward_batch if saving else None
            slots = forward_batch.out_cache_loc
            if saving and slots is not None and slots.shape[0] == q_rows.shape[0]:
                runtime.checkpoint.save_queries(slots, q_rows)
        out = original(q, k, v, forward_batch, *args, **kwargs)
        ctx = drop_context(forward_batch)
        if ctx is not None and ctx.acts:
            queries = q_rows if ctx.pieces.span is None else ctx.pieces.gather_queries(
                attn.layer_id, q_rows, ctx.survivors.positions.shape[0])
            if queries is not None:
                drop(runtime, ctx, attn, queries)
        return out

    attn.forward = forward


def _wrap_mlp(mlp: nn.Module, runtime, call: LayerCall) -> None:
    """The MLP (row-wise: each row's output depends on that row only) over at most
    `runtime.piece_rows` rows at a time, written into one output."""
    original = mlp.forward
    piece_rows = runtime.piece_rows

    @functools.wraps(original)
    def forward(hidden_states, *args, **kwargs):
        ctx = call.ctx
        n = hidden_states.shape[0]
        if (ctx is None or not ctx.survivors.compacted or n <= piece_rows
                or hidden_states.dim() != 2):
            return original(hidden_states, *args, **kwargs)
        runtime.stats.pieced_mlp_calls += 1
        return in_pieces(lambda start, end: original(hidden_states[start:end], *args, **kwargs),
                          n, piece_rows)

    mlp.forward = forward


def _wrap_linear_mixer(mixer: nn.Module, runtime, call: LayerCall) -> None:
    """A linear-attention mixer over at most `runtime.piece_rows` rows at a time, in position
    order: the drop context's `pieces.span` tells the layer's backend adapter which rows it runs
    (backends/linear_attention.py), and each piece continues the state the one before it left.
    Its projections, convolution and recurrence then hold a piece's activations, not those of
    every rejoining row."""
    original = mixer.forward

    @functools.wraps(original)
    def forward(hidden_states, *args, **kwargs):
        ctx = call.ctx
        n = hidden_states.shape[0]
        if (ctx is None or not ctx.is_extend or not ctx.survivors.compacted
                or n <= runtime.piece_rows or hidden_states.dim() != 2):
            return original(hidden_states, *args, **kwargs)
        runtime.stats.pieced_mixer_calls += 1
        return in_pieces(lambda start, end: original(hidden_states[start:end], *args, **kwargs),
                         n, runtime.piece_rows, ctx.pieces)

    mixer.forward = forward


# The attention sublayer of a decoder layer (projections, RadixAttention, output projection): a
# module (Llama, Qwen2/3, Gemma 3, LFM2) or a method of the layer (Qwen3-Next).
_ATTENTION_SUBLAYERS = ("self_attn", "self_attention")
# Its per-row inputs and the dimension that holds their rows (positions are [n] or Gemma 3's
# [1, n]; Gemma 3's RoPE cos/sin [1, n, D]).
_ROW_INPUTS = {"hidden_states": 0, "positions": -1, "position_embeddings": -2}


def _attention_sublayer(layer: nn.Module, attn: nn.Module):
    """(owner, attribute) of what runs `layer`'s attention sublayer around `attn`, or None."""
    for name in _ATTENTION_SUBLAYERS:
        sub = getattr(layer, name, None)
        if isinstance(sub, nn.Module):
            if any(m is attn for m in sub.modules()):
                return sub, "forward"
        elif callable(sub):
            return layer, name
    return None


def _rows(value, dim: int, start: int, end: int):
    """Rows [start, end) of a per-row input along `dim` (each tensor of a tuple)."""
    if isinstance(value, torch.Tensor):
        return value.narrow(dim, start, end - start)
    if isinstance(value, (tuple, list)):
        return type(value)(_rows(v, dim, start, end) for v in value)
    return value


def _wrap_attention(owner, name: str, runtime, call: LayerCall) -> None:
    """An attention sublayer after the first drop over at most `runtime.piece_rows` survivors at
    a time, in row order, while the batch is compacted: per piece its projections, KV write,
    attention and output projection. The drop context's `pieces.span` tells the layer's backend
    adapter which rows run (backends/common.py `row_piece`): a piece's queries attend to the
    stage's valid prefix, their request's rows in earlier pieces (whose KV those pieces wrote)
    and, causally, the piece's own rows, which is what the whole sublayer's would see."""
    original = getattr(owner, name)
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(*args, **kwargs):
        ctx = call.ctx
        hidden_states = signature.bind(*args, **kwargs).arguments.get("hidden_states")
        if (ctx is None or not ctx.is_extend or not ctx.survivors.compacted
                or not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2
                or hidden_states.shape[0] <= runtime.piece_rows
                or hidden_states.shape[0] != ctx.survivors.positions.shape[0]):
            return original(*args, **kwargs)
        ctx.pieces.attention_calls += 1

        def run(start, end):
            piece = signature.bind(*args, **kwargs)
            for arg, dim in _ROW_INPUTS.items():
                if arg in piece.arguments:
                    piece.arguments[arg] = _rows(piece.arguments[arg], dim, start, end)
            return original(*piece.args, **piece.kwargs)

        return in_pieces(run, hidden_states.shape[0], runtime.piece_rows, ctx.pieces)

    setattr(owner, name, forward)


def _run_absorbed(sublayer: nn.Module) -> None:
    """A multi-head latent attention sublayer (DeepSeek-V2/V3) that runs every extend in its
    absorbed form. For a prefill without a cached prefix SGLang picks the multi-head form: the
    model writes the latent KV itself at every slot of the batch (after a drop its rows are the
    survivors only) and attends over keys decompressed per head, which the latent pool does not
    hold for the rows of earlier pieces or chunks. The absorbed form computes the same attention
    over the latent KV, one KV head of kv_lora_rank + RoPE dims, written by the attention
    backend, where the adapters write the survivors at their own slots; its logits are the
    attention's, so the drop scores its queries against the pool's latent keys. Dense requests
    take it too: top-p 1.0 then runs a dense request's arithmetic, token for token."""
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod)

    multi_head = {AttnForwardMethod.MHA, AttnForwardMethod.MHA_ONE_SHOT,
                  AttnForwardMethod.MHA_CHUNKED_KV}  # SGLang's on CUDA and the CPU
    original = sublayer.dispatch_attn_forward_method

    @functools.wraps(original)
    def dispatch(forward_batch):
        method = original(forward_batch)
        return AttnForwardMethod.MLA if method in multi_head else method

    sublayer.dispatch_attn_forward_method = dispatch


def install(model: nn.Module, runtime, architecture) -> bool:
    """Wrap the model's layers for `runtime`'s schedule, shaped as `architecture`
    (architectures.Architecture) says. False if the model does not have that shape."""
    layers = find_decoder_layers(model)
    if layers is None:
        return False
    shape = architecture.shape
    drop_layers = set(runtime.stages.drop_layers)
    # (layer, its attention) for every real layer (a pipeline-parallel placeholder has none).
    attending = [(layer, attn) for layer in layers
                 if (attn := _find_radix_attention(layer)) is not None]
    if shape.residual_norm is not None and any(
            getattr(layer, shape.residual_norm, None) is None
            for layer, attn in attending if attn.layer_id in drop_layers):
        return False
    calls = {id(layer): LayerCall() for layer in layers}
    for layer in layers:  # linear-attention layers too: they run on the survivors
        _wrap_layer_entry(layer, model.model, shape, calls[id(layer)])
    first = runtime.stages.drop_layers[0] if runtime.stages.drop_layers else len(layers)
    for i, layer in enumerate(layers):
        call = calls[id(layer)]
        mlp = getattr(layer, shape.mlp, None)
        if i >= first and isinstance(mlp, nn.Module) and runtime.piece_rows > 0:
            _wrap_mlp(mlp, runtime, call)
        mixer = getattr(layer, shape.linear_mixer, None) if shape.linear_mixer else None
        if i > first and isinstance(mixer, nn.Module) and runtime.piece_rows > 0:
            _wrap_linear_mixer(mixer, runtime, call)
        attn = _find_radix_attention(layer) if i > first and runtime.piece_rows > 0 else None
        sublayer = _attention_sublayer(layer, attn) if attn is not None else None
        if sublayer is not None:
            _wrap_attention(*sublayer, runtime, call)
        if shape.latent_attention and i >= first and hasattr(layer, "self_attn"):
            _run_absorbed(layer.self_attn)
    for layer, attn in attending:
        if attn.layer_id in drop_layers:
            first_drop = attn.layer_id == runtime.stages.drop_layers[0]
            _wrap_drop_attention(attn, runtime, first_drop)
            if shape.residual_norm is not None:
                _wrap_residual_norm(getattr(layer, shape.residual_norm), runtime, first_drop,
                                    calls[id(layer)])
            if first_drop:
                # Parking needs the state right after the drop layer's attention.
                runtime.parking.enabled = True
    logger.info("UniPrefill: drop layers %s installed on %d decoder layers",
                sorted(drop_layers), len(layers))
    return True
