"""What every attention-backend adapter shares: the base class each adapter is
(`StageViewAdapter`: the upstream class it hooks, its per-backend state, whether a backend
instance can serve the views), the one rule of when a layer reads KV through a per-stage view,
and the helpers of the GPU adapters (batch sizes read without a device sync, the survivors'
KV write, the prefix view, and the sliding-window layers after a drop, which every GPU backend
serves with `kernels.positional_attention`). The views themselves are built by kv_validity.py.

An attention layer after a drop may run its survivors in pieces (model_integration.py,
`ctx.pieces.span`): a piece's queries see what the unpieced layer's would, the stage's valid
prefix, their request's rows ahead of the piece (written by earlier pieces) and, causally, the
piece's own rows (`row_piece`, `stage_keys`)."""

from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from uniprefill_sglang import environ, kernels
from uniprefill_sglang.device import to_device
from uniprefill_sglang.errors import CheckFailed, UniPrefillError
from uniprefill_sglang.kv_validity import (
    check_kv_lens,
    extend_stage_slots,
    segment_ids,
    stage_views,
)
from uniprefill_sglang.runtime import get_runtime


def active_runtime():
    """The runtime when UniPrefill is on with a drop schedule, else None (hooks stay inert)."""
    runtime = get_runtime()
    if runtime is None or not runtime.has_schedule:
        return None
    return runtime


def needs_view(ctx, runtime, layer=None) -> bool:
    """The view rule: does this layer (for a decode step, without `layer`: its later stages)
    read KV through a per-stage view? Stage 0 holds every token; a later stage needs one once a
    drop compacted the batch, while a request lacks KV there, or always under the staged KV
    layout, whose later stages keep their KV in pools of their own."""
    if runtime is None or ctx is None or ctx.kv.sparse is None:
        return False
    if layer is not None and (getattr(layer, "is_cross_attention", False)
                              or runtime.stages.stage(layer.layer_id) == 0):
        return False
    return ctx.survivors.compacted or any(ctx.kv.sparse) or runtime.slots.staged


def extend_needs_view(ctx, runtime, layer) -> bool:
    return ctx is not None and ctx.is_extend and needs_view(ctx, runtime, layer)


def refuse_unservable_view(adapter, backend, layer, k, v, kwargs) -> None:
    """Raise when a layer that needs a per-stage view cannot take one in this call (a backend
    set-up the adapter does not serve, no new keys, a score modifier): upstream would read KV
    the layer's stage does not hold, so the call never falls through to it (the step re-runs
    without UniPrefill: patches/model_runner.py)."""
    why = adapter.unsupported_reason(backend)
    if why is None and (k is None or v is None):
        why = "no new keys"
    if why is None:
        why = next((f"a {name}" for name in ("score_mod", "rel_bias")
                    if kwargs.get(name) is not None), None)
    if why is not None:
        raise UniPrefillError(f"{adapter.class_name} layer {layer.layer_id} needs a per-stage KV "
                              f"view that this call cannot take ({why})")


# KV dtypes the positional kernel (sliding-window layers after a drop) does not read.
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def sliding_window(layer) -> Optional[int]:
    """The layer's window as upstream counts it (a query sees keys at most this many positions
    back), or None for full attention."""
    window = getattr(layer, "sliding_window_size", None)
    return window if window is not None and window > -1 else None


def decode_needs_views(ctx, runtime) -> bool:
    return ctx is not None and not ctx.is_extend and needs_view(ctx, runtime)


def decode_has_sparse(ctx) -> bool:
    """Does some request of a decode step lack KV in a later stage?"""
    return ctx is not None and not ctx.is_extend and bool(ctx.kv.sparse) and any(ctx.kv.sparse)


class StageViewAdapter:
    """An attention backend taught the per-stage KV views; every adapter is one.

    It names the upstream class it hooks (`target`) and its hooks (`hooks()`: method name,
    hook, "around" or "after"), keeps its per-backend state on the backend object (`State`,
    created on first use), and says why a backend instance cannot serve the views
    (`unsupported_reason`: its hooks then leave the backend to upstream code, and the staged KV
    layout is refused at start-up). Whether a layer reads through a view is `needs_view`."""

    target = ""
    State: Optional[type] = None

    @property
    def class_name(self) -> str:
        return self.target.rsplit(".", 1)[-1]

    def state(self, backend):
        st = backend.__dict__.get("uniprefill_adapter_state")
        if st is None:
            st = self.State()
            backend.uniprefill_adapter_state = st
        return st

    def unsupported_reason(self, backend) -> Optional[str]:
        return None

    def supported(self, backend) -> bool:
        return self.unsupported_reason(backend) is None

    def hooks(self) -> Sequence[Tuple[str, Callable, str]]:
        raise NotImplementedError

    def prepare(self, backend, runtime) -> None:
        """At start-up, allocate what this backend's views hold, so that the first request
        that reads one does not (nothing, unless the adapter says otherwise)."""

    def correct_upstream(self, backend) -> Optional[str]:
        """At start-up, with UniPrefill enabled (dense or not): set right what upstream's
        backend computes wrong for this model, and say what changed (None: nothing)."""
        return None


def stages_after_first(runtime) -> List[int]:
    return list(range(1, runtime.stages.num_drops + 1))


# A decode CUDA graph's per-stage index lists hold this many KV pools' worth of entries, not
# upstream's max batch x context length (one copy per stage: 0.8 GB on the Llama-3.1-8B shape
# with six drops, 3 GB on Qwen3-Next's). A batch's lists exceed one pool only where requests
# share cached prefix slots; one that exceeds the lists decodes eagerly (patches/cuda_graphs.py).
DECODE_GRAPH_POOLS = 2


def decode_graph_entries(runtime, upstream_entries: int, floor: int = 0) -> int:
    """Entries of each per-stage decode-graph index list: `DECODE_GRAPH_POOLS` pools (or
    `UNIPREFILL_DECODE_GRAPH_ENTRIES`), at most upstream's width, at least `floor` (lists
    that do not scale with the pool, such as one window per request). Recorded on the runtime,
    whose smallest list decides which decode batches replay a graph."""
    wanted = environ.DECODE_GRAPH_ENTRIES.get()
    pools = int(wanted) if wanted else DECODE_GRAPH_POOLS * runtime.slots.num_slots
    entries = max(floor, min(upstream_entries, pools))
    known = runtime.decode_graph_entries
    runtime.decode_graph_entries = entries if known is None else min(known, entries)
    return entries


def decode_graph_fits(runtime, seq_lens_sum: int, max_padding_rows: int) -> bool:
    """Do a decode batch's per-stage lists fit the graph's (its sequences plus padding rows of
    at most one entry each)? True when no list was sized (no graph captured with UniPrefill)."""
    entries = None if runtime is None else runtime.decode_graph_entries
    return entries is None or seq_lens_sum + max_padding_rows <= entries


def seq_lens_sum(fb, bs: int) -> int:
    """Tokens of the first `bs` sequences, from host copies when the batch has them."""
    if getattr(fb, "seq_lens_cpu", None) is not None:
        return int(fb.seq_lens_cpu[:bs].sum())
    if getattr(fb, "seq_lens_sum", None) is not None and bs == fb.batch_size:
        return int(fb.seq_lens_sum)
    return int(fb.seq_lens[:bs].sum().item())


def host_seq_lens(fb, bs: int) -> torch.Tensor:
    if getattr(fb, "seq_lens_cpu", None) is not None:
        return fb.seq_lens_cpu[:bs].to(torch.int32)
    return fb.seq_lens[:bs].to(torch.int32).cpu()  # a sync; SGLang's decode batches carry the host copy


def decode_stage_kv_lens(ctx, fb, bs: int, num_stages: int) -> torch.Tensor:
    """[D, bs] on the host: row k holds each decode row's KV length at stage k + 1, its sequence
    length minus the KV its request lacks there (`ctx.kv.gaps`, from the host mirror). Rows past
    the batch's requests (CUDA-graph padding) keep their whole sequence."""
    seq = host_seq_lens(fb, bs)
    gaps = torch.zeros(bs, num_stages, dtype=torch.int32)
    if ctx.kv.gaps:
        n = min(bs, len(ctx.kv.gaps))
        gaps[:n] = torch.tensor(ctx.kv.gaps[:n], dtype=torch.int32)
    return seq.unsqueeze(0) - gaps.T


def extend_view_slots(runtime, req_to_token, fb, stage: int):
    """Extend at `stage`: every slot of each request's sequence with its validity at `stage`."""
    bs = fb.req_pool_indices.shape[0]
    return extend_stage_slots(runtime.slots, req_to_token, fb.req_pool_indices, fb.seq_lens,
                              seq_lens_sum(fb, bs), stage)


def prefix_view(runtime, req_to_token, fb, ctx, stage: int, dtype=None, positions=False):
    """Extend at `stage` (> 0): each request's valid prefix, the slots of positions before its
    first current row (`ctx.survivors.fixed_lens`; for a final chunk whose parked rows
    rejoined, before those rows) whose KV the stage holds. Returns `kv_validity.compact`'s
    (counts, indptr, indices), and with `positions` each listed slot's position too. Every later
    stage's view is built at the first call of a forward, in one gather and one compaction
    (`fixed_lens` changes only at the first drop, before any later stage runs), and cached on
    the drop context. Under UNIPREFILL_CHECK_KV_LENS the counts are checked against the host's
    `ctx.kv.prefix_valid`, which the plans use."""
    return tuple(v[stage - 1] for v in prefix_views(runtime, req_to_token, fb, ctx, dtype,
                                                     positions))


def prefix_views(runtime, req_to_token, fb, ctx, dtype=None, positions=False):
    """`prefix_view` of every later stage at once: `kv_validity.stage_views`'s [D, ...]
    tensors, row k for stage k + 1 (built at the first call of a forward, cached on the drop
    context)."""
    cache = view_cache(ctx, "prefix_views")
    views = cache.get((dtype, positions))
    if views is None:
        bs = fb.req_pool_indices.shape[0]
        fixed_lens = ctx.survivors.fixed_lens
        lens = to_device(fixed_lens, torch.int64, fb.req_pool_indices.device)
        views = stage_views(runtime.slots, req_to_token, fb.req_pool_indices, lens,
                            sum(fixed_lens[:bs]), bs, dtype=dtype, positions=positions)
        if runtime.check_kv_lens:
            for k, counts in enumerate(views[0]):
                check_kv_lens(torch.tensor([p[k + 1] for p in ctx.kv.prefix_valid]), counts,
                              f"extend prefix stage {k + 1}")
        cache[(dtype, positions)] = views
    return views


def write_kv(pool, layer, loc, k, v, k_scale=None, v_scale=None) -> None:
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    if k_scale is None and v_scale is None:
        pool.set_kv_buffer(layer, KVWriteLoc(loc, None), k, v)
    else:
        pool.set_kv_buffer(layer, KVWriteLoc(loc, None), k, v, k_scale, v_scale)


def piece_members(lens, fixed_lens, piece):
    """For rows [start, end) of a batch whose requests hold `lens` rows each, in order: the
    requests with rows there, their rows there, and the rows each passed through the layer
    before them (its `fixed_lens` and its rows ahead of the piece). `piece` None: every row."""
    if piece is None:
        return list(range(len(lens))), list(lens), list(fixed_lens)
    start, end = piece
    members, rows, before, first = [], [], [], 0
    for b, n in enumerate(lens):
        lo, hi = max(start, first), min(end, first + n)
        if hi > lo:
            members.append(b)
            rows.append(hi - lo)
            before.append(fixed_lens[b] + lo - first)
        first += n
    return members, rows, before


class RowPiece(NamedTuple):
    """The survivors an attention layer's call runs: all of them, or the piece
    `ctx.pieces.span` of a sublayer run in pieces. Per request in batch order: its rows in the
    piece (0 where it has none) and its rows ahead of the piece, whose KV earlier pieces wrote
    at this layer and which its rows in the piece attend to after the stage's valid prefix (0
    for a request without rows in the piece: it attends to nothing)."""
    rows: slice  # of the survivors (`ctx.survivors.positions`, `ctx.survivors.out_cache_loc`)
    lens: List[int]
    ahead: List[int]

    @property
    def through(self) -> List[int]:
        """Per request, its rows through the piece's end: ahead of it and in it (the rows whose
        keys the piece's queries see after the stage's valid prefix, once the piece wrote its KV)."""
        return [a + n for a, n in zip(self.ahead, self.lens)]


def row_piece(ctx) -> RowPiece:
    survivor_lens, span = ctx.survivors.lens, ctx.pieces.span
    bs = len(survivor_lens)
    if span is None:
        return RowPiece(slice(0, sum(survivor_lens)), list(survivor_lens), [0] * bs)
    members, rows, ahead = piece_members(survivor_lens, [0] * bs, span)
    lens, before = [0] * bs, [0] * bs
    for b, n, a in zip(members, rows, ahead):
        lens[b], before[b] = n, a
    return RowPiece(slice(*span), lens, before)


class StateLayerRows(NamedTuple):
    """What a layer with a per-request state (linear attention, short convolution) needs to
    run the rows of `ctx` (or of its `row_piece`): each member request's rows as offsets on the
    device, its rows and the rows of it that passed the layer before (host), and its state slot
    (-1 for a request parking in this forward, whose slot the kernels leave alone)."""
    query_start_loc: torch.Tensor
    rows: List[int]
    before: List[int]
    slots: torch.Tensor


def state_layer_rows(ctx, slots: torch.Tensor) -> StateLayerRows:
    """`slots`: every request's state slot, as upstream's metadata holds them."""
    survivors = ctx.survivors
    members, rows, before = piece_members(survivors.lens, survivors.fixed_lens, ctx.pieces.span)
    query_start_loc = torch.zeros(len(rows) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(rows, dtype=torch.int32), 0, out=query_start_loc[1:])
    if ctx.parking.parked_now:
        slots = slots.clone()
        slots[torch.tensor(ctx.parking.parked_now, device=slots.device)] = -1
    if len(members) < len(survivors.lens):
        slots = slots[torch.tensor(members, device=slots.device)]
    return StateLayerRows(query_start_loc.to(slots.device), rows, before, slots)


def view_cache(ctx, key: str) -> dict:
    """A per-forward cache on the drop context (views planned once, run by every layer)."""
    return ctx.kv.views.setdefault(key, {})


def extend_qo_indptr(ctx, stage: int) -> torch.Tensor:
    """[bs + 1] int64 on the device: each request's rows that the layers of `stage` run now as
    offsets: its survivors (`ctx.survivors.lens`, which each drop shrinks), or its rows in the
    current piece (`row_piece`). Built once per stage and piece per forward."""
    cache = view_cache(ctx, "qo_indptr")
    key = (stage, ctx.pieces.span)
    qo_indptr = cache.get(key)
    if qo_indptr is None:
        qo_indptr = offsets(row_piece(ctx).lens, ctx.forward_batch.req_pool_indices.device)
        cache[key] = qo_indptr
    return qo_indptr


def offsets(lens: List[int], device) -> torch.Tensor:
    """[0, cumsum(lens)] as int64 on the device, from a host list."""
    lens = to_device(lens, torch.int64, device)
    indptr = lens.new_zeros(lens.shape[0] + 1)
    torch.cumsum(lens, 0, out=indptr[1:])
    return indptr


def stage_keys(runtime, req_to_token, ctx, stage: int, through: List[int],
               positions: bool = False):
    """Extend at `stage` (> 0): per request b, its valid prefix (`prefix_view`) then its first
    `through[b]` survivors (whose KV this layer has written), as (kv_indptr [bs + 1] int32,
    kv_indices int64: slots in the stage's pool, kv_pos: their original positions, or None
    without `positions`). Each request's keys ascend in position. With `through` all zero these
    are `prefix_view`'s lists, unmerged."""
    fb = ctx.forward_batch
    device = fb.req_pool_indices.device
    counts, indptr, indices, *pos = prefix_view(runtime, req_to_token, fb, ctx, stage,
                                                dtype=torch.int64, positions=positions)
    pos = pos[0] if positions else None
    if not any(through):
        return indptr, indices, pos
    n_prefix = sum(p[stage] for p in ctx.kv.prefix_valid)  # the host mirror of `counts`
    n_rows = sum(through)
    rows_indptr = offsets(through, device)
    kv_indptr = (indptr.to(torch.int64) + rows_indptr).to(indptr.dtype)
    kv_indices = torch.empty(n_prefix + n_rows, dtype=torch.int64, device=device)
    kv_pos = torch.empty_like(kv_indices) if positions else None
    # Request b's prefix entries move up by the rows listed for the requests before it ...
    to = torch.arange(n_prefix, device=device) + rows_indptr[segment_ids(counts, n_prefix)]
    kv_indices[to] = indices[:n_prefix]
    if positions:
        kv_pos[to] = pos[:n_prefix]
    # ... and its first `through[b]` survivors land right after its prefix.
    seg = segment_ids(rows_indptr[1:] - rows_indptr[:-1], n_rows)
    arange = torch.arange(n_rows, device=device)
    survivors = ctx.survivors
    starts = to_device(survivors.segment_starts(), torch.int64, device)
    src = starts[seg] + arange - rows_indptr[seg]
    to = indptr.to(torch.int64)[seg + 1] + arange
    kv_indices[to] = runtime.slots.pool_slots(survivors.out_cache_loc[src], stage).to(torch.int64)
    if positions:
        kv_pos[to] = survivors.positions[src].to(torch.int64)
    return kv_indptr, kv_indices, kv_pos


# ---- sliding-window layers after a drop ------------------------------------------------------
# A backend's own window kernel counts the window in KV entries, which is wrong once entries are
# missing; after a drop these layers attend through `kernels.positional_attention`, masked by the
# original positions (a query at p sees the keys at p - window .. p).
def window_extend_keys(runtime, req_to_token, ctx, stage: int):
    """Extend at `stage` on a sliding-window layer: each request's keys, its valid prefix then
    its survivors through the rows the layer runs now (`row_piece`; written before attention),
    as (qo_indptr, kv_indptr, kv_indices, kv_pos), the slots in the stage's pool and their
    original positions. Built once per stage and piece per forward."""
    cache = view_cache(ctx, "window_extend_keys")
    key = (stage, ctx.pieces.span)
    keys = cache.get(key)
    if keys is not None:
        return keys
    kv_indptr, kv_indices, kv_pos = stage_keys(runtime, req_to_token, ctx, stage,
                                               row_piece(ctx).through, positions=True)
    keys = (extend_qo_indptr(ctx, stage), kv_indptr.to(torch.int64), kv_indices, kv_pos)
    if runtime.check_kv_lens:
        _check_keys_ascend(kv_indptr, kv_pos)
    cache[key] = keys
    return keys


def _check_keys_ascend(kv_indptr: torch.Tensor, kv_pos: torch.Tensor) -> None:
    """Debug (UNIPREFILL_CHECK_KV_LENS, one sync): each request's keys ascend in position, the
    promise `window_attention` gives the kernel (`kv_sorted`) so that it visits its window only."""
    n = kv_pos.shape[0]
    if n < 2:
        return
    starts = torch.zeros(n, dtype=torch.bool, device=kv_pos.device)
    firsts = kv_indptr[:-1].to(torch.int64)
    starts[firsts[firsts < n]] = True  # a request's first key may step down
    steps_down = (kv_pos[1:] <= kv_pos[:-1]) & ~starts[1:]
    if bool(steps_down.any()):
        at = int(torch.nonzero(steps_down)[0]) + 1
        raise CheckFailed(f"UniPrefill: sliding-window keys out of position order at entry {at} "
                          f"({kv_pos[at - 1].item()} then {kv_pos[at].item()})")


def window_extend_attention(runtime, pool, req_to_token, layer, q, ctx, stage: int,
                            window: int, sinks=None):
    """A sliding-window layer of `stage` in an extend: the rows it runs now (`row_piece`) over
    `window_extend_keys`."""
    piece = row_piece(ctx)
    keys = window_extend_keys(runtime, req_to_token, ctx, stage)
    return window_attention(pool, layer, q, ctx.survivors.positions[piece.rows], keys, window,
                            max(piece.lens), sinks=sinks)


def window_attention(pool, layer, q, q_pos, keys, window: int, max_q_len: int, sinks=None):
    """A sliding-window layer's attention over `keys` (window_extend_keys' tuple, or a decode
    step's window lists with a one-row-per-request qo_indptr), masked by original positions.
    Rows of q past `q_pos` (the prefill graph's padding) stay zero. `sinks`: the layer's
    attention-sink logits per query head (gpt-oss), in every row's softmax denominator."""
    qo_indptr, kv_indptr, kv_indices, kv_pos = keys
    q = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
    rows = q_pos.shape[0]
    out = q.new_zeros((q.shape[0], layer.tp_q_head_num, layer.v_head_dim))
    kernels.positional_attention(
        q[:rows], q_pos, qo_indptr,
        pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id),
        kv_indptr, kv_indices, kv_pos, layer.scaling, window=window,
        logit_cap=layer.logit_cap, max_q_len=max_q_len, out=out[:rows],
        kv_sorted=True,  # prefix then current rows, each in sequence order
        path=environ.kernel_path(), sinks=sinks)
    return out.view(-1, layer.tp_q_head_num * layer.v_head_dim)
