"""FlashInfer backend adapter: attention over per-stage KV views.

A layer of stage s may attend, for request b, to the slots of b's sequence whose KV it holds
(`slot_stage >= s`) in position order, named by the stage pool's slots under the staged KV
layout (stage_pools.py); after a drop the surviving new tokens are exactly the last
`ctx.survivors.lens[b]` entries of that list (their slots are FULL, the dropped ones are below
s, and so are the rows that chunked prefill parked and did not keep). So plain causal paged
attention (query i of qo_len sees kv entries up to kv_len - qo_len + i) over that compacted list
is exact.

* Extend (EXTEND / MIXED): at the first layer of a stage that needs a view (stage > 0 and the
  batch is compacted or holds a sparse prefix) that stage's wrappers are planned from host
  lengths (`ctx.survivors.lens`, the valid prefix counted when the forward began), cached on the
  drop context and run by every layer of the stage. Like upstream, the survivors attend to each
  other through the ragged wrapper on the layer's own K/V (paged attention at page size 1
  gathers every key through an index: 1.16-1.24x slower on an H200,
  benchmarks/bench_extend_attention.py) and to the stage's valid prefix, if any, through a paged
  wrapper, merged by log-sum-exp; where upstream does not use its ragged wrapper, one causal
  paged wrapper runs over the whole compacted list. Those layers write KV for the survivors only
  (`ctx.survivors.out_cache_loc`). Stage 0 runs upstream code, and so do dense batches under the
  shared layout.
* Extend in pieces (a layer run over the survivors in pieces, `common.row_piece`): the same
  wrappers' description for one piece, its rows as the current ones and their request's rows
  ahead of the piece joining the valid prefix (`common.stage_keys`), planned by the layer's call
  on wrappers of their own (`PIECE`).
* Decode: for a batch with a sparse request (or any batch under the staged layout), one decode
  wrapper per stage > 0 is planned once per step; `_get_wrapper_idx` returns the layer's stage
  while such a metadata is active. Dense batches under the shared layout keep upstream's
  single wrapper.
* Sliding-window layers (Gemma 3's local layers; upstream's wrapper pair dispatches them to a
  windowed wrapper) after a drop: FlashInfer's `window_left` counts KV entries, and a decode
  plan needs each window list's length on the host, which only the device knows once entries
  are missing. These layers run `kernels.positional_attention` instead (backends/common.py):
  in extend over each request's valid prefix and current rows, in decode over per-stage lists
  of the positions the window reaches (`kv_validity.window_views`, built on the device every
  step, in static buffers under decode CUDA graphs). Stage 0, which holds every token, keeps
  upstream's windowed wrappers.
* Decode CUDA graphs: every captured batch size gets one wrapper per stage, with per-stage
  static indptr / indices buffers (their int workspaces shared across batch sizes, since one
  graph replays at a time, unless the KV split is off: see `create_decode_wrappers`). On replay
  the buffers are refilled and re-planned outside the graph (`fast_decode_plan`).

Decode never reads the device to plan: the index lists are compacted on the GPU, and their
lengths come from the host (`seq_len` minus the request's KV gap at that stage, kept by the
runtime since its prefill). A sync there would stall the overlap scheduler, which prepares the
next decode step while the GPU runs this one.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from uniprefill_sglang.backends.common import (
    StageViewAdapter,
    active_runtime,
    decode_graph_entries,
    decode_has_sparse,
    decode_needs_views,
    decode_stage_kv_lens,
    extend_needs_view,
    extend_view_slots,
    host_seq_lens,
    prefix_view,
    row_piece,
    seq_lens_sum,
    sliding_window,
    stage_keys,
    stages_after_first,
    view_cache,
    window_attention,
    window_extend_attention,
    write_kv,
)
from uniprefill_sglang.backends.flashinfer_template import paged_template, use_paged_template
from uniprefill_sglang.context import drop_context
from uniprefill_sglang.errors import UniPrefillError
from uniprefill_sglang.kv_validity import (
    check_kv_lens,
    compact,
    gather_seq_slots,
    stage_views,
    window_views,
)
from uniprefill_sglang.runtime import get_runtime


# ---- per-backend state -----------------------------------------------------------------------
_UNREAD = object()


class _State:
    def __init__(self):
        self.extend_wrappers: Dict[tuple, object] = {}  # (kind, stage) -> wrapper
        self.decode_wrappers: Dict[int, object] = {}
        self.prepared = False  # the wrappers above were made at start-up (`prepare`)
        # Decode CUDA graphs: per-stage static buffers and shared int workspaces.
        # Decode CUDA graphs: row k is stage k + 1 ([D, max_bs + 1] and [D, entries], entries
        # from `decode_graph_entries`).
        self.graph_indptr: Optional[torch.Tensor] = None
        self.graph_indices: Optional[torch.Tensor] = None
        self.graph_int_ws: Dict[int, tuple] = {}
        # ... and, for a model with sliding-window layers, the window lists of each stage after
        # the first (kv_validity.window_views: indptr, indices, positions) and the decode rows'
        # query offsets (0, 1, ..., max_bs).
        self.graph_windows: Optional[tuple] = None
        self.graph_qo_indptr: Optional[torch.Tensor] = None
        self.model_window = _UNREAD  # `_model_window`, read once per backend


class FlashInferAdapter(StageViewAdapter):
    target = "sglang.srt.layers.attention.flashinfer_backend.FlashInferAttnBackend"
    State = _State

    def unsupported_reason(self, backend):
        window = _model_window(backend)
        if backend.num_wrappers != 1 and window is None:
            return "FlashInfer with a wrapper pair for cross-attention layers"
        if window is not None and (
                backend.use_sliding_window_kv_pool
                or backend.token_to_kv_pool.dtype != backend.indices_updater_decode.q_data_type):
            return ("FlashInfer with sliding-window layers on a sliding-window KV pool or a KV "
                    "cache of another dtype than the queries")
        if backend.page_size != 1:
            return "FlashInfer with a page size other than 1"
        if backend.prefill_uses_dequant_workspace or backend.decode_uses_dequant_workspace:
            return "FlashInfer with an FP4 dequant-workspace KV cache"
        return None

    def prepare(self, backend, runtime):
        """Every later stage's extend wrappers, of the kinds this backend's configuration runs,
        and its eager decode wrapper. Each FlashInfer wrapper allocates an 8 MiB device and an
        8 MiB pinned host workspace: made on first use, they were paid by the first requests
        that read a view (an 8K request with keep 0.5,0.8 took 0.174 s first, 0.119 s after).
        Upstream's eager paged prefill wrappers move to the template flashinfer_template.py
        picks (FA2 unless switched)."""
        use_paged_template(backend)
        kinds = ("ragged", "prefix") if _uses_ragged(backend) else ("paged",)
        for stage in stages_after_first(runtime):
            for kind in kinds:
                _wrapper(backend, kind, stage)
            _decode_wrapper(backend, stage)
        if runtime.piece_rows:
            for kind in kinds:
                _wrapper(backend, kind, PIECE)
        self.state(backend).prepared = True

    def correct_upstream(self, backend):
        return window_in_prefill(backend)

    def hooks(self):
        return [("forward_extend", forward_extend, "around"),
                ("forward_decode", forward_decode, "around"),
                ("init_forward_metadata", init_forward_metadata, "around"),
                ("_get_wrapper_idx", get_wrapper_idx, "around"),
                ("init_cuda_graph_state", init_cuda_graph_state, "after"),
                ("_create_decode_wrappers", create_decode_wrappers, "after"),
                ("init_forward_metadata_out_graph", init_forward_metadata_out_graph, "around")]


ADAPTER = FlashInferAdapter()


def _model_window(backend) -> Optional[int]:
    """The sliding window of the model's local layers when upstream dispatches them to a
    wrapper of their own, else None (read once: it is asked in every step)."""
    st = ADAPTER.state(backend)
    if st.model_window is _UNREAD:
        from sglang.srt.layers.attention.flashinfer_backend import WrapperDispatch

        window = (backend.indices_updater_decode.sliding_window_size
                  if backend.dispatch_reason == WrapperDispatch.SLIDING_WINDOW else None)
        st.model_window = window if window is not None and window >= 0 else None
    return st.model_window


def window_in_prefill(backend) -> Optional[str]:
    """A sliding-window model's prefills through upstream's paged path. SGLang 0.5.17 to 0.5.23
    plan FlashInfer's ragged prefill wrapper without `window_left` (so the kernel is built
    without a window, whatever a call passes) and call it without one in a step with no cached
    prefix: every local layer of Gemma 3 then attends to the whole prompt. On a reduced Gemma 3
    (H200, benchmarks/results/gemma3/flashinfer_window_h200.json) that puts the last row's
    final hidden state 53% from torch_native's, exactly the window's own effect, while the
    paged path, which plans the window, is 0.8% from it (rounding). Returns what changed."""
    if _model_window(backend) is None or not _uses_ragged(backend):
        return None
    backend.use_paged = True  # what upstream's SGLANG_FLASHINFER_USE_PAGED=1 sets
    return ("FlashInfer prefills of this sliding-window model run upstream's paged path: its "
            "ragged path leaves the window out (the local layers would attend to the whole "
            "prompt)")


def _decode_window_views(backend, runtime, fb, bs: int, raw_bs: int, window: int, **outs):
    """`kv_validity.window_views` of a decode batch's first `bs` rows (the window spans' total
    from the host's sequence lengths)."""
    n = int(host_seq_lens(fb, bs).clamp(max=window + 1).sum())
    return window_views(runtime.slots, backend.req_to_token_pool.req_to_token,
                        fb.req_pool_indices[:bs], fb.seq_lens[:bs], window, n, raw_bs, **outs)


# ---- extend ----------------------------------------------------------------------------------
class _StageView:
    """The wrappers one stage's layers run in an extend forward.

    Ragged (upstream's choice when it uses its ragged wrapper): the survivors attend to each
    other's K/V straight from the layer (causal, like upstream's prefill without a prefix), and
    to the stage's valid prefix through a paged wrapper (non-causal), merged by log-sum-exp.
    Paged: one causal paged wrapper over the whole compacted list (prefix + survivors' slots)."""

    def __init__(self, ragged=None, prefix=None, paged=None):
        self.ragged, self.prefix, self.paged = ragged, prefix, paged


def _uses_ragged(backend) -> bool:
    """Whether upstream's extend runs its ragged wrapper, by the backend's configuration (as
    its `init_forward_metadata` decides, less the per-call torch.compile context)."""
    return not any(getattr(backend, flag, False) for flag in (
        "enable_deterministic", "use_paged", "is_multimodal", "enable_mis"))


def _made_late(st) -> None:
    """A wrapper made in a request's path after start-up prepared the others (observability:
    `views_allocated_late` in the scheduler's internal state)."""
    runtime = get_runtime()
    if st.prepared and runtime is not None:
        runtime.stats.views_allocated_late += 1


# The "stage" of the wrappers that a layer run in pieces plans at each call (`_plan_piece_view`).
PIECE = "piece"


def _wrapper(backend, kind: str, stage):
    """One wrapper per (kind, stage): each is planned once per forward, before the earlier
    stages' layers have run, so re-planning a shared one would race their pinned plan copies
    (`PIECE`: the wrappers of layers run in pieces, planned at every call without that race)."""
    from flashinfer import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper

    st = ADAPTER.state(backend)
    w = st.extend_wrappers.get((kind, stage))
    if w is None:
        if kind == "ragged":
            w = BatchPrefillWithRaggedKVCacheWrapper(
                backend.workspace_buffer, "NHD", backend=backend.prefill_wrapper_ragged._backend)
        else:
            w = BatchPrefillWithPagedKVCacheWrapper(
                backend.workspace_buffer, "NHD", backend=paged_template(backend))
        st.extend_wrappers[(kind, stage)] = w
        _made_late(st)
    return w


def _decode_wrapper(backend, stage: int):
    """The eager decode wrapper of `stage` (decode CUDA graphs have their own per batch size)."""
    from flashinfer import BatchDecodeWithPagedKVCacheWrapper

    st = ADAPTER.state(backend)
    w = st.decode_wrappers.get(stage)
    if w is None:
        w = BatchDecodeWithPagedKVCacheWrapper(
            backend.workspace_buffer, "NHD", backend=backend.decode_backend,
            use_tensor_cores=backend.decode_use_tensor_cores,
        )
        st.decode_wrappers[stage] = w
        _made_late(st)
    return w


def _host_indptr(lens) -> torch.Tensor:
    """[0, cumsum(lens)] on the host (int32), from a list or a host tensor of lengths."""
    lens = torch.as_tensor(lens, dtype=torch.int32)
    indptr = torch.zeros(lens.shape[0] + 1, dtype=torch.int32)
    torch.cumsum(lens, 0, out=indptr[1:])
    return indptr


def _plan_paged(backend, wrapper, qo_lens, kv_lens, indices, causal: bool,
                non_blocking: bool = True) -> None:
    upd = backend.indices_updater_prefill
    wrapper.plan(
        _host_indptr(qo_lens), _host_indptr(kv_lens), indices,
        torch.ones(len(qo_lens), dtype=torch.int32),
        upd.num_qo_heads, upd.num_kv_heads, upd.head_dim, 1,
        causal=causal, q_data_type=upd.q_data_type, kv_data_type=upd.data_type,
        non_blocking=non_blocking,
    )


def _plan_ragged(backend, wrapper, lens, non_blocking: bool = True) -> None:
    """Causal attention of each request's rows among themselves."""
    upd = backend.indices_updater_prefill
    indptr = _host_indptr(lens)
    wrapper.plan(indptr, indptr, upd.num_qo_heads, upd.num_kv_heads, upd.head_dim,
                 causal=True, q_data_type=upd.q_data_type, non_blocking=non_blocking)


def _ragged_wrapper(backend, ctx, stage: int, cache: dict):
    """The survivors' causal attention among themselves: one wrapper per row layout, planned
    once and run by every stage that sees the same rows (all of them in a step that moved no
    row, such as a follow-up over a sparse cached prefix)."""
    key = ("ragged", tuple(ctx.survivors.lens))
    ragged = cache.get(key)
    if ragged is None:
        ragged = cache[key] = _wrapper(backend, "ragged", stage)
        _plan_ragged(backend, ragged, ctx.survivors.lens)
    return ragged


def _plan_extend_view(backend, runtime, ctx, fb, stage: int) -> _StageView:
    """Plan (once per stage per forward) the wrappers of `stage`. Lengths come from the host:
    the prefix's valid KV at this stage (counted when the forward began) and the rows alive."""
    if ctx.pieces.span is not None:
        return _plan_piece_view(backend, runtime, ctx, stage)
    cache = view_cache(ctx, "_uniprefill_fi_views")
    view = cache.get(stage)
    if view is not None:
        return view
    req_to_token = backend.req_to_token_pool.req_to_token
    prefix_lens = [p[stage] for p in ctx.kv.prefix_valid]
    if backend.forward_metadata.use_ragged:
        view = _StageView(ragged=_ragged_wrapper(backend, ctx, stage, cache))
        if any(prefix_lens):
            _, _, indices = prefix_view(runtime, req_to_token, fb, ctx, stage)
            view.prefix = _wrapper(backend, "prefix", stage)
            _plan_paged(backend, view.prefix, ctx.survivors.lens, prefix_lens, indices,
                        causal=False)
    else:
        seq, valid = extend_view_slots(runtime, req_to_token, fb, stage)
        counts, _, indices = compact(seq.slots, seq.bounds, valid)
        kv_lens = [p + n for p, n in zip(prefix_lens, ctx.survivors.lens)]
        if runtime.check_kv_lens:
            check_kv_lens(torch.tensor(kv_lens), counts, f"extend stage {stage}")
        view = _StageView(paged=_wrapper(backend, "paged", stage))
        _plan_paged(backend, view.paged, ctx.survivors.lens, kv_lens, indices, causal=True)
    cache[stage] = view
    return view


def _plan_piece_view(backend, runtime, ctx, stage: int) -> _StageView:
    """The wrappers of one piece (`row_piece`) of a layer of `stage`, planned for this call: the
    stage's layers run the pieces in turn, and keeping every piece's plan through the stage
    would take a wrapper (8 MiB of plan workspace on the device, 8 MiB pinned) per piece and
    stage. Planned synchronously (a device sync per call, not one per kernel): the next call
    re-plans the same wrappers, which must not overwrite a pinned plan the stream has not
    copied yet."""
    piece = row_piece(ctx)
    req_to_token = backend.req_to_token_pool.req_to_token
    # The stage's valid prefix and the rows ahead of the piece, whose KV earlier pieces wrote.
    prefix_lens = [p[stage] + a for p, a in zip(ctx.kv.prefix_valid, piece.ahead)]
    if backend.forward_metadata.use_ragged:
        view = _StageView(ragged=_wrapper(backend, "ragged", PIECE))
        _plan_ragged(backend, view.ragged, piece.lens, non_blocking=False)
        if any(prefix_lens):
            _, indices, _ = stage_keys(runtime, req_to_token, ctx, stage, piece.ahead)
            view.prefix = _wrapper(backend, "prefix", PIECE)
            _plan_paged(backend, view.prefix, piece.lens, prefix_lens, indices.to(torch.int32),
                        causal=False, non_blocking=False)
        return view
    _, indices, _ = stage_keys(runtime, req_to_token, ctx, stage, piece.through)
    view = _StageView(paged=_wrapper(backend, "paged", PIECE))
    _plan_paged(backend, view.paged, piece.lens,
                [p + n for p, n in zip(prefix_lens, piece.lens)], indices.to(torch.int32),
                causal=True, non_blocking=False)
    return view


def _merge_state():
    """Upstream's merge of two partial attentions by log-sum-exp (it routes head counts that
    FlashInfer's kernel cannot launch to a Triton kernel); FlashInfer's own if it is renamed."""
    try:
        from sglang.srt.layers.attention.flashinfer_backend import _safe_merge_state
        return _safe_merge_state
    except ImportError:
        from flashinfer.cascade import merge_state
        return merge_state


def forward_extend(original, backend, q, k, v, layer, forward_batch, save_kv_cache=True,
                   *args, **kwargs):
    """AROUND `FlashInferAttnBackend.forward_extend`."""
    runtime, ctx = active_runtime(), drop_context(forward_batch)
    if not extend_needs_view(ctx, runtime, layer):
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache, *args, **kwargs)
    if k is None or args or kwargs or not ADAPTER.supported(backend):
        # Upstream would read KV this layer's stage does not hold: never fall through to it.
        why = ADAPTER.unsupported_reason(backend) or (
            "no new keys" if k is None else f"extra arguments {sorted(kwargs) or len(args)}")
        raise UniPrefillError(f"FlashInfer layer {layer.layer_id} needs a per-stage KV view "
                              f"that this call cannot take ({why})")
    stage = runtime.stages.stage(layer.layer_id)
    window = sliding_window(layer)
    # From the live batch: under the breakable prefill graph `forward_batch` is the runner's
    # static copy, sliced to this batch.
    view = (None if window is not None
            else _plan_extend_view(backend, runtime, ctx, ctx.forward_batch, stage))
    if save_kv_cache:
        write_kv(backend.token_to_kv_pool, layer,
                 ctx.survivors.out_cache_loc[row_piece(ctx).rows], k, v,
                 *backend._kv_write_scales(layer))
    if window is not None:
        return window_extend_attention(runtime, backend.token_to_kv_pool,
                                       backend.req_to_token_pool.req_to_token, layer, q, ctx,
                                       stage, window)
    q = q.contiguous().view(-1, layer.tp_q_head_num, layer.head_dim)
    kv_cache = backend.token_to_kv_pool.get_kv_buffer(layer.layer_id)
    if view.paged is not None:
        o = view.paged.forward(q, kv_cache, causal=True, sm_scale=layer.scaling,
                               logits_soft_cap=layer.logit_cap, k_scale=layer.k_scale_float,
                               v_scale=layer.v_scale_float)
        return o.view(-1, layer.tp_q_head_num * layer.head_dim)
    k = k.view(-1, layer.tp_k_head_num, layer.head_dim)
    v = v.view(-1, layer.tp_v_head_num, layer.head_dim)
    if view.prefix is None:
        o = view.ragged.forward(q, k, v, causal=True, sm_scale=layer.scaling,
                                logits_soft_cap=layer.logit_cap)
    else:
        o1, s1 = view.ragged.forward_return_lse(q, k, v, causal=True, sm_scale=layer.scaling,
                                                logits_soft_cap=layer.logit_cap)
        o2, s2 = view.prefix.forward_return_lse(q, kv_cache, causal=False,
                                                sm_scale=layer.scaling,
                                                logits_soft_cap=layer.logit_cap)
        o, _ = _merge_state()(o1, s1, o2, s2)
    return o.view(-1, layer.tp_q_head_num * layer.head_dim)


# ---- decode (eager) --------------------------------------------------------------------------
def _decode_plan_args(backend):
    upd = backend.indices_updater_decode
    return (upd.num_qo_heads, upd.num_kv_heads, upd.head_dim, 1), dict(
        data_type=upd.data_type, q_data_type=upd.q_data_type, non_blocking=True
    )


def init_forward_metadata(original, backend, forward_batch, *args, **kwargs):
    """AROUND `FlashInferAttnBackend.init_forward_metadata`: per-stage decode wrappers for a
    decode batch holding a request with sparse KV."""
    result = original(backend, forward_batch, *args, **kwargs)
    runtime, ctx = active_runtime(), drop_context(forward_batch)
    fb = forward_batch
    if (runtime is None or not fb.forward_mode.is_decode() or fb.spec_info is not None
            or not decode_needs_views(ctx, runtime) or not ADAPTER.supported(backend)):
        return result
    from sglang.srt.layers.attention.flashinfer_backend import DecodeMetadata

    bs = fb.req_pool_indices.shape[0]
    stages = stages_after_first(runtime)
    counts, _, indices = stage_views(
        runtime.slots, backend.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens,
        seq_lens_sum(fb, bs), bs)
    kv_lens = decode_stage_kv_lens(ctx, fb, bs, len(stages))
    if runtime.check_kv_lens:
        check_kv_lens(kv_lens, counts, "decode")
    pos_args, kw = _decode_plan_args(backend)
    last_page_len = torch.ones(bs, dtype=torch.int32)
    meta = backend.forward_metadata
    wrappers = list(meta.decode_wrappers)  # stage 0: upstream's
    for s in stages:
        w = _decode_wrapper(backend, s)
        w.begin_forward(_host_indptr(kv_lens[s - 1]), indices[s - 1], last_page_len, *pos_args,
                        fixed_split_size=backend.decode_split_tile_size, **kw)
        wrappers.append(w)
    staged = DecodeMetadata(wrappers, swa_out_cache_loc=meta.swa_out_cache_loc)
    staged.uniprefill_stage_wrappers = True
    window = _model_window(backend)
    if window is not None:
        _, indptr, indices, pos = _decode_window_views(backend, runtime, fb, bs, bs, window)
        qo_indptr = torch.arange(bs + 1, dtype=torch.int32, device=indptr.device)
        staged.uniprefill_windows = _window_lists(qo_indptr, indptr, indices, pos, stages)
    backend.forward_metadata = staged
    return result


def _window_lists(qo_indptr, indptr, indices, pos, stages) -> dict:
    """{stage: keys for `window_attention`} of a decode step, from `window_views`' rows."""
    return {s: (qo_indptr, indptr[s - 1], indices[s - 1], pos[s - 1]) for s in stages}


def forward_decode(original, backend, q, k, v, layer, forward_batch, save_kv_cache=True,
                   *args, **kwargs):
    """AROUND `FlashInferAttnBackend.forward_decode`: a sliding-window layer after the first
    drop attends over its stage's window list (`kernels.positional_attention`) when the step's
    metadata holds those lists; every other layer is upstream's."""
    lists = getattr(backend.forward_metadata, "uniprefill_windows", None)
    runtime = get_runtime()
    window = sliding_window(layer)
    keys = (lists.get(runtime.stages.stage(layer.layer_id))
            if lists and runtime is not None and window is not None else None)
    if keys is None:
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache, *args, **kwargs)
    if save_kv_cache:
        write_kv(backend.token_to_kv_pool, layer, forward_batch.out_cache_loc, k, v,
                 *backend._kv_write_scales(layer))
    return window_attention(backend.token_to_kv_pool, layer, q, forward_batch.positions, keys,
                            window, 1)


def get_wrapper_idx(original, backend, layer):
    """AROUND `FlashInferAttnBackend._get_wrapper_idx`: under staged metadata, a layer after
    the first drop runs its stage's wrapper."""
    if getattr(backend.forward_metadata, "uniprefill_stage_wrappers", False):
        runtime = get_runtime()
        stage = runtime.stages.stage(layer.layer_id) if runtime is not None else 0
        if stage:  # after upstream's wrappers, one per stage
            return backend.num_wrappers - 1 + stage
    return original(backend, layer)


# ---- decode CUDA graphs ----------------------------------------------------------------------
def init_cuda_graph_state(result, backend, *args, **kwargs):
    """AFTER `FlashInferAttnBackend.init_cuda_graph_state`: per-stage static index buffers
    (and window lists)."""
    runtime = active_runtime()
    if runtime is None or not ADAPTER.supported(backend):
        return result
    st = ADAPTER.state(backend)
    base_indices = backend.cuda_graph_kv_indices[0]
    num_stages = runtime.stages.num_drops
    entries = decode_graph_entries(runtime, base_indices.numel())
    st.graph_indptr = backend.kv_indptr[0].new_zeros((num_stages, backend.kv_indptr[0].numel()))
    st.graph_indices = base_indices.new_zeros((num_stages, entries))
    window = _model_window(backend)
    if window is not None:
        max_bs = backend.kv_indptr[0].numel() - 1
        entries = max_bs * (window + 1) + 1  # `compact`'s dump entry last
        st.graph_windows = (st.graph_indptr.new_zeros((num_stages, max_bs + 1)),
                            base_indices.new_zeros((num_stages, entries)),
                            base_indices.new_zeros((num_stages, entries)))
        st.graph_qo_indptr = torch.arange(max_bs + 1, dtype=torch.int32,
                                          device=base_indices.device)
    return result


def create_decode_wrappers(result, backend, *args, **kwargs):
    """AFTER `FlashInferAttnBackend._create_decode_wrappers(bs, num_tokens)`: one more wrapper
    per stage after the first, over that stage's static buffers."""
    runtime = active_runtime()
    st = ADAPTER.state(backend)
    if runtime is None or st.graph_indices is None or len(result) != backend.num_wrappers:
        return result
    from flashinfer import BatchDecodeWithPagedKVCacheWrapper

    num_tokens = kwargs.get("num_tokens", args[1] if len(args) > 1 else None)
    if num_tokens is None:
        num_tokens = kwargs.get("bs", args[0] if args else None)
    wrappers = list(result)
    for s in stages_after_first(runtime):
        w = BatchDecodeWithPagedKVCacheWrapper(
            backend.workspace_buffer,
            "NHD",
            backend=backend.decode_backend,
            use_cuda_graph=True,
            use_tensor_cores=backend.decode_use_tensor_cores,
            paged_kv_indptr_buffer=st.graph_indptr[s - 1][: num_tokens + 1],
            paged_kv_indices_buffer=st.graph_indices[s - 1],
            paged_kv_last_page_len_buffer=backend.kv_last_page_len[:num_tokens],
        )
        # One graph replays at a time and is re-planned right before: the int workspaces of a
        # stage can be shared by all captured batch sizes (saves 16 MB per wrapper). Not without
        # KV split (deterministic inference): FlashInfer's plan then has no block-valid mask, the
        # graph's padded CTAs read the workspace's request indices past this batch size, and a
        # larger batch size's plan left valid-looking ones there (illegal memory access).
        if not getattr(backend, "disable_cuda_graph_kv_split", False):
            shared = st.graph_int_ws.get(s)
            if shared is None:
                st.graph_int_ws[s] = (w._int_workspace_buffer, w._pin_memory_int_workspace_buffer)
            else:
                w._int_workspace_buffer, w._pin_memory_int_workspace_buffer = shared
        wrappers.append(w)
    return wrappers


def init_forward_metadata_out_graph(original, backend, forward_batch, in_capture=False,
                                    *args, **kwargs):
    """AROUND `FlashInferAttnBackend.init_forward_metadata_out_graph` (decode graph capture and
    replay preparation): fill and plan the per-stage wrappers of this batch size."""
    result = original(backend, forward_batch, in_capture, *args, **kwargs)
    runtime = active_runtime()
    fb = forward_batch
    if (runtime is None or fb.spec_info is not None or not fb.forward_mode.is_decode_or_idle()
            or not ADAPTER.supported(backend)):
        return result
    bs = fb.batch_size
    wrappers = backend.decode_cuda_graph_metadata.get(bs)
    stages = stages_after_first(runtime)
    if not wrappers or len(wrappers) != backend.num_wrappers + len(stages):
        return result
    from flashinfer import BatchDecodeWithPagedKVCacheWrapper

    ctx = drop_context(forward_batch)
    raw_bs = bs - int(getattr(fb, "num_padding", 0) or 0)
    rpi, seq_lens = fb.req_pool_indices[:bs], fb.seq_lens[:bs]
    n = seq_lens_sum(fb, bs)
    sparse = not in_capture and decode_has_sparse(ctx)
    st = ADAPTER.state(backend)
    if sparse:
        counts, _, _ = stage_views(
            runtime.slots, backend.req_to_token_pool.req_to_token, rpi, seq_lens, n, raw_bs,
            outs=st.graph_indices, indptr_outs=st.graph_indptr,
        )
        kv_lens = decode_stage_kv_lens(ctx, fb, bs, len(stages))
        if runtime.check_kv_lens:
            check_kv_lens(kv_lens, counts, "decode graph")
        host_indptrs = [_host_indptr(lens) for lens in kv_lens]
    else:
        # No request has sparse KV: every stage sees the whole sequences.
        seq = gather_seq_slots(backend.req_to_token_pool.req_to_token, rpi, seq_lens, n)
        st.graph_indices[:, :n].copy_(runtime.slots.pool_slots_after_first(seq.slots))
        st.graph_indptr[:, : bs + 1].copy_(seq.bounds.unsqueeze(0).expand(len(stages), bs + 1))
        host_indptrs = [_host_indptr(host_seq_lens(fb, bs))] * len(stages)
    pos_args, kw = _decode_plan_args(backend)
    last_page_len = backend.kv_last_page_len[:bs]
    for i, (s, w) in enumerate(zip(stages, wrappers[backend.num_wrappers:])):
        indptr = st.graph_indptr[s - 1][: bs + 1]
        total = int(host_indptrs[i][-1])
        if in_capture:
            # The first plan must be the real one (fast_decode_plan needs its cached module);
            # upstream has already swapped begin_forward for fast_decode_plan on the instance.
            BatchDecodeWithPagedKVCacheWrapper.plan(
                w, indptr, st.graph_indices[s - 1][:total], last_page_len, *pos_args,
                fixed_split_size=None, disable_split_kv=backend.disable_cuda_graph_kv_split,
                **kw,
            )
        else:
            w.begin_forward(
                indptr, st.graph_indices[s - 1], last_page_len, *pos_args,
                fixed_split_size=None, disable_split_kv=backend.disable_cuda_graph_kv_split,
                global_override_indptr_cpu=host_indptrs[i], **kw,
            )
    window = _model_window(backend)
    if window is not None:
        # Every step: the captured window layers of the later stages read these lists.
        indptr, indices, pos = st.graph_windows
        _decode_window_views(backend, runtime, fb, bs, raw_bs, window, outs=indices,
                             indptr_outs=indptr, pos_outs=pos)
    if in_capture:
        backend.forward_metadata.uniprefill_stage_wrappers = True
        if window is not None:
            backend.forward_metadata.uniprefill_windows = _window_lists(
                st.graph_qo_indptr[: bs + 1], indptr[:, : bs + 1], indices, pos, stages)
    return result
