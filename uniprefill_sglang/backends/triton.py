"""Triton backend adapter: attention over per-stage KV views, without host syncs.

The Triton kernels read their lengths on the device, so every view is built on the GPU from
`req_to_token` and the per-slot stages (kv_validity.py; backends/flashinfer.py states the
invariant):

* Extend (stage > 0, compacted batch or sparse prefix): the extend kernel takes the survivors'
  q/k/v directly (causal among them) and, as its "prefix", each request's valid slots at this
  stage before its first current row (`ctx.survivors.fixed_lens`; chunked prefill's rejoining
  parked rows are current rows). Built once per stage per forward (cached on the drop context);
  the layer writes KV for the survivors only. A layer run in pieces (`common.row_piece`) takes a
  piece's rows as the current ones, and as their prefix also their request's rows ahead of the
  piece (`common.stage_keys`), once per stage and piece.
* Extend on a sliding-window layer (Gemma 3's local layers): upstream's kernel counts the
  window in KV entries, which is wrong once entries are missing, so the layer runs
  `kernels.positional_attention` over each request's valid prefix and current rows, masked by
  their original positions (a query at p sees the keys at p - window .. p), with the layer's
  attention-sink logits (gpt-oss) where it has them; a full-attention layer passes its sinks
  on to upstream's kernel with the view.
* Multi-head latent attention (DeepSeek-V2/V3, absorbed form from the first drop layer on:
  model_integration.py): one KV head of the latent and RoPE key, the value its first
  kv_lora_rank columns; the views list its slots as any layer's.
* Decode: for a batch holding a request with sparse KV (any batch under the staged KV layout,
  where later stages address their own pools), per-stage kv_indptr / kv_indices /
  num_kv_splits; `forward_decode` swaps them into the metadata for the layers of that stage.
  A model with sliding-window layers gets, at every decode step and per stage (the first
  included), the list of the positions its window reaches, which replaces upstream's window
  list for those layers: upstream's holds the last `window` entries whatever their positions,
  one key fewer than the model's window (SGLang 0.5.17's `update_sliding_window_buffer`), so
  with the plugin on such a model decodes over the model's own window, dense requests too.
* Decode CUDA graphs: per-stage static buffers captured into the graph and refilled on replay
  outside it (a copy of the dense view for dense batches of a model without windows, a
  compaction otherwise).
"""

from __future__ import annotations

from typing import Optional

import torch

from uniprefill_sglang.backends import block_sparse
from uniprefill_sglang.backends.common import (
    StageViewAdapter,
    active_runtime,
    decode_graph_entries,
    decode_has_sparse,
    decode_needs_views,
    extend_needs_view,
    extend_qo_indptr,
    refuse_unservable_view,
    row_piece,
    seq_lens_sum,
    FP8_DTYPES,
    sliding_window,
    stage_keys,
    stages_after_first,
    view_cache,
    window_extend_attention,
    write_kv,
)
from uniprefill_sglang.context import drop_context
from uniprefill_sglang.kv_validity import stage_views
from uniprefill_sglang.runtime import get_runtime


class _State:
    def __init__(self):
        # Decode CUDA graphs: the rows of `stage_views` (row k is stage k + 1; with a window,
        # row D + s is stage s's window list).
        self.graph_indptr: Optional[torch.Tensor] = None
        self.graph_indices: Optional[torch.Tensor] = None
        self.graph_splits: Optional[torch.Tensor] = None




def _model_window(backend) -> Optional[int]:
    """The sliding window of the model's local layers (SGLang keeps one per model), or None."""
    window = backend.sliding_window_size
    return window if window is not None and window > 0 else None


def _decode_views(splits, indptr, indices, num_drops: int, window: Optional[int]) -> dict:
    """{(stage, windowed): (kv_indptr, kv_indices, num_kv_splits)} from `stage_views`' rows
    and per-stage splits (the window lists reuse their stage's splits; stage 0's are
    upstream's, None here)."""
    views = {(s, False): (indptr[s - 1], indices[s - 1], splits[s - 1])
             for s in range(1, num_drops + 1)}
    if window is not None:
        for s in range(num_drops + 1):
            views[(s, True)] = (indptr[num_drops + s], indices[num_drops + s],
                                splits[s - 1] if s else None)
    return views


class TritonAdapter(StageViewAdapter):
    target = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend"
    State = _State

    def unsupported_reason(self, backend):
        if backend.page_size != 1:
            return "Triton with a page size other than 1"
        if backend.enable_deterministic:
            return "Triton under deterministic inference"
        # `_translate_kv_loc` (a KV location map) exists on SGLang 0.5.17 only.
        if (backend.dcp_size != 1 or getattr(backend, "_translate_kv_loc", None) is not None
                or backend.use_sliding_window_kv_pool):
            return "Triton with split-context, translated or sliding-window-pool KV"
        if backend.use_mla and backend.token_to_kv_pool.dtype in FP8_DTYPES:
            return "Triton with MLA and an fp8 KV cache"  # upstream scales its keys itself
        if _model_window(backend) is not None and backend.token_to_kv_pool.dtype in FP8_DTYPES:
            return "Triton with sliding-window layers and an fp8 KV cache"
        return None

    def hooks(self):
        return [("forward_extend", forward_extend, "around"),
                ("forward_decode", forward_decode, "around"),
                ("init_forward_metadata", init_forward_metadata, "around"),
                ("init_cuda_graph_state", init_cuda_graph_state, "after"),
                ("init_forward_metadata_out_graph", init_forward_metadata_out_graph, "around")]


ADAPTER = TritonAdapter()


# ---- extend ----------------------------------------------------------------------------------
def _extend_view(backend, runtime, ctx, stage: int):
    cache = view_cache(ctx, "_uniprefill_triton_views")
    key = (stage, ctx.pieces.span)
    view = cache.get(key)
    if view is not None:
        return view
    # With the positions where sliding-window layers need them (`window_extend_keys`): one
    # compaction serves both kinds of layer.
    piece = row_piece(ctx)
    kv_indptr, kv_indices, _ = stage_keys(runtime, backend.req_to_token, ctx, stage, piece.ahead,
                                          positions=_model_window(backend) is not None)
    view = (kv_indptr, kv_indices, extend_qo_indptr(ctx, stage), max(piece.lens))
    cache[key] = view
    return view


def forward_extend(original, backend, q, k, v, layer, forward_batch, save_kv_cache=True,
                   *args, **kwargs):
    """AROUND `TritonAttnBackend.forward_extend`."""
    sparse = block_sparse.extend_attention(backend.token_to_kv_pool, q, k, v, layer,
                                           forward_batch, save_kv_cache)
    if sparse is not None:
        return sparse
    runtime, ctx = active_runtime(), drop_context(forward_batch)
    if not extend_needs_view(ctx, runtime, layer):
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache, *args, **kwargs)
    refuse_unservable_view(ADAPTER, backend, layer, k, v, kwargs)
    stage = runtime.stages.stage(layer.layer_id)
    # From the live batch (the drop context; under the breakable prefill graph `forward_batch`
    # is a static copy).
    kv_indptr, kv_indices, qo_indptr, max_extend_len = _extend_view(backend, runtime, ctx, stage)
    if save_kv_cache:
        slots = ctx.survivors.out_cache_loc[row_piece(ctx).rows]
        if layer.k_scale is None:
            write_kv(backend.token_to_kv_pool, layer, slots, k, v)
        else:
            write_kv(backend.token_to_kv_pool, layer, slots, k.clone(), v.clone(),
                     layer.k_scale, layer.v_scale)
    window = sliding_window(layer)
    if window is not None:
        return window_extend_attention(runtime, backend.token_to_kv_pool, backend.req_to_token,
                                       layer, q, ctx, stage, window, sinks=kwargs.get("sinks"))
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
_FULL_FIELDS = ("kv_indptr", "kv_indices", "num_kv_splits")
_WINDOW_FIELDS = ("window_kv_indptr", "window_kv_indices", "num_kv_splits")


def forward_decode(original, backend, q, k, v, layer, forward_batch, *args, **kwargs):
    """AROUND `TritonAttnBackend.forward_decode`: the layer's stage view, when one is set."""
    meta = backend.forward_metadata
    views = getattr(meta, "uniprefill_decode_views", None)
    runtime = get_runtime()
    windowed = sliding_window(layer) is not None
    view = (views.get((runtime.stages.stage(layer.layer_id), windowed))
            if views and runtime else None)
    if view is None:
        return original(backend, q, k, v, layer, forward_batch, *args, **kwargs)
    fields = _WINDOW_FIELDS if windowed else _FULL_FIELDS
    if view[2] is None:  # stage 0's window list keeps upstream's splits
        fields, view = fields[:2], view[:2]
    saved = tuple(getattr(meta, f) for f in fields)
    for f, x in zip(fields, view):
        setattr(meta, f, x)
    try:
        return original(backend, q, k, v, layer, forward_batch, *args, **kwargs)
    finally:
        for f, x in zip(fields, saved):
            setattr(meta, f, x)


def init_forward_metadata(original, backend, forward_batch, *args, **kwargs):
    """AROUND `TritonAttnBackend.init_forward_metadata`: per-stage views of a decode batch
    holding a request with sparse KV, and of every decode batch of a model with sliding-window
    layers (their window lists)."""
    result = original(backend, forward_batch, *args, **kwargs)
    runtime, ctx = active_runtime(), drop_context(forward_batch)
    fb = forward_batch
    window = _model_window(backend)
    if (runtime is None or not fb.forward_mode.is_decode() or fb.spec_info is not None
            or not ADAPTER.supported(backend)
            or not (decode_needs_views(ctx, runtime) or window is not None)):
        return result
    bs = fb.req_pool_indices.shape[0]
    counts, indptr, indices = stage_views(
        runtime.slots, backend.req_to_token, fb.req_pool_indices, fb.seq_lens,
        seq_lens_sum(fb, bs), bs, dtype=torch.int64, window=window)
    splits = []
    for s in stages_after_first(runtime):
        splits.append(torch.empty(bs, dtype=torch.int32, device=counts.device))
        backend.get_num_kv_splits(splits[-1], counts[s - 1])
    backend.forward_metadata.uniprefill_decode_views = _decode_views(
        splits, indptr, indices, runtime.stages.num_drops, window)
    return result


# ---- decode CUDA graphs ----------------------------------------------------------------------
def init_cuda_graph_state(result, backend, *args, **kwargs):
    """AFTER `TritonAttnBackend.init_cuda_graph_state`: per-stage static buffers."""
    runtime = active_runtime()
    if runtime is None or not ADAPTER.supported(backend):
        return result
    st = ADAPTER.state(backend)
    stages = stages_after_first(runtime)
    window = _model_window(backend)
    rows = len(stages) if window is None else 2 * len(stages) + 1
    max_bs = backend.kv_indptr.numel() - 1
    # The window rows hold at most window + 1 entries per request, whatever the pool's size.
    entries = decode_graph_entries(runtime, backend.cuda_graph_kv_indices.numel(),
                                   floor=0 if window is None else max_bs * (window + 1))
    st.graph_indptr = backend.kv_indptr.new_zeros((rows, backend.kv_indptr.numel()))
    st.graph_indices = backend.cuda_graph_kv_indices.new_zeros((rows, entries))
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
    window = _model_window(backend)
    ctx = drop_context(forward_batch)
    if window is not None or (not in_capture and decode_has_sparse(ctx)):
        # A model with windows always builds its lists: upstream's window list is not the
        # model's (see the module's docstring).
        raw_bs = bs - int(getattr(fb, "num_padding", 0) or 0)
        counts, _, _ = stage_views(
            runtime.slots, backend.req_to_token, fb.req_pool_indices[:bs], fb.seq_lens[:bs],
            seq_lens_sum(fb, bs), raw_bs, outs=st.graph_indices, indptr_outs=st.graph_indptr,
            window=window,
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
        backend.forward_metadata.uniprefill_decode_views = _decode_views(
            [st.graph_splits[s - 1] for s in stages], st.graph_indptr[:, : bs + 1],
            st.graph_indices, len(stages), window)
    return result
