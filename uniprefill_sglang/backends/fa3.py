"""FA3 backend adapter (SGLang's `FlashAttentionBackend` over sgl_kernel's FlashAttention 3):
extend attention over per-stage KV views.

FA3 reads a request's keys through a page table; with page size 1 a row of it lists KV slots,
so a stage's view is each request's valid slots at that stage as one padded row:

* Extend (stage > 0, compacted batch, sparse prefix or staged layout): the layer writes KV for
  the survivors it runs (all of them, or a piece's rows: `common.row_piece`), then attends
  through a page table whose row b holds request b's valid prefix at the stage, its rows ahead
  of the piece and the piece's own rows (`common.stage_keys`, in ascending positions), with
  `cache_seqlens` their count. FA3's causal mask is aligned to the bottom right (query i of n
  sees keys up to count - n + i), which is causality in original positions because a request's
  queries are its last keys and both ascend. Views are built once per stage and piece per
  forward (cached on the drop context), from host-known lengths: no device sync. Where the
  drop layers do not act (a dense extend over a cached prefix that lacks KV at later stages: a
  follow-up question), every stage runs the same rows and one pass builds every stage's page
  table (`_views_of_unchanged_rows`): a short step pays its views on the host.
* Decode is not served here: with UniPrefill, a server on fa3 decodes on FlashInfer
  (server_args.py sets the decode backend), whose adapter serves per-stage decode views and
  decode CUDA graphs. A decode step that reaches this backend with views needed raises, and
  the step re-runs without UniPrefill (patches/model_runner.py).
* Sliding-window layers after a drop (gpt-oss's, or Gemma 3's where a user names fa3): FA3's
  window counts KV entries, which is wrong once entries are missing, so such a layer runs
  `kernels.positional_attention` over the stage's keys masked by original positions, with the
  layer's attention-sink logits where it has them (`common.window_extend_attention`, as the
  Triton adapter does); a full-attention layer passes its sinks on to FA3 untouched. SGLang's
  separate sliding-window KV pool and chunked-local layers are not served
  (`unsupported_reason`).
* Multi-head latent attention (DeepSeek-V2/V3, a preview: architectures.py), absorbed form from
  the first drop layer on (model_integration.py): the model passes the latent (`k`) and its RoPE
  key (`k_rope`) apart, and FA3 reads both from the one latent KV head through the page table,
  so a stage's view is the same page table over latent slots; the adapter writes the
  survivors' latent at their own slots. FA3 runs that form only where the batch is not in the
  multi-head form's prefix mode (`attn_attend_prefix_cache`), which the layers before the first
  drop, run in the multi-head form, leave set: every absorbed call clears it for its duration.
  Decode runs on Triton (server_args.py), whose adapter serves MLA's per-stage decode views.
"""

from __future__ import annotations

import contextlib

import torch

from uniprefill_sglang.backends import block_sparse
from uniprefill_sglang.backends.common import (
    FP8_DTYPES,
    StageViewAdapter,
    active_runtime,
    extend_needs_view,
    extend_qo_indptr,
    needs_view,
    offsets,
    prefix_views,
    refuse_unservable_view,
    row_piece,
    sliding_window,
    stage_keys,
    view_cache,
    window_extend_attention,
    write_kv,
)
from uniprefill_sglang.context import drop_context
from uniprefill_sglang.errors import UniPrefillError
from uniprefill_sglang.kv_validity import segment_ids


class FA3Adapter(StageViewAdapter):
    target = "sglang.srt.layers.attention.flashattention_backend.FlashAttentionBackend"

    def unsupported_reason(self, backend):
        if backend.page_size != 1:
            return "FA3 with a page size other than 1"
        if backend.use_mla and backend.token_to_kv_pool.dtype in FP8_DTYPES:
            return "FA3 with MLA and an fp8 KV cache"
        if backend.use_sliding_window_kv_pool or backend.has_local_attention:
            return "FA3 with a separate sliding-window KV pool or chunked-local attention layers"
        if backend.has_swa and backend.token_to_kv_pool.dtype in FP8_DTYPES:
            return "FA3 with sliding-window layers and an fp8 KV cache"
        if backend.is_encoder_decoder or getattr(backend, "attn_cp_size", 1) > 1:
            return "FA3 with cross attention or context parallelism"
        if getattr(backend, "kv_cache_is_mxfp8", False) or getattr(
                backend, "fa_skip_kv_cache", False):
            return "FA3 with an MXFP8 KV cache or without a KV cache"
        return None

    def hooks(self):
        return [("forward_extend", forward_extend, "around"),
                ("forward_decode", forward_decode, "around")]


ADAPTER = FA3Adapter()

# The metadata fields a stage view replaces for one layer call.
_VIEW_FIELDS = ("page_table", "cache_seqlens_int32", "cu_seqlens_q", "cu_seqlens_k",
                "max_seq_len_q", "max_seq_len_k", "scheduler_metadata")


def page_table(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, width: int) -> torch.Tensor:
    """[bs, width] int32: row b holds kv_indices[kv_indptr[b]:kv_indptr[b + 1]], then zeros
    (FA3 reads a row only up to its `cache_seqlens`)."""
    starts = kv_indptr[:-1].to(torch.int64).unsqueeze(1)
    lens = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int64).unsqueeze(1)
    cols = torch.arange(width, device=kv_indices.device).unsqueeze(0)
    inside = cols < lens
    if kv_indices.numel() == 0:
        return torch.zeros(inside.shape, dtype=torch.int32, device=kv_indices.device)
    src = (starts + cols).clamp_(max=kv_indices.numel() - 1)
    return torch.where(inside, kv_indices[src], 0).to(torch.int32)


def _extend_view(runtime, backend, ctx, stage: int) -> tuple:
    """The `_VIEW_FIELDS` values of `stage` for the rows this call runs."""
    cache = view_cache(ctx, "_uniprefill_fa3_views")
    key = (stage, ctx.pieces.span)
    view = cache.get(key)
    if view is not None:
        return view
    if not ctx.acts and ctx.pieces.span is None:
        cache.update(_views_of_unchanged_rows(runtime, backend, ctx))
    else:
        cache[key] = _stage_view(runtime, backend, ctx, stage)
    return cache[key]


def _stage_view(runtime, backend, ctx, stage: int) -> tuple:
    """`_extend_view` of one stage, from its keys (`stage_keys`)."""
    piece = row_piece(ctx)
    through = piece.through
    kv_indptr, kv_indices, _ = stage_keys(runtime, backend.req_to_token, ctx, stage, through)
    # Host lengths: the stage's valid prefix (the plans' mirror) and the rows through the piece.
    counts = [p[stage] + t for p, t in zip(ctx.kv.prefix_valid, through)]
    width = max(counts, default=0)
    view = (page_table(kv_indptr, kv_indices, max(width, 1)),
            (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int32),
            extend_qo_indptr(ctx, stage).to(torch.int32),
            kv_indptr.to(torch.int32),
            max(piece.lens, default=0), width, None)
    return view


def _views_of_unchanged_rows(runtime, backend, ctx) -> dict:
    """`_extend_view` of every later stage, by stage, for a forward whose rows are the same at
    every stage (the drop layers do not act): page tables [D, bs, width] filled in one pass,
    each request's valid prefix at the stage (`prefix_views`) then its rows."""
    fb = ctx.forward_batch
    device = fb.req_pool_indices.device
    counts, indptr, indices = prefix_views(runtime, backend.req_to_token, fb, ctx,
                                           dtype=torch.int64)
    lens = ctx.survivors.lens
    bs, stages = len(lens), counts.shape[0]
    seqlens = [[p[v + 1] + n for p, n in zip(ctx.kv.prefix_valid, lens)] for v in range(stages)]
    width = max(1, max(max(row, default=0) for row in seqlens))
    dump = bs * width  # where the entries past a stage's prefix go
    # Each stage's table starts 64-byte aligned, as a table of its own would.
    tables = torch.zeros(stages, -(-(dump + 1) // 16) * 16, dtype=torch.int32, device=device)
    counts, indptr = counts.to(torch.int64), indptr.to(torch.int64)
    n = indices.shape[1] - 1
    if n:  # prefix entry i of stage v: request b with indptr[v, b] <= i < indptr[v, b + 1]
        i = torch.arange(n, device=device).expand(stages, n).contiguous()
        b = torch.searchsorted(indptr[:, 1:].contiguous(), i, right=True)
        col = i - indptr.gather(1, b.clamp(max=bs - 1))
        tables.scatter_(1, torch.where(b < bs, b * width + col, dump),
                        indices[:, :n].to(torch.int32))
    rows_indptr = offsets(lens, device)
    row_lens = rows_indptr[1:] - rows_indptr[:-1]
    n_rows = sum(lens)
    if n_rows:  # row r of request b lands after b's prefix at every stage
        b = segment_ids(row_lens, n_rows)
        col = counts[:, b] + (torch.arange(n_rows, device=device) - rows_indptr[b])
        slots = runtime.slots.pool_slots_after_first(ctx.survivors.out_cache_loc[:n_rows])
        tables.scatter_(1, b * width + col, slots.to(torch.int32))
    cache_seqlens = (counts + row_lens).to(torch.int32)
    cu_seqlens_k = torch.zeros(stages, bs + 1, dtype=torch.int32, device=device)
    torch.cumsum(cache_seqlens, 1, out=cu_seqlens_k[:, 1:])
    cu_seqlens_q = rows_indptr.to(torch.int32)
    return {(v + 1, None): (tables[v, :dump].view(bs, width), cache_seqlens[v], cu_seqlens_q,
                            cu_seqlens_k[v], max(lens, default=0), max(seqlens[v], default=0),
                            None)
            for v in range(stages)}


@contextlib.contextmanager
def _absorbed_form(forward_batch):
    """FA3's MLA path takes the absorbed form while the batch's `attn_attend_prefix_cache` is
    None (see the module docstring)."""
    mode = forward_batch.attn_attend_prefix_cache
    forward_batch.attn_attend_prefix_cache = None
    try:
        yield
    finally:
        forward_batch.attn_attend_prefix_cache = mode


def forward_extend(original, backend, q, k, v, layer, forward_batch, save_kv_cache=True,
                   *args, **kwargs):
    """AROUND `FlashAttentionBackend.forward_extend`."""
    # MLA's absorbed form, which UniPrefill runs from the first drop layer on.
    if backend.use_mla and kwargs.get("k_rope") is not None and active_runtime() is not None:
        with _absorbed_form(forward_batch):
            return _extend(original, backend, q, k, v, layer, forward_batch, save_kv_cache,
                           *args, **kwargs)
    sparse = block_sparse.extend_attention(backend.token_to_kv_pool, q, k, v, layer,
                                           forward_batch, save_kv_cache)
    if sparse is not None:
        return sparse
    return _extend(original, backend, q, k, v, layer, forward_batch, save_kv_cache,
                   *args, **kwargs)


def _extend(original, backend, q, k, v, layer, forward_batch, save_kv_cache, *args, **kwargs):
    runtime, ctx = active_runtime(), drop_context(forward_batch)
    if not extend_needs_view(ctx, runtime, layer):
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache, *args, **kwargs)
    refuse_unservable_view(ADAPTER, backend, layer, k, v, kwargs)
    stage = runtime.stages.stage(layer.layer_id)
    k_rope = kwargs.get("k_rope")
    if save_kv_cache:
        slots = ctx.survivors.out_cache_loc[row_piece(ctx).rows]
        if k_rope is not None:
            backend.token_to_kv_pool.set_mla_kv_buffer(layer, slots, k, k_rope)
        else:
            write_kv(backend.token_to_kv_pool, layer, slots, k, v, layer.k_scale,
                     layer.v_scale)
    window = sliding_window(layer)
    if window is not None:
        return window_extend_attention(runtime, backend.token_to_kv_pool, backend.req_to_token,
                                       layer, q, ctx, stage, window, sinks=kwargs.get("sinks"))
    view = _extend_view(runtime, backend, ctx, stage)
    meta = backend.forward_metadata
    saved = tuple(getattr(meta, f) for f in _VIEW_FIELDS)
    for f, x in zip(_VIEW_FIELDS, view):
        setattr(meta, f, x)
    # The prefill graph's output buffer (set by SGLang's attention op, never cleared): FA3 writes
    # into it when it has the survivors' rows; otherwise it is left out and the op copies.
    out = getattr(forward_batch, "_attn_output", None)
    q_width = layer.qk_head_dim if k_rope is None else layer.v_head_dim  # MLA: the latent part
    if out is not None and (out.numel() // (layer.tp_q_head_num * layer.v_head_dim)
                            != q.numel() // (layer.tp_q_head_num * q_width)):
        forward_batch._attn_output = None
    try:
        # KV already written above, at the survivors' slots.
        return original(backend, q, k, v, layer, forward_batch, False, *args, **kwargs)
    finally:
        for f, x in zip(_VIEW_FIELDS, saved):
            setattr(meta, f, x)
        if out is not None:
            forward_batch._attn_output = out


def forward_decode(original, backend, q, k, v, layer, forward_batch, *args, **kwargs):
    """AROUND `FlashAttentionBackend.forward_decode`: a decode step whose layer needs a view
    never reads upstream's full page table (see the module docstring)."""
    ctx, runtime = drop_context(forward_batch), active_runtime()
    if ctx is not None and not ctx.is_extend and needs_view(ctx, runtime, layer):
        raise UniPrefillError(f"FA3 layer {layer.layer_id}: decode over per-stage KV views runs "
                              "on the FlashInfer decode backend, not FA3")
    return original(backend, q, k, v, layer, forward_batch, *args, **kwargs)
