"""Gated DeltaNet (linear-attention) layers after a drop: their convolution and recurrence run
over the survivors only, in position order, so the state a request carries into decode is the
state over its survivors.

SGLang's GDN backend reads a packed batch through its forward metadata (`query_start_loc`: each
request's rows; `mamba_cache_indices`: each request's state slot) and the ForwardBatch's
`extend_prefix_lens` (a request with earlier tokens starts from its slot's state) and
`extend_seq_lens_cpu`. After a drop the rows are the survivors (`ctx.survivors.lens` per
request), so a linear layer of a later stage runs with those fields describing them:

* `query_start_loc` from `ctx.survivors.lens`;
* a request starts from its slot's state where the survivors of earlier forwards passed
  through this layer (`ctx.survivors.fixed_lens` > 0). A final chunk whose parked rows rejoin
  at the first drop starts from the prompt's beginning (`fixed_lens` 0): its earlier chunks
  stopped at the first drop, so no row reached this layer before;
* a chunk that parks in this forward goes on with one row (the logits SGLang expects, then
  discarded): its state slot is left alone (index -1, which the kernels skip).
* a mixer run in pieces (model_integration.py, `ctx.pieces.span`) sees the requests with rows
  in the piece, each starting from its slot's state where its earlier rows passed before.

Decode steps and the layers before the first drop run upstream code unchanged. The torch
references of the two operators these fields drive are in `tests/stubs/linear_attention_reference.py`.
"""

from __future__ import annotations

import copy

import torch

from uniprefill_sglang.backends.common import (StageViewAdapter, active_runtime,
                                               state_layer_rows, view_cache)
from uniprefill_sglang.context import drop_context


class GDNAdapter(StageViewAdapter):
    target = "sglang.srt.layers.attention.linear.gdn_backend.GDNAttnBackend"

    def hooks(self):
        return [("forward_extend", forward_extend, "around")]


ADAPTER = GDNAdapter()


def survivors_view(ctx, metadata, fb, stage: int):
    """(metadata, prefix lens, host row counts) describing the survivors of `ctx`, or the rows
    of its `row_piece`, to the linear layers of `stage`: built once per stage and piece per
    forward (the rows change only at a drop). A request continues from its slot's state where
    rows of it passed through the layer before: in earlier forwards, or in earlier pieces."""
    cache = view_cache(ctx, "_uniprefill_gdn_views")
    key = (stage, ctx.pieces.span)
    if key in cache:
        return cache[key]
    layout = state_layer_rows(ctx, metadata.mamba_cache_indices)
    view = copy.copy(metadata)
    view.query_start_loc, view.mamba_cache_indices = layout.query_start_loc, layout.slots
    prefix_lens = torch.tensor(layout.before, dtype=fb.extend_prefix_lens.dtype).to(
        fb.extend_prefix_lens.device)
    cache[key] = view, prefix_lens, layout.rows
    return cache[key]


def forward_extend(original, backend, layer, forward_batch, mixed_qkv, a, b, **kwargs):
    """AROUND `GDNAttnBackend.forward_extend`."""
    runtime, ctx = active_runtime(), drop_context(forward_batch)
    stage = runtime.stages.stage(layer.layer_id) if runtime is not None else 0
    if ctx is None or not ctx.is_extend or not ctx.survivors.compacted or stage == 0:
        return original(backend, layer, forward_batch, mixed_qkv, a, b, **kwargs)
    metadata, fb = backend.forward_metadata, forward_batch
    if metadata.has_mamba_track_mask:
        raise RuntimeError("UniPrefill: a linear-attention layer snapshots states inside the "
                           "step for the radix cache (an extra-buffer strategy), which "
                           "server_args.py refuses under UniPrefill")
    view, prefix_lens, lens = survivors_view(ctx, metadata, fb, stage)
    saved = fb.extend_prefix_lens, fb.extend_seq_lens_cpu
    backend.forward_metadata = view
    fb.extend_prefix_lens, fb.extend_seq_lens_cpu = prefix_lens, lens
    try:
        return original(backend, layer, fb, mixed_qkv, a, b, **kwargs)
    finally:
        backend.forward_metadata = metadata
        fb.extend_prefix_lens, fb.extend_seq_lens_cpu = saved
