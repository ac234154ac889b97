"""Short-convolution layers (LFM2's gated short conv) after a drop: their causal convolution runs
over the survivors only, in position order, so the conv state a request carries into decode is
the state over its survivors.

SGLang's short-conv backend hands each conv layer its per-step handle through
`conv_state_metadata(layer_id, forward_batch)` (`ShortConvMetadata`: `query_start_loc`, each
request's rows; `has_initial_state`, whether it resumes its slot's state; `cache_indices`, its
state slot), and the layer runs its own `causal_conv1d_fn` against it. After a drop a conv
layer of a later stage gets the handle describing the survivors, by the rule of the Gated
DeltaNet layers (linear_attention.py; both read `common.state_layer_rows`): rows from
`ctx.survivors.lens`; a request resumes its slot's state only where survivors of earlier
forwards (or earlier pieces of this one) passed through this layer; a chunk that parks in this
forward goes on with one row and leaves its slot alone (index -1, which the kernel skips).
Decode steps and the layers before the first drop get upstream's handle.
"""

from __future__ import annotations

import torch

from uniprefill_sglang.backends.common import (StageViewAdapter, active_runtime,
                                               state_layer_rows, view_cache)
from uniprefill_sglang.context import drop_context


class ShortConvAdapter(StageViewAdapter):
    target = "sglang.srt.layers.attention.linear.short_conv_backend.ShortConvAttnBackend"

    def hooks(self):
        return [("conv_state_metadata", conv_state_metadata, "around")]


ADAPTER = ShortConvAdapter()


def _survivor_fields(ctx, meta) -> dict:
    """The handle's fields for the survivors, or the rows of the drop context's `row_piece`
    (model_integration.py runs the conv layer in pieces): built once per forward and piece (the
    rows that reach a later stage's conv layers change only at a drop, and every later stage
    caches its own). A request resumes its slot's state where rows of it passed through the
    layer before: in earlier forwards, or in earlier pieces."""
    layout = state_layer_rows(ctx, meta.cache_indices)
    resumes = [n > 0 for n in layout.before]
    return dict(query_start_loc=layout.query_start_loc,
                has_initial_state=torch.tensor(resumes, dtype=torch.bool).to(layout.slots.device),
                cache_indices=layout.slots,
                slot_ids_cpu=None if meta.slot_ids_cpu is None else layout.slots.tolist(),
                has_prefix_cpu=None if meta.has_prefix_cpu is None else resumes)


def conv_state_metadata(original, backend, layer_id, forward_batch, *args, **kwargs):
    """AROUND `ShortConvAttnBackend.conv_state_metadata`."""
    meta = original(backend, layer_id, forward_batch, *args, **kwargs)
    runtime, ctx = active_runtime(), drop_context(forward_batch)
    if (runtime is None or ctx is None or not ctx.is_extend or not ctx.survivors.compacted
            or runtime.stages.stage(layer_id) == 0):
        return meta
    cache = view_cache(ctx, "_uniprefill_short_conv")
    stage = runtime.stages.stage(layer_id)
    key = (stage, ctx.pieces.span)
    fields = cache.get(key)
    if fields is None:
        fields = cache[key] = _survivor_fields(ctx, meta)
    return meta._replace(**fields)
