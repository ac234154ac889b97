"""torch_native backend adapter: per-request SDPA over the KV a layer's stage holds.

Requests whose KV is complete at this layer go through the backend's own per-request SDPA (over
the stage pool's slots under the staged KV layout), so dense requests get bit-identical results
whether or not a neighbour in the batch dropped, and whichever the layout.
Requests with missing KV attend to their valid slots with an explicit causal mask on the
original positions; a sliding-window layer's mask also leaves out keys more than its window
before the query, measured in original positions (as upstream measures it on a whole sequence).
A layer run in pieces (`common.row_piece`) takes each request's rows in the piece, with the
keys up to the piece's end: its valid prefix and survivors, the piece's own rows last.
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

from uniprefill_sglang.backends import block_sparse
from uniprefill_sglang.backends.common import (StageViewAdapter, needs_view, row_piece,
                                               sliding_window)
from uniprefill_sglang.context import drop_context
from uniprefill_sglang.device import to_device
from uniprefill_sglang.runtime import get_runtime


class TorchNativeAdapter(StageViewAdapter):
    target = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"

    def hooks(self):
        return [("forward_extend", forward_extend, "around"),
                ("forward_decode", forward_decode, "around")]


ADAPTER = TorchNativeAdapter()


def _request_slots(runtime, req_to_token, row: int, seq_len: int, stage: int):
    """(req_to_token, req_pool_indices) for upstream's per-request SDPA over one request's
    whole sequence, addressed in `stage`'s pool (a one-row table under the staged layout)."""
    if stage == 0 or not runtime.slots.staged:
        return req_to_token, None
    slots = runtime.slots.pool_slots(req_to_token[row, :seq_len], stage)
    return slots.unsqueeze(0), torch.zeros(1, dtype=torch.int64, device=slots.device)


def _write_kv(backend, layer, loc, k, v, save_kv_cache):
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    if save_kv_cache and k is not None and v is not None:
        backend.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(loc, None), k, v)


def _visible(kpos, qpos, window):
    """[n, m] mask: the key positions each query position may attend to."""
    mask = kpos.unsqueeze(0) <= qpos.unsqueeze(1)
    if window is not None:
        mask &= kpos.unsqueeze(0) >= qpos.unsqueeze(1) - window
    return mask


def _masked_sdpa(q, k, v, mask, layer):
    # q: [n, Hq, D], k/v: [m, Hkv, D], mask: [n, m] bool or None -> [n, Hq, Dv]
    out = scaled_dot_product_attention(
        q.movedim(0, 1).unsqueeze(0),
        k.movedim(0, 1).unsqueeze(0).to(q.dtype),
        v.movedim(0, 1).unsqueeze(0).to(q.dtype),
        attn_mask=mask,
        scale=layer.scaling,
        enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
    )
    return out.squeeze(0).movedim(1, 0)


def forward_extend(original, backend, q, k, v, layer, forward_batch, save_kv_cache=True, **kw):
    sparse = block_sparse.extend_attention(backend.token_to_kv_pool, q, k, v, layer,
                                           forward_batch, save_kv_cache)
    if sparse is not None:
        return sparse
    ctx, runtime = drop_context(forward_batch), get_runtime()
    if not (ctx is not None and ctx.is_extend and needs_view(ctx, runtime, layer)):
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache, **kw)
    fb = forward_batch
    stage = runtime.stages.stage(layer.layer_id)
    piece = row_piece(ctx)
    q = q.reshape(-1, layer.tp_q_head_num * layer.qk_head_dim)  # Gemma 3 passes [1, n, H, D]
    _write_kv(backend, layer, ctx.survivors.out_cache_loc[piece.rows], k, v, save_kv_cache)
    o = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
    q_ = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
    o_ = o.view(-1, layer.tp_q_head_num, layer.v_head_dim)
    k_cache = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
    v_cache = backend.token_to_kv_pool.get_value_buffer(layer.layer_id)
    req_to_token = backend.req_to_token_pool.req_to_token
    seq_lens = fb.seq_lens_cpu.tolist()
    rows = fb.req_pool_indices.tolist()
    positions = ctx.survivors.positions[piece.rows]
    s = 0
    for b, (n, ahead) in enumerate(zip(piece.lens, piece.ahead)):
        if n == 0:
            continue
        # Keys through the piece's last row: the prefix, the rows ahead, the piece's own.
        sparse = ctx.kv.sparse[b] and stage > 0
        before = (ctx.kv.prefix_valid[b][stage] if sparse else ctx.survivors.fixed_lens[b]) + ahead
        if sparse:
            slots, kpos = runtime.slots.valid_slots(req_to_token[rows[b], : seq_lens[b]], stage)
            slots = runtime.slots.pool_slots(slots[: before + n], stage)
            mask = _visible(kpos[: before + n], positions[s : s + n], sliding_window(layer))
            o_[s : s + n] = _masked_sdpa(q_[s : s + n], k_cache[slots], v_cache[slots], mask, layer)
        else:
            table, row = _request_slots(runtime, req_to_token, rows[b], before + n, stage)
            lens = to_device([before + n, before, n], torch.int64, q.device)
            backend._run_sdpa_forward_extend(
                q_[s : s + n], o_[s : s + n], k_cache, v_cache, table,
                fb.req_pool_indices[b : b + 1] if row is None else row,
                lens[0:1], lens[1:2], lens[2:3],
                scaling=layer.scaling,
                enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
                causal=True,
                sliding_window_size=sliding_window(layer),
            )
        s += n
    return o


def forward_decode(original, backend, q, k, v, layer, forward_batch, save_kv_cache=True, **kw):
    ctx, runtime = drop_context(forward_batch), get_runtime()
    if not (ctx is not None and not ctx.is_extend and needs_view(ctx, runtime, layer)):
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache, **kw)
    fb = forward_batch
    stage = runtime.stages.stage(layer.layer_id)
    q = q.reshape(-1, layer.tp_q_head_num * layer.qk_head_dim)
    _write_kv(backend, layer, fb.out_cache_loc, k, v, save_kv_cache)
    o = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
    q_ = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
    o_ = o.view(-1, layer.tp_q_head_num, layer.v_head_dim)
    k_cache = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
    v_cache = backend.token_to_kv_pool.get_value_buffer(layer.layer_id)
    req_to_token = backend.req_to_token_pool.req_to_token
    seq_lens = fb.seq_lens_cpu.tolist()
    rows = fb.req_pool_indices.tolist()
    for b in range(len(rows)):
        if ctx.kv.sparse[b]:
            slots, kpos = runtime.slots.valid_slots(req_to_token[rows[b], : seq_lens[b]], stage)
            slots = runtime.slots.pool_slots(slots, stage)
            window = sliding_window(layer)
            mask = None if window is None else _visible(
                kpos, kpos.new_full((1,), seq_lens[b] - 1), window)
            o_[b : b + 1] = _masked_sdpa(q_[b : b + 1], k_cache[slots], v_cache[slots], mask, layer)
        else:
            table, row = _request_slots(runtime, req_to_token, rows[b], seq_lens[b], stage)
            backend._run_sdpa_forward_decode(
                q_[b : b + 1], o_[b : b + 1], k_cache, v_cache, table,
                fb.req_pool_indices[b : b + 1] if row is None else row, fb.seq_lens[b : b + 1],
                scaling=layer.scaling,
                enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
                causal=False,
                sliding_window_size=sliding_window(layer),
            )
    return o
