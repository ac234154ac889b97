"""Triton backend adapter: attention over per-stage KV views, without host syncs.

The Triton kernels read their lengths on the device, so every view is built on the GPU from
`req_to_token` and the per-slot stages (kv_validity.py; backends/flashinfer.py states the
invariant):

* Extend (stage > 0, compacted batch or sparse prefix): the extend kernel takes the survivors'
  q/k/v directly (causal among them) and, as its "prefix", each request's valid slots at this
  stage before its first current row (`ctx.fixed_lens`; chunked prefill's rejoining parked rows
  are current rows). Built once per stage per forward (cached on the drop context); the layer
  writes KV for the survivors only.
* Decode: for a batch holding a request with sparse KV (any batch under the staged KV layout,
  where later stages address their own pools), per-stage kv_indptr / kv_indices /
  num_kv_splits; `forward_decode` swaps them into the metadata for the layers of that stage.
* Decode CUDA graphs: per-stage static buffers captured into the graph and refilled on replay
  outside it (a copy of the dense view for dense batches, a compaction otherwise).
"""

from __future__ import annotations

from typing import Optional

import torch

from uniprefill_sglang.backends.common import (
    StageViewAdapter,
    active_runtime,
    decode_has_sparse,
    decode_needs_views,
    extend_needs_view,
    prefix_view,
    seq_lens_sum,
    stages_after_first,
    view_cache,
    write_kv,
)
from uniprefill_sglang.context import current, to_device
from uniprefill_sglang.kv_validity import stage_views
from uniprefill_sglang.runtime import get_runtime


class _State:
    def __init__(self):
        # Decode CUDA graphs: row k is stage k + 1.
        self.graph_indptr: Optional[torch.Tensor] = None
        self.graph_indices: Optional[torch.Tensor] = None
        self.graph_splits: Optional[torch.Tensor] = None


class TritonAdapter(StageViewAdapter):
    target = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend"
    State = _State

    def unsupported_reason(self, backend):
        if backend.page_size != 1:
            return "Triton with a page size other than 1"
        if backend.enable_deterministic:
            return "Triton under deterministic inference"
        if (backend.dcp_size != 1 or backend.use_mla or backend._translate_kv_loc is not None
                or backend.use_sliding_window_kv_pool or backend.sliding_window_size is not None):
            return "Triton with split-context, MLA, translated or sliding-window KV"
        return None

    def hooks(self):
        return [("forward_extend", forward_extend, "around"),
                ("forward_decode", forward_decode, "around"),
                ("init_forward_metadata", init_forward_metadata, "around"),
                ("init_cuda_graph_state", init_cuda_graph_state, "after"),
                ("init_forward_metadata_out_graph", init_forward_metadata_out_graph, "around")]


ADAPTER = TritonAdapter()


# ---- extend ----------------------------------------------------------------------------------
def _extend_view(backend, runtime, ctx, fb, stage: int):
    cache = view_cache(ctx, "_uniprefill_triton_views")
    view = cache.get(stage)
    if view is not None:
        return view
    bs = fb.req_pool_indices.shape[0]
    device = fb.req_pool_indices.device
    _, kv_indptr, kv_indices = prefix_view(runtime, backend.req_to_token, fb, ctx, stage,
                                            dtype=torch.int64)
    lens = to_device(ctx.lens, torch.int64, device)
    qo_indptr = torch.zeros(bs + 1, dtype=torch.int64, device=device)
    torch.cumsum(lens, 0, out=qo_indptr[1:])
    view = (kv_indptr, kv_indices, qo_indptr, max(ctx.lens))
    cache[stage] = view
    return view


def forward_extend(original, backend, q, k, v, layer, forward_batch, save_kv_cache=True,
                   *args, **kwargs):
    """AROUND `TritonAttnBackend.forward_extend`."""
    runtime, ctx = active_runtime(), current()
    if (not extend_needs_view(ctx, runtime, layer) or k is None or v is None
            or kwargs.get("score_mod") is not None or not ADAPTER.supported(backend)):
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache, *args, **kwargs)
    stage = runtime.stages.stage(layer.layer_id)
    # From the live batch (under the breakable prefill graph `forward_batch` is a static copy).
    kv_indptr, kv_indices, qo_indptr, max_extend_len = _extend_view(
        backend, runtime, ctx, ctx.forward_batch, stage
    )
    if save_kv_cache:
        if layer.k_scale is None:
            write_kv(backend.token_to_kv_pool, layer, ctx.out_cache_loc, k, v)
        else:
            write_kv(backend.token_to_kv_pool, layer, ctx.out_cache_loc, k.clone(), v.clone(),
                     layer.k_scale, layer.v_scale)
    meta = backend.forward_metadata
    saved = (meta.kv_indptr, meta.kv_indices, meta.qo_indptr, meta.max_extend_len)
    meta.kv_indptr, meta.kv_indices, meta.qo_indptr, meta.max_extend_len = (
        kv_indptr, kv_indices, qo_indptr, max_extend_len
    )
    try:
        # KV already written above, at the survivors' slots.
        return original(backend, q, k, v, layer, forward_batch, False, *args, **kwargs)
    finally:
        meta.kv_indptr, meta.kv_indices, meta.qo_indptr, meta.max_extend_len = saved


# ---- decode ----------------------------------------------------------------------------------
def forward_decode(original, backend, q, k, v, layer, forward_batch, *args, **kwargs):
    """AROUND `TritonAttnBackend.forward_decode`: the layer's stage view, when one is set."""
    meta = backend.forward_metadata
    views = getattr(meta, "uniprefill", None)
    runtime = get_runtime()
    view = views.get(runtime.stages.stage(layer.layer_id)) if views and runtime else None
    if view is None:
        return original(backend, q, k, v, layer, forward_batch, *args, **kwargs)
    saved = (meta.kv_indptr, meta.kv_indices, meta.num_kv_splits)
    meta.kv_indptr, meta.kv_indices, meta.num_kv_splits = view
    try:
        return original(backend, q, k, v, layer, forward_batch, *args, **kwargs)
    finally:
        meta.kv_indptr, meta.kv_indices, meta.num_kv_splits = saved


def init_forward_metadata(original, backend, forward_batch, *args, **kwargs):
    """AROUND `TritonAttnBackend.init_forward_metadata`: per-stage views of a decode batch
    holding a request with sparse KV."""
    result = original(backend, forward_batch, *args, **kwargs)
    runtime, ctx = active_runtime(), current()
    fb = forward_batch
    if (runtime is None or not fb.forward_mode.is_decode() or fb.spec_info is not None
            or not decode_needs_views(ctx, runtime) or not ADAPTER.supported(backend)):
        return result
    bs = fb.req_pool_indices.shape[0]
    stages = stages_after_first(runtime)
    counts, indptr, indices = stage_views(
        runtime.slots, backend.req_to_token, fb.req_pool_indices, fb.seq_lens,
        seq_lens_sum(fb, bs), bs, dtype=torch.int64)
    out = {}
    for s in stages:
        splits = torch.empty(bs, dtype=torch.int32, device=counts.device)
        backend.get_num_kv_splits(splits, counts[s - 1])
        out[s] = (indptr[s - 1], indices[s - 1], splits)
    backend.forward_metadata.uniprefill = out
    return result


# ---- decode CUDA graphs ----------------------------------------------------------------------
def init_cuda_graph_state(result, backend, *args, **kwargs):
    """AFTER `TritonAttnBackend.init_cuda_graph_state`: per-stage static buffers."""
    runtime = active_runtime()
    if runtime is None or not ADAPTER.supported(backend):
        return result
    st = ADAPTER.state(backend)
    stages = stages_after_first(runtime)
    st.graph_indptr = backend.kv_indptr.new_zeros((len(stages), backend.kv_indptr.numel()))
    st.graph_indices = backend.cuda_graph_kv_indices.new_zeros(
        (len(stages), backend.cuda_graph_kv_indices.numel()))
    st.graph_splits = backend.cuda_graph_num_kv_splits.new_full(
        (len(stages), backend.cuda_graph_num_kv_splits.numel()), backend.max_kv_splits)
    return result


def init_forward_metadata_out_graph(original, backend, forward_batch, in_capture=False,
                                    *args, **kwargs):
    """AROUND `TritonAttnBackend.init_forward_metadata_out_graph`: refill the per-stage buffers
    of the decode graph (and, at capture, point the captured layers of each stage at them)."""
    result = original(backend, forward_batch, in_capture, *args, **kwargs)
    runtime = active_runtime()
    fb = forward_batch
    st = ADAPTER.state(backend)
    if (runtime is None or st.graph_indices is None or fb.spec_info is not None
            or not fb.forward_mode.is_decode_or_idle()):
        return result
    bs = fb.batch_size
    stages = stages_after_first(runtime)
    ctx = current()
    if not in_capture and decode_has_sparse(ctx):
        raw_bs = bs - int(getattr(fb, "num_padding", 0) or 0)
        counts, _, _ = stage_views(
            runtime.slots, backend.req_to_token, fb.req_pool_indices[:bs], fb.seq_lens[:bs],
            seq_lens_sum(fb, bs), raw_bs, outs=st.graph_indices, indptr_outs=st.graph_indptr,
        )
        for s in stages:
            backend.get_num_kv_splits(st.graph_splits[s - 1][:bs], counts[s - 1])
    else:
        # Every stage sees the whole sequences: copy upstream's dense view.
        n = seq_lens_sum(fb, bs)
        st.graph_indptr[:, : bs + 1].copy_(backend.kv_indptr[: bs + 1].expand(len(stages), -1))
        st.graph_indices[:, :n].copy_(
            runtime.slots.pool_slots_after_first(backend.cuda_graph_kv_indices[:n]))
        st.graph_splits[:, :bs].copy_(backend.cuda_graph_num_kv_splits[:bs].expand(len(stages), -1))
    if in_capture:
        backend.forward_metadata.uniprefill = {
            s: (st.graph_indptr[s - 1][: bs + 1], st.graph_indices[s - 1], st.graph_splits[s - 1])
            for s in stages
        }
    return result
