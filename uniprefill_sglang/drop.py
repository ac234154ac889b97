"""The drop: at a drop layer, right after its attention, each request keeps its top blocks.

    candidates  = the request's rows in this step, after any rows that rejoin it here
                  (the parked rows of its earlier chunks, a cached prefix it selects over anew)
    survivors   = selection.select_survivors(scores of the candidates by the prompt's last
                  queries, top-p blocks or a fixed keep ratio), and the share of the scored
                  mass the dropped candidates held (the report's `dropped_mass`)
    bound         a request whose first drop would let go more than its max dropped mass
                  keeps every row there and at every later drop
    shrink        the drop context to the survivors (the layer hooks gather the hidden states)
    mark          the dropped tokens' KV as held up to this layer only (kv_validity.SlotStages)

At the first drop a non-final chunk of a chunked prompt parks instead (parking.py's steps
`parks_here`, `park_chunk`): its rows stop here and rejoin at the final chunk, which alone holds
the prompt's true last queries (`rejoining_rows`). A dense request whose earlier rows rejoin
keeps every row.
"""

from __future__ import annotations

import dataclasses
import math
from typing import List

import torch

from uniprefill_sglang.context import DropContext
from uniprefill_sglang.device import to_device
from uniprefill_sglang.errors import CheckFailed, UniPrefillError
from uniprefill_sglang.parking import JoiningRows, park_chunk, parks_here, rejoining_rows
from uniprefill_sglang.request_knobs import MAX_DROPPED_MASS as MAX_DROPPED_MASS_KNOB
from uniprefill_sglang.selection import (DropCandidates, Selection, prefix_coverage,
                                         select_by_position, select_survivors)

MAX_DROPPED_MASS_FLAG = "--uniprefill-max-dropped-mass"


@dataclasses.dataclass
class _Step:
    """What one drop layer does to the batch's requests."""
    cands: DropCandidates
    selecting: List[tuple] = dataclasses.field(default_factory=list)  # (b, rows, joined)
    whole: List[tuple] = dataclasses.field(default_factory=list)  # (b, rows, joined), all kept
    parking: List[tuple] = dataclasses.field(default_factory=list)  # (b, rows)
    joining: JoiningRows = dataclasses.field(default_factory=JoiningRows)

    @property
    def idle(self) -> bool:
        return not (self.selecting or self.whole or self.parking)


def drop(rt, ctx: DropContext, layer, q: torch.Tensor) -> None:
    """Drop at `layer` for every request of the forward (`rt`: the UniPrefillRuntime)."""
    drop_index = rt.stages.drop_index[layer.layer_id]
    _raise_test_fault(rt, ctx, drop_index)
    q = q.view(q.shape[0], layer.tp_q_head_num, layer.qk_head_dim)
    survivors = ctx.survivors
    total = survivors.positions.shape[0]
    step = _plan_step(rt, ctx, layer, q, drop_index)
    if rt.test_fault == "rejoin" and step.joining.count:
        raise UniPrefillError("test fault as parked rows rejoin (UNIPREFILL_TEST_FAULT=rejoin)")
    if step.idle:
        ctx.report.kept.append(list(survivors.lens))
        ctx.report.dropped_mass.append([0.0] * len(survivors.lens))
        return
    rows_per_request = list(survivors.lens)
    keep = torch.ones(total + step.joining.count, dtype=torch.bool, device=q.device)
    keep[total:] = False
    stage = rt.stages.stage(layer.layer_id)
    for b, rows, joined in step.whole:
        keep.index_fill_(0, rows, True)
        ctx.report.kept[0][b] = survivors.lens[b] = joined + survivors.lens[b]
        ctx.parking.rejoined_whole[b] = joined
    masses = [0.0] * len(survivors.lens)
    dropped = None  # the step's own rows its selection let go
    if step.selecting:
        selection = _select(rt, layer, step, stage)
        _bound(rt, ctx, step, selection, keep, drop_index, masses)
        dropped = ~keep[:total]
    ctx.report.dropped_mass.append(masses)
    for b, rows in step.parking:
        park_chunk(rt, ctx, b, rows, q, keep, stage)
    ctx.report.kept.append(list(survivors.lens))
    kept = sum(survivors.lens)
    if rt.check_kv_lens and int(keep.sum()) != kept:  # shrink trusts the host count
        raise CheckFailed(f"drop at layer {layer.layer_id}: {int(keep.sum())} rows kept on the "
                          f"device, {kept} on the host")
    slots = survivors.out_cache_loc
    survivors.shrink(keep, step.joining, rows_per_request, ctx.parking,
                     park_sink=rt.parking.append)
    _mark(rt, step, keep[total:], slots, dropped, stage)
    if rt.report_kept_positions:
        ctx.report.kept_digest.append(survivors.position_digest())
    if rt.check_kv_lens:
        _check_extend_lens(rt, ctx, stage + 1)


def _raise_test_fault(rt, ctx, drop_index) -> None:
    decisions = ctx.plan.decisions
    if (rt.test_fault == "drop" and any(d.enabled or d.park for d in decisions)) or (
            rt.test_fault == "last_drop" and drop_index == rt.stages.num_drops - 1
            and any(d.enabled for d in decisions)):
        raise UniPrefillError(f"test fault at a drop layer (UNIPREFILL_TEST_FAULT="
                              f"{rt.test_fault})")


def _plan_step(rt, ctx, layer, q, drop_index) -> _Step:
    """Per request: park it, skip it, keep it whole, or gather its queries and keys."""
    first_drop = drop_index == 0
    stage = rt.stages.stage(layer.layer_id)
    device = q.device
    req_rows = rt.host_rows(ctx.forward_batch)
    req_to_token = rt.req_to_token_pool.req_to_token
    survivors = ctx.survivors
    total = survivors.positions.shape[0]
    step = _Step(DropCandidates(None, None, [], None, None, [], [], [], []))
    queries, query_pos, keys, key_pos = [], [], [], []
    empty = torch.empty(0, dtype=torch.int64, device=device)
    joins = rejoining_rows(rt, ctx, layer, q) if first_drop else {}
    for b, (d, start) in enumerate(zip(ctx.plan.decisions, survivors.segment_starts())):
        if b in ctx.report.over_bound:  # its first drop kept every row: so do the later ones
            continue
        n = survivors.lens[b]
        own = torch.arange(start, start + n, device=device)
        if first_drop and d.park and parks_here(rt, ctx, b, n):
            step.parking.append((b, own))
            continue
        joined_rows = joins.get(b)
        if joined_rows is None and d.enabled and n < rt.config.min_tokens_to_drop:
            ctx.note(b, "too few new tokens to score")
            continue
        if not d.enabled and joined_rows is None:
            continue
        joined = joined_rows.count if joined_rows is not None else 0
        rows = own
        if joined_rows is not None:  # rejoined rows are this request's rows now
            rows = torch.cat([step.joining.add(b, joined_rows, req_to_token[req_rows[b]], total),
                              own])
            survivors.fixed_lens[b] = joined_rows.start_pos
        if not d.enabled:  # every row kept: nothing to score
            step.whole.append((b, rows, joined))
            continue
        own_q, own_q_pos = q[start:start + n], survivors.positions[start:start + n]
        num_q = min(rt.config.last_queries, joined + n)
        if num_q > n:  # a final chunk shorter than the query window borrows queries
            own_q = torch.cat([joined_rows.last_q.to(own_q.dtype), own_q])
            own_q_pos = torch.cat([joined_rows.last_q_pos, own_q_pos])
        queries.append(own_q[-num_q:]), query_pos.append(own_q_pos[-num_q:])
        fixed_len = survivors.fixed_lens[b]
        prefix_slots = prefix_pos = empty
        if fixed_len:  # its count is known on the host: stage 0 holds every token
            count = fixed_len if stage == 0 else ctx.kv.prefix_valid[b][stage]
            prefix_slots, prefix_pos = rt.slots.valid_slots(
                req_to_token[req_rows[b], :fixed_len], stage, count)
        # Keys: the valid prefix (scored, never dropped), rejoined rows, this step's rows.
        keys.append(prefix_slots.to(torch.int64))
        key_pos.append(prefix_pos.to(torch.int64))
        if joined:
            keys.append(step.joining.slots[-1])
            key_pos.append(step.joining.positions[-1])
        keys.append(survivors.out_cache_loc[start:start + n].to(torch.int64))
        key_pos.append(survivors.positions[start:start + n].to(torch.int64))
        c = step.cands
        c.query_counts.append(num_q)
        c.key_counts.append(prefix_slots.numel() + joined + n)
        c.prefix_counts.append(prefix_slots.numel())
        c.top_p.append(d.top_p_at(drop_index))
        c.keep_ratio.append(d.ratio_at(drop_index))
        step.selecting.append((b, rows, joined))
    if step.selecting:
        c = step.cands
        c.queries, c.query_pos = torch.cat(queries), torch.cat(query_pos)
        c.key_slots, c.key_pos = torch.cat(keys), torch.cat(key_pos)
    return step


def _select(rt, layer, step: _Step, stage) -> Selection:
    """Which candidates survive: each request's top blocks, scored by its last queries."""
    reduce = rt.tp_agreement.reduce_scores if rt.tp_agreement is not None else None
    cands = step.cands
    cands.key_slots = rt.slots.pool_slots(cands.key_slots, stage)
    if rt.test_selection == "positional":
        selection = select_by_position(cands, rt.rule)
    else:
        selection = select_survivors(
            cands, rt.token_to_kv_pool.get_key_buffer(layer.layer_id), layer.scaling, rt.rule,
            reduce)
    if rt.check_tp:
        rt.tp_agreement.verify(selection.keep_idx, selection.counts)
    return selection


def _bound(rt, ctx, step: _Step, selection: Selection, keep, drop_index, masses) -> None:
    """Set the selection in `keep`, apply the first drop's mass bound, and fill `masses` (per
    request, the mass let go) and the requests' surviving rows from the one host read of the
    drop: the kept counts."""
    counts, mass = selection.counts, selection.dropped_mass
    candidate_rows = torch.cat([rows for _, rows, _ in step.selecting])
    keep.index_copy_(0, candidate_rows, selection.keep_mask)
    decisions = ctx.plan.decisions
    bounds = [decisions[b].max_dropped_mass for b, _, _ in step.selecting]
    if drop_index == 0 and any(x is not None for x in bounds):
        counts = _hold_over_bound(ctx.survivors, step, keep, candidate_rows, counts, mass,
                                  bounds)
    # One read for the counts (exact in float64) and the masses.
    host = torch.cat([counts.to(torch.float64), mass]).tolist()
    num = len(step.selecting)
    host_counts, host_mass = host[:num], host[num:]
    lens = ctx.survivors.lens
    for (b, _, joined), count, m, bound in zip(step.selecting, host_counts, host_mass, bounds):
        if joined:
            ctx.report.kept[0][b] = joined + lens[b]
        if drop_index == 0 and bound is not None and m > bound:
            ctx.report.over_bound[b] = m
            name = (f'custom_params["{MAX_DROPPED_MASS_KNOB}"]'
                    if bound != rt.config.max_dropped_mass
                    else "the profile's max_dropped_mass" if rt.config.bound_from_profile
                    else MAX_DROPPED_MASS_FLAG)
            ctx.note(b, f"over the dropped-mass bound: the first drop would let go {m:.4g} of "
                        f"the attention mass it scored, above {name} {bound:g}; every token "
                        "kept from there on")
            m = 0.0
        if count < joined + lens[b]:
            ctx.kv.sparse[b] = True
        lens[b] = int(count)
        masses[b] = m


def _mark(rt, step: _Step, joined_kept, slots, dropped, stage) -> None:
    """The KV the shrink leaves behind: the step's dropped rows (`dropped` over their `slots`)
    keep KV for the layers up to this one only; rejoined rows that survive (`joined_kept`) get
    the later layers' KV from the rest of this forward, the others stay dropped at the first
    drop and give back the later stages' slots they kept while parked."""
    if dropped is not None:
        rt.slots.mark_dropped_where(slots, dropped, stage)
    if step.joining.count:
        joined = torch.cat(step.joining.slots)
        rt.slots.mark_written(joined[joined_kept])
        rt.slots.mark_dropped(joined[~joined_kept], 0)


def _hold_over_bound(survivors, step: _Step, keep, candidate_rows, counts, mass, bounds):
    """On the device: the segments whose selection lets go more than their bound keep every
    candidate row; returns the kept counts with theirs full (`survivors`: the drop context's,
    before the drop)."""
    device = keep.device
    limits = to_device([math.inf if x is None else x for x in bounds], torch.float64, device)
    over = mass > limits
    sizes = to_device([joined + survivors.lens[b] for b, _, joined in step.selecting],
                      torch.int64, device)
    segment = torch.repeat_interleave(torch.arange(len(bounds), device=device), sizes,
                                      output_size=candidate_rows.numel())
    keep.index_copy_(0, candidate_rows,
                     keep.index_select(0, candidate_rows) | over.index_select(0, segment))
    return torch.where(over, sizes.to(counts.dtype), counts)


def _check_extend_lens(rt, ctx: DropContext, stage: int) -> None:
    fb = ctx.forward_batch  # debug: the views' lengths against the device
    rt.stage_kv.check_extend(
        fb.req_pool_indices, fb.seq_lens,
        [p + n for p, n in zip(rt.prefix_lens(fb), fb.extend_seq_lens_cpu)],
        [p[stage] + n for p, n in zip(ctx.kv.prefix_valid, ctx.survivors.lens)], stage)


def warm_up(rt, attn, dtype) -> None:
    """Run the scoring and selection kernels once (top-p and keep ratio, and verify's coverage)
    on the first drop layer's key buffer, so that the first request that drops does not wait
    for their compilation. Reads the buffer, writes nothing."""
    from uniprefill_sglang import environ, kernels

    if attn is None:
        return
    buffer = rt.token_to_kv_pool.get_key_buffer(attn.layer_id)
    # The torch references compile nothing.
    if not kernels.use_triton(buffer.device, environ.kernel_path()):
        return
    # Long enough that the scoring kernel splits its keys, as for real prompts: Triton
    # compiles a kernel anew for an integer argument equal to 1 (here, one split).
    n = min(4096, buffer.shape[0] - 1)
    q = min(rt.config.last_queries, n)
    device = buffer.device
    gen = torch.Generator(device=device).manual_seed(0)
    queries = torch.randn(q, attn.tp_q_head_num, attn.qk_head_dim, generator=gen,
                          device=device).to(dtype)
    positions = torch.arange(n, device=device)
    for top_p, ratio in ((rt.config.top_p_at(0), 0.0), (1.0, 0.5)):
        cands = DropCandidates(queries, positions[-q:], [q], positions + 1, positions, [n],
                               [0], [top_p], [ratio])
        select_survivors(cands, buffer, attn.scaling, rt.rule)
        if rt.checkpoint is not None:
            prefix_coverage(cands, buffer, attn.scaling, rt.rule,
                            torch.ones(n, dtype=torch.bool, device=device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
