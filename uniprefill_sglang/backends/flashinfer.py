"""FlashInfer backend adapter: attention over per-stage KV views.

A layer of stage s may attend, for request b, to the slots of b's sequence whose KV it holds
(`slot_stage >= s`) in position order; after a drop the surviving new tokens are exactly the
last `ctx.lens[b]` entries of that list (their slots are FULL, the dropped ones are below s, and
so are the rows that chunked prefill parked and did not keep). So plain causal paged attention
(query i of qo_len sees kv entries up to kv_len - qo_len + i) over that compacted list is exact.

* Extend (EXTEND / MIXED): at the first layer of a stage that needs a view (stage > 0 and the
  batch is compacted or holds a sparse prefix) one paged prefill wrapper per stage is planned
  with qo_indptr from `ctx.lens` and the compacted kv list (one host sync for the counts), cached
  on the drop context and run by every layer of that stage. Those layers write KV for the
  survivors only (`ctx.out_cache_loc`). Stage 0 and dense batches run upstream code.
* Decode: for a batch with a sparse request, one decode wrapper per stage > 0 is planned once
  per step; `_get_wrapper_idx` returns the layer's stage while such a metadata is active. Dense
  batches keep upstream's single wrapper.
* Decode CUDA graphs: every captured batch size gets one wrapper per stage, with per-stage
  static indptr / indices buffers (their int workspaces shared across batch sizes, since one
  graph replays at a time). On replay the buffers are refilled and re-planned outside the graph
  (`fast_decode_plan`, host indptr known: no sync for dense batches, one for sparse ones).

The helpers at the top (gather / compaction on the device, no host sync) are shared with the
Triton adapter.
"""

from __future__ import annotations

import functools
from typing import Dict, List, Optional

import torch

from uniprefill_sglang.context import current
from uniprefill_sglang.runtime import get_runtime


# ---- shared helpers ------------------------------------------------------------------------
def active_runtime():
    """The runtime when UniPrefill is on with a drop schedule, else None (hooks stay inert)."""
    runtime = get_runtime()
    if runtime is None or not runtime.has_schedule:
        return None
    return runtime


def extend_needs_view(ctx, runtime, layer) -> bool:
    """Does this extend layer need a per-stage view (same rule as the torch_native adapter)?"""
    if runtime is None or ctx is None or not ctx.is_extend or ctx.sparse is None:
        return False
    if getattr(layer, "is_cross_attention", False):
        return False
    if runtime.stages.stage(layer.layer_id) == 0:
        return False  # stage 0 holds every token; compaction only starts after the first drop
    return ctx.compacted or any(ctx.sparse)


def decode_has_sparse(ctx) -> bool:
    return ctx is not None and not ctx.is_extend and bool(ctx.sparse) and any(ctx.sparse)


def stages_after_first(runtime) -> List[int]:
    return list(range(1, runtime.stages.num_drops + 1))


def segment_ids(lens: torch.Tensor, n: int) -> torch.Tensor:
    """[0,0,1,2,2,2,...]: the segment of each of the n = sum(lens) elements."""
    bs = lens.shape[0]
    return torch.repeat_interleave(
        torch.arange(bs, device=lens.device), lens.to(torch.int64), output_size=n
    )


def gather_seq_slots(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     seq_lens: torch.Tensor, n: int):
    """The slots of positions [0, seq_len) of each request, concatenated; and their segment ids."""
    lens = seq_lens[: req_pool_indices.shape[0]].to(torch.int64)
    row = segment_ids(lens, n)
    start = torch.cumsum(lens, 0) - lens
    col = torch.arange(n, device=lens.device) - start[row]
    slots = req_to_token[req_pool_indices.to(torch.int64)[row], col]
    return slots, row


def compact(slots: torch.Tensor, row: torch.Tensor, keep: torch.Tensor, bs: int,
            out: Optional[torch.Tensor] = None, indptr_out: Optional[torch.Tensor] = None,
            dtype: Optional[torch.dtype] = None):
    """Keep `slots[keep]`, segment by segment, without a host sync.

    Returns (counts[bs] int32, indptr[bs + 1] int32, indices). Kept entries land at their
    compacted position; the others are scattered to the buffer's last element (a dump slot),
    so `out` needs at least n + 1 elements.
    """
    device = slots.device
    n = slots.shape[0]
    counts = torch.zeros(bs, dtype=torch.int32, device=device)
    if n:
        counts.index_add_(0, row, keep.to(torch.int32))
    indptr = indptr_out if indptr_out is not None else torch.empty(
        bs + 1, dtype=torch.int32, device=device)
    indptr = indptr[: bs + 1]
    indptr[:1].zero_()
    torch.cumsum(counts, 0, out=indptr[1:])
    if out is None:
        out = torch.empty(n + 1, dtype=dtype or slots.dtype, device=device)
    elif out.numel() < n + 1:
        raise RuntimeError(f"UniPrefill: KV index buffer of {out.numel()} entries is too small "
                           f"for {n} candidate slots")
    if n:
        pos = torch.cumsum(keep, 0) - 1
        dest = torch.where(keep, pos, out.numel() - 1)
        out.scatter_(0, dest, slots.to(out.dtype))
    return counts, indptr, out


def decode_stage_views(runtime, req_to_token, req_pool_indices, seq_lens, n: int, raw_bs: int,
                       stages, outs=None, indptr_outs=None, dtype=None):
    """Per stage: the KV list of each decode request. Requests without sparse KV, and the
    padding rows of a CUDA-graph batch (index >= raw_bs), keep their whole sequence."""
    bs = req_pool_indices.shape[0]
    slots, row = gather_seq_slots(req_to_token, req_pool_indices, seq_lens, n)
    full = ~runtime.slots.req_sparse[req_pool_indices.to(torch.int64)]
    if raw_bs < bs:
        full[raw_bs:] = True
    full_el = full[row]
    st = runtime.slots.slot_stage[slots.to(torch.int64)]
    views = {}
    for s in stages:
        keep = (st >= s) | full_el
        views[s] = compact(slots, row, keep, bs,
                           out=None if outs is None else outs[s],
                           indptr_out=None if indptr_outs is None else indptr_outs[s],
                           dtype=dtype)
    return views


def extend_stage_slots(runtime, req_to_token, forward_batch, stage: int):
    """Extend at `stage`: every slot of each request's sequence with its validity at `stage`."""
    fb = forward_batch
    n = _seq_lens_sum(fb)
    slots, row = gather_seq_slots(req_to_token, fb.req_pool_indices, fb.seq_lens, n)
    valid = runtime.slots.slot_stage[slots.to(torch.int64)] >= stage
    return slots, row, valid


def _seq_lens_sum(fb) -> int:
    bs = fb.req_pool_indices.shape[0]
    if getattr(fb, "seq_lens_cpu", None) is not None:
        return int(fb.seq_lens_cpu[:bs].sum())
    if getattr(fb, "seq_lens_sum", None) is not None:
        return int(fb.seq_lens_sum)
    return int(fb.seq_lens[:bs].sum().item())


def write_kv(pool, layer, loc, k, v, k_scale=None, v_scale=None) -> None:
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    if k_scale is None and v_scale is None:
        pool.set_kv_buffer(layer, KVWriteLoc(loc, None), k, v)
    else:
        pool.set_kv_buffer(layer, KVWriteLoc(loc, None), k, v, k_scale, v_scale)


def _view_cache(ctx, key: str) -> dict:
    cache = getattr(ctx, key, None)
    if cache is None:
        cache = {}
        setattr(ctx, key, cache)
    return cache


# ---- per-backend state -----------------------------------------------------------------------
class _State:
    def __init__(self):
        self.extend_wrappers: Dict[int, object] = {}
        self.decode_wrappers: Dict[int, object] = {}
        # Decode CUDA graphs: per-stage static buffers and shared int workspaces.
        self.graph_indptr: Optional[Dict[int, torch.Tensor]] = None
        self.graph_indices: Optional[Dict[int, torch.Tensor]] = None
        self.graph_int_ws: Dict[int, tuple] = {}


def _state(backend) -> _State:
    st = backend.__dict__.get("_uniprefill_state")
    if st is None:
        st = _State()
        backend._uniprefill_state = st
    return st


def _supported(backend) -> bool:
    if backend.num_wrappers != 1:
        return False  # sliding-window / cross-attention wrapper pairs: not a UniPrefill model
    if backend.page_size != 1:
        raise RuntimeError("--enable-uniprefill with the FlashInfer backend needs --page-size 1")
    if backend.prefill_uses_dequant_workspace or backend.decode_uses_dequant_workspace:
        raise RuntimeError("--enable-uniprefill does not support FP4 dequant-workspace KV caches")
    return True


# ---- extend ----------------------------------------------------------------------------------
def _extend_wrapper(backend, stage: int):
    from flashinfer import BatchPrefillWithPagedKVCacheWrapper

    st = _state(backend)
    w = st.extend_wrappers.get(stage)
    if w is None:
        w = BatchPrefillWithPagedKVCacheWrapper(
            backend.workspace_buffer, "NHD", backend=backend.prefill_backend
        )
        st.extend_wrappers[stage] = w
    return w


def _plan_extend_view(backend, runtime, ctx, fb, stage: int):
    """Plan (once per stage per forward) the paged prefill wrapper of `stage`."""
    cache = _view_cache(ctx, "_uniprefill_fi_views")
    wrapper = cache.get(stage)
    if wrapper is not None:
        return wrapper
    bs = fb.req_pool_indices.shape[0]
    req_to_token = backend.req_to_token_pool.req_to_token
    slots, row, valid = extend_stage_slots(runtime, req_to_token, fb, stage)
    counts, _, indices = compact(slots, row, valid, bs)
    kv_lens = counts.cpu()  # the one host sync of this stage: FlashInfer plans on the host
    qo_lens = torch.tensor(ctx.lens, dtype=torch.int32)
    if bool((kv_lens < qo_lens).any()):
        raise RuntimeError(
            f"UniPrefill: stage {stage} KV view shorter than its queries "
            f"(kv {kv_lens.tolist()}, q {ctx.lens})"
        )
    qo_indptr = torch.zeros(bs + 1, dtype=torch.int32)
    kv_indptr = torch.zeros(bs + 1, dtype=torch.int32)
    torch.cumsum(qo_lens, 0, out=qo_indptr[1:])
    torch.cumsum(kv_lens, 0, out=kv_indptr[1:])
    upd = backend.indices_updater_prefill
    wrapper = _extend_wrapper(backend, stage)
    wrapper.plan(
        qo_indptr,
        kv_indptr,
        indices,
        torch.ones(bs, dtype=torch.int32),
        upd.num_qo_heads,
        upd.num_kv_heads,
        upd.head_dim,
        1,
        causal=True,
        q_data_type=upd.q_data_type,
        kv_data_type=upd.data_type,
        non_blocking=True,
    )
    cache[stage] = wrapper
    return wrapper


def forward_extend(original, backend, q, k, v, layer, forward_batch, save_kv_cache=True,
                   *args, **kwargs):
    """AROUND `FlashInferAttnBackend.forward_extend`."""
    runtime, ctx = active_runtime(), current()
    if (not extend_needs_view(ctx, runtime, layer) or k is None or args or kwargs
            or not _supported(backend)):
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache, *args, **kwargs)
    stage = runtime.stages.stage(layer.layer_id)
    wrapper = _plan_extend_view(backend, runtime, ctx, forward_batch, stage)
    if save_kv_cache:
        write_kv(backend.token_to_kv_pool, layer, ctx.out_cache_loc, k, v,
                 *backend._kv_write_scales(layer))
    o = wrapper.forward(
        q.contiguous().view(-1, layer.tp_q_head_num, layer.head_dim),
        backend.token_to_kv_pool.get_kv_buffer(layer.layer_id),
        causal=True,
        sm_scale=layer.scaling,
        logits_soft_cap=layer.logit_cap,
        k_scale=layer.k_scale_float,
        v_scale=layer.v_scale_float,
    )
    return o.view(-1, layer.tp_q_head_num * layer.head_dim)


# ---- decode (eager) --------------------------------------------------------------------------
def _decode_plan_args(backend):
    upd = backend.indices_updater_decode
    return (upd.num_qo_heads, upd.num_kv_heads, upd.head_dim, 1), dict(
        data_type=upd.data_type, q_data_type=upd.q_data_type, non_blocking=True
    )


def _host_indptr(lens: torch.Tensor) -> torch.Tensor:
    indptr = torch.zeros(lens.shape[0] + 1, dtype=torch.int32)
    torch.cumsum(lens.to(torch.int32), 0, out=indptr[1:])
    return indptr


def init_forward_metadata(original, backend, forward_batch, *args, **kwargs):
    """AROUND `FlashInferAttnBackend.init_forward_metadata`: per-stage decode wrappers for a
    decode batch holding a request with sparse KV."""
    result = original(backend, forward_batch, *args, **kwargs)
    runtime, ctx = active_runtime(), current()
    fb = forward_batch
    if (runtime is None or not fb.forward_mode.is_decode() or fb.spec_info is not None
            or not decode_has_sparse(ctx) or not _supported(backend)):
        return result
    from flashinfer import BatchDecodeWithPagedKVCacheWrapper
    from sglang.srt.layers.attention.flashinfer_backend import DecodeMetadata

    st = _state(backend)
    bs = fb.req_pool_indices.shape[0]
    stages = stages_after_first(runtime)
    views = decode_stage_views(runtime, backend.req_to_token_pool.req_to_token,
                               fb.req_pool_indices, fb.seq_lens, _seq_lens_sum(fb), bs, stages)
    counts = torch.stack([views[s][0] for s in stages]).cpu()  # one host sync per step
    pos_args, kw = _decode_plan_args(backend)
    last_page_len = torch.ones(bs, dtype=torch.int32)
    meta = backend.forward_metadata
    wrappers = [meta.decode_wrappers[0]]
    for i, s in enumerate(stages):
        w = st.decode_wrappers.get(s)
        if w is None:
            w = BatchDecodeWithPagedKVCacheWrapper(
                backend.workspace_buffer, "NHD", backend=backend.decode_backend,
                use_tensor_cores=backend.decode_use_tensor_cores,
            )
            st.decode_wrappers[s] = w
        w.begin_forward(_host_indptr(counts[i]), views[s][2], last_page_len, *pos_args,
                        fixed_split_size=backend.decode_split_tile_size, **kw)
        wrappers.append(w)
    staged = DecodeMetadata(wrappers, swa_out_cache_loc=meta.swa_out_cache_loc)
    staged.uniprefill_staged = True
    backend.forward_metadata = staged
    return result


def get_wrapper_idx(original, backend, layer):
    """AROUND `FlashInferAttnBackend._get_wrapper_idx`: the layer's stage under staged metadata."""
    if getattr(backend.forward_metadata, "uniprefill_staged", False):
        runtime = get_runtime()
        if runtime is not None:
            return runtime.stages.stage(layer.layer_id)
    return original(backend, layer)


# ---- decode CUDA graphs ----------------------------------------------------------------------
def init_cuda_graph_state(result, backend, *args, **kwargs):
    """AFTER `FlashInferAttnBackend.init_cuda_graph_state`: per-stage static index buffers."""
    runtime = active_runtime()
    if runtime is None or not _supported(backend):
        return result
    st = _state(backend)
    base_indices = backend.cuda_graph_kv_indices[0]
    st.graph_indptr = {s: torch.zeros_like(backend.kv_indptr[0]) for s in stages_after_first(runtime)}
    st.graph_indices = {s: torch.zeros_like(base_indices) for s in stages_after_first(runtime)}
    return result


def create_decode_wrappers(result, backend, *args, **kwargs):
    """AFTER `FlashInferAttnBackend._create_decode_wrappers(bs, num_tokens)`: one more wrapper
    per stage after the first, over that stage's static buffers."""
    runtime = active_runtime()
    st = _state(backend)
    if runtime is None or st.graph_indices is None or len(result) != 1:
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
            paged_kv_indptr_buffer=st.graph_indptr[s][: num_tokens + 1],
            paged_kv_indices_buffer=st.graph_indices[s],
            paged_kv_last_page_len_buffer=backend.kv_last_page_len[:num_tokens],
        )
        # One graph replays at a time and is re-planned right before: the int workspaces of a
        # stage can be shared by all captured batch sizes (saves 16 MB per wrapper).
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
            or not _supported(backend)):
        return result
    bs = fb.batch_size
    wrappers = backend.decode_cuda_graph_metadata.get(bs)
    stages = stages_after_first(runtime)
    if not wrappers or len(wrappers) != len(stages) + 1:
        return result
    from flashinfer import BatchDecodeWithPagedKVCacheWrapper

    ctx = current()
    raw_bs = bs - int(getattr(fb, "num_padding", 0) or 0)
    rpi, seq_lens = fb.req_pool_indices[:bs], fb.seq_lens[:bs]
    n = _seq_lens_sum(fb)
    sparse = not in_capture and decode_has_sparse(ctx)
    st = _state(backend)
    if sparse:
        views = decode_stage_views(
            runtime, backend.req_to_token_pool.req_to_token, rpi, seq_lens, n, raw_bs, stages,
            outs=st.graph_indices, indptr_outs=st.graph_indptr,
        )
        counts = torch.stack([views[s][0] for s in stages]).cpu()  # one host sync per step
        host_indptrs = [_host_indptr(counts[i]) for i in range(len(stages))]
    else:
        # No request has sparse KV: every stage sees the whole sequences.
        slots, _ = gather_seq_slots(backend.req_to_token_pool.req_to_token, rpi, seq_lens, n)
        if getattr(fb, "seq_lens_cpu", None) is not None:
            dense_host = _host_indptr(fb.seq_lens_cpu[:bs])
        else:
            dense_host = _host_indptr(seq_lens.cpu())
        for s in stages:
            st.graph_indices[s][:n].copy_(slots)
            st.graph_indptr[s][:1].zero_()
            torch.cumsum(seq_lens.to(torch.int32), 0, out=st.graph_indptr[s][1 : bs + 1])
        host_indptrs = [dense_host] * len(stages)
    pos_args, kw = _decode_plan_args(backend)
    last_page_len = backend.kv_last_page_len[:bs]
    for i, (s, w) in enumerate(zip(stages, wrappers[1:])):
        indptr = st.graph_indptr[s][: bs + 1]
        total = int(host_indptrs[i][-1])
        if in_capture:
            # The first plan must be the real one (fast_decode_plan needs its cached module);
            # upstream has already swapped begin_forward for fast_decode_plan on the instance.
            BatchDecodeWithPagedKVCacheWrapper.plan(
                w, indptr, st.graph_indices[s][:total], last_page_len, *pos_args,
                fixed_split_size=None, disable_split_kv=backend.disable_cuda_graph_kv_split,
                **kw,
            )
        else:
            w.begin_forward(
                indptr, st.graph_indices[s], last_page_len, *pos_args,
                fixed_split_size=None, disable_split_kv=backend.disable_cuda_graph_kv_split,
                global_override_indptr_cpu=host_indptrs[i], **kw,
            )
    if in_capture:
        backend.forward_metadata.uniprefill_staged = True
    return result


def register(register_hook, around, after) -> None:
    target = "sglang.srt.layers.attention.flashinfer_backend.FlashInferAttnBackend"
    register_hook(f"{target}.forward_extend", forward_extend, around)
    register_hook(f"{target}.init_forward_metadata", init_forward_metadata, around)
    register_hook(f"{target}._get_wrapper_idx", get_wrapper_idx, around)
    register_hook(f"{target}.init_cuda_graph_state", init_cuda_graph_state, after)
    register_hook(f"{target}._create_decode_wrappers", create_decode_wrappers, after)
    register_hook(f"{target}.init_forward_metadata_out_graph", init_forward_metadata_out_graph,
                  around)
