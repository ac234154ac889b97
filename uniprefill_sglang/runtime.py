"""Process-wide UniPrefill state of one model runner, and the method's steps in a forward.

`UniPrefillRuntime` is created when the model runner has built its model and KV pool
(patches/model_runner.py). Per forward it opens a `DropContext`; at each drop layer it gathers
the candidates (selection.py picks the survivors; at the first drop, parked chunks and cached
prefixes that re-select rejoin as candidates: parking.py, prefix_reuse.py), shrinks the context
to them and records which KV slots the later layers will not write; at the end it records, per
request, the KV each stage lacks (the host mirror decode plans with).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from uniprefill_sglang import environ
from uniprefill_sglang.config import UniPrefillConfig
from uniprefill_sglang.context import DropContext, UniPrefillError, set_current
from uniprefill_sglang.kv_validity import KVGaps, LayerStages, RequestStageKV, SlotStages
from uniprefill_sglang.parking import JoiningRows, ParkingLot, merge_parked
from uniprefill_sglang.prefix_reuse import PrefixReuse
from uniprefill_sglang.prefix_checkpoint import PrefixCheckpoint
from uniprefill_sglang.request_plan import is_prefill_mode
from uniprefill_sglang.selection import DropCandidates, SelectionRule, select_survivors
from uniprefill_sglang.stage_pools import StagePools

logger = logging.getLogger(__name__)

_runtime: Optional["UniPrefillRuntime"] = None


def get_runtime() -> Optional["UniPrefillRuntime"]:
    return _runtime


def set_runtime(runtime: Optional["UniPrefillRuntime"]) -> None:
    global _runtime
    _runtime = runtime


class UniPrefillRuntime:
    """UniPrefill in one model runner: the drop schedule, the per-stage KV bookkeeping and the
    parked rows of chunked prefill, and the steps of a forward."""

    def __init__(self, config: UniPrefillConfig, stages: LayerStages, req_to_token_pool,
                 token_to_kv_pool, device, tp_agreement=None, checkpoint_shape=None,
                 allocator=None):
        self.config = config
        self.stages = stages
        self.rule = SelectionRule(config.block_size, config.sink_tokens, config.last_queries)
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        # TPScoreAgreement when attention heads are split over ranks (tp_agreement.py).
        self.tp_agreement = tp_agreement
        self.check_tp = tp_agreement is not None and environ.CHECK_TP.get()
        self.report_kept_positions = environ.REPORT_KEPT.get()
        self.check_kv_lens = environ.CHECK_KV_LENS.get()
        self.test_fault = environ.TEST_FAULT.get()
        # Rows of a full-attention layer's buffer (a hybrid model's pool maps layer ids).
        num_slots = token_to_kv_pool.get_key_buffer(
            stages.drop_layers[0] if stages.drop_layers else 0).shape[0]
        self.slots = SlotStages(num_slots, stages.num_drops, device,
                                _stage_pools(stages, token_to_kv_pool, allocator, device))
        self.kv_gaps = KVGaps(req_to_token_pool.req_to_token.shape[0], stages.num_drops)
        self.stage_kv = RequestStageKV(self.slots, self.kv_gaps, req_to_token_pool.req_to_token)
        self.parking = ParkingLot(config.max_parked_tokens)
        # Rows one MLP call takes at most in a compacted step (model_integration.py): the chunk
        # size, set by the model runner hook (0: no limit).
        self.piece_rows = 0
        self.pieced_mlp_calls = 0
        # rid -> why: requests UniPrefill could not answer from complete KV after a failure
        # (patches/scheduler.py finishes them with that error).
        self.failed_requests = {}
        # Prefix reuse (prefix_reuse.py): with the radix cache on, (hidden_size, query_size,
        # dtype) of the checkpoint that lets a request re-select over a cached prefix.
        self.checkpoint = None
        self.checkpoint_batch = None  # the ForwardBatch whose first drop layer runs now
        if checkpoint_shape is not None and stages.num_drops:
            self.checkpoint = PrefixCheckpoint(num_slots, *checkpoint_shape, device)
            logger.info("UniPrefill: checkpoint for prefix re-selection, %.1f MiB",
                        self.checkpoint.bytes / 2**20)
        self.prefix_reuse = PrefixReuse(self, allocator, self.checkpoint)
        # Observability: prefill forwards that carried decode rows; prompt tokens that reached
        # a drop with UniPrefill on, and how many were left after the last drop.
        self.mixed_forwards = self.scored_tokens = self.kept_tokens = 0

    @property
    def has_schedule(self) -> bool:
        return self.stages.num_drops > 0

    # ---- forward lifecycle -------------------------------------------------------------
    def begin_forward(self, fb) -> DropContext:
        self.slots.mark_written(fb.out_cache_loc)
        if self.checkpoint is not None:
            self.checkpoint.invalidate(fb.out_cache_loc)
        plan = getattr(fb, "uniprefill_plan", None)
        is_extend = is_prefill_mode(fb.forward_mode) and fb.extend_seq_lens_cpu is not None
        ctx = DropContext(plan=plan, forward_batch=fb, is_extend=is_extend)
        if is_extend:
            if plan is not None and any(d.reason == "decode" for d in plan.decisions):
                self.mixed_forwards += 1
            ctx.positions, ctx.out_cache_loc = fb.positions, fb.out_cache_loc
            ctx.lens = list(fb.extend_seq_lens_cpu)
            ctx.fixed_lens = _prefix_lens(fb)
            ctx.kept.append(list(ctx.lens))
            ctx.prefix_valid = self.stage_kv.prefix_valid(fb.req_pool_indices, ctx.fixed_lens)
            ctx.sparse = [v[-1] < p for v, p in zip(ctx.prefix_valid, ctx.fixed_lens)]
            if plan is not None and self.has_schedule:
                self._note_refused_parking(ctx)
                parked = {d.rid: self.parking.get(d.rid) for d in plan.decisions
                          if self.parking.is_parked(d.rid)}
                ctx.parked_before = {rid: (rows, rows.count) for rid, rows in parked.items()}
                # A dense step of a request with parked rows (a recovery, a final chunk in a
                # batch that asks for logprobs) must still let them rejoin, all kept.
                ctx.rejoins = any(d.rid in parked and not d.park for d in plan.decisions)
        elif fb.forward_mode.is_decode() and self.has_schedule:
            rows = self.host_rows(fb)
            self.stage_kv.refresh_stale(rows, fb.req_pool_indices, fb.seq_lens, fb.seq_lens_cpu)
            ctx.kv_gaps = [self.kv_gaps.get(r) for r in rows]
            ctx.sparse = [any(g) for g in ctx.kv_gaps]
            if self.check_kv_lens and any(ctx.sparse):
                self.stage_kv.check_decode(fb.req_pool_indices, fb.seq_lens, fb.seq_lens_cpu,
                                           ctx.kv_gaps)
        set_current(ctx)
        return ctx

    def _note_refused_parking(self, ctx: DropContext) -> None:
        """A final chunk whose earlier chunks were refused parking says why; nothing is left to
        remember of the request after it."""
        for b, d in enumerate(ctx.plan.decisions):
            why = None if d.park else self.parking.refused.pop(d.rid, None)
            if why is not None:
                ctx.note(b, f"earlier chunks not parked ({why})" + (
                    ": drops among its final chunk's tokens only" if d.enabled else ""))

    def end_forward(self, ctx: DropContext) -> None:
        set_current(None)
        for slots in ctx.ghost_slots:  # computed past the first drop on a partial view
            self.slots.mark_dropped(slots, 0, release=False)  # parked: it rejoins later
        for rid in ctx.finished_parking:
            self.parking.forget(rid)
        if ctx.is_extend and ctx.plan is not None and len(ctx.kept) > 1:
            for b, d in enumerate(ctx.plan.decisions):  # requests through every drop
                if d.enabled and b not in ctx.parked_now:
                    self.scored_tokens += ctx.kept[0][b]
                    self.kept_tokens += ctx.kept[-1][b]
        if ctx.is_extend and ctx.sparse is not None and self.has_schedule:
            self._record_gaps(ctx)

    def abandon_forward(self, ctx: DropContext, give_up_parking: bool = False) -> None:
        """A forward failed in UniPrefill's code: undo what it changed, so that the batch can
        run again dense with every token's KV complete. Its new slots are reset when the new
        forward begins; requests whose prefix it moved to private slots point at the shared
        prefix again; the parked rows are as they were when it began, so that the dense run
        lets them rejoin whole (every later layer then holds every token of the prompt).

        `give_up_parking` (the dense run failed as well): the parked rows are dropped instead,
        leaving their requests' earlier chunks with stage-0 KV only; the caller fails those
        requests (`failed_requests`)."""
        set_current(None)
        rows = self.host_rows(ctx.forward_batch)
        for b, (row, shared) in ctx.moved_prefixes.items():  # back to the shared prefix
            self.req_to_token_pool.req_to_token[row, :shared.numel()] = shared
            self.prefix_reuse.release(ctx.plan.decisions[b].rid)
        decisions = ctx.plan.decisions if ctx.plan else []
        self.parking.roll_back(ctx.parked_before, [d.rid for d in decisions])
        for b, d in enumerate(decisions):
            parked = self.parking.get(d.rid)
            if parked is None:
                continue
            slots = self.req_to_token_pool.req_to_token[
                rows[b], parked.start_pos:parked.start_pos + parked.count]
            if give_up_parking:
                self.parking.give_up(d.rid, "a dense run after a failure in UniPrefill's "
                                            "code failed too")
                self.failed_requests[d.rid] = (
                    "UniPrefill could not recompute the earlier chunks of this prompt after a "
                    "failure in its own code; the request was not answered from incomplete KV")
                self.slots.mark_dropped(slots, 0)
            else:  # stage-0 KV only until they rejoin (the failed forward may have marked them)
                self.slots.mark_dropped(slots, 0, release=False)
                if self.slots.staged:
                    self.slots.pools.refill(slots)
        if self.slots.staged:  # the dense run writes every layer for every row of the batch
            self.slots.pools.refill(ctx.forward_batch.out_cache_loc)

    def _record_gaps(self, ctx: DropContext) -> None:
        """After an extend: per request, the KV each later stage lacks, from the host-known
        counts (a parking chunk's one row past the first drop is marked dropped at
        end_forward, so it does not count)."""
        fb = ctx.forward_batch
        for b, (row, plen) in enumerate(zip(self.host_rows(fb), _prefix_lens(fb))):
            ghost = 1 if b in ctx.parked_now else 0
            entered = [ctx.kept[min(s, len(ctx.kept) - 1)][b] - ghost
                       for s in range(1, self.stages.num_drops + 1)]
            if not self.stage_kv.record_extend(row, plen + fb.extend_seq_lens_cpu[b],
                                               ctx.prefix_valid[b], entered,
                                               corrupt=self.test_fault == "kv_gaps"):
                # An inconsistent host mirror must not take the server down: the device's
                # slot map is the truth, read back before the row's next decode.
                logger.error("UniPrefill: inconsistent KV gaps for request row %d; re-reading "
                             "them from the device", row)

    def warm_up(self, attn, dtype) -> None:
        """Run the scoring and selection kernels once (top-p and keep ratio, and verify's
        coverage) on the first drop layer's key buffer, so that the first request that drops
        does not wait for their compilation. Reads the buffer, writes nothing."""
        from uniprefill_sglang import kernels
        from uniprefill_sglang.selection import prefix_coverage

        if attn is None:
            return
        buffer = self.token_to_kv_pool.get_key_buffer(attn.layer_id)
        if not kernels.use_triton(buffer.device):  # the torch references compile nothing
            return
        # Long enough that the scoring kernel splits its keys, as for real prompts: Triton
        # compiles a kernel anew for an integer argument equal to 1 (here, one split).
        n = min(4096, buffer.shape[0] - 1)
        q = min(self.config.last_queries, n)
        device = buffer.device
        gen = torch.Generator(device=device).manual_seed(0)
        queries = torch.randn(q, attn.tp_q_head_num, attn.qk_head_dim, generator=gen,
                              device=device).to(dtype)
        positions = torch.arange(n, device=device)
        for top_p, ratio in ((self.config.top_p, 0.0), (1.0, 0.5)):
            cands = DropCandidates(queries, positions[-q:], [q], positions + 1, positions, [n],
                                   [0], [top_p], [ratio])
            select_survivors(cands, buffer, attn.scaling, self.rule)
            if self.checkpoint is not None:
                prefix_coverage(cands, buffer, attn.scaling, self.rule,
                                torch.ones(n, dtype=torch.bool, device=device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def kv_pool_report(self, allocator) -> list:
        """Per stage (0 = the full pool): layers, slots, free slots, K+V bytes per slot."""
        free = allocator.available_size()
        if self.slots.staged:
            return self.slots.pools.report(free)
        per_layer = _slot_bytes_per_layer(self.token_to_kv_pool)
        return [dict(stage=0, layers=len(per_layer), size=int(allocator.size), free=int(free),
                     bytes_per_slot=sum(per_layer))]

    def missing_kv(self, fb) -> list:
        """Debug (UNIPREFILL_CHECK_KV_LENS): per request of an extend, per stage 1..D, the
        tokens of its sequence whose KV that stage lacks, read from the device slot map."""
        req_to_token = self.req_to_token_pool.req_to_token
        out = []
        for row, n in zip(self.host_rows(fb), fb.seq_lens_cpu.tolist()):
            slots = req_to_token[row, :n]
            valid = self.slots.valid_counts(slots, torch.zeros_like(slots, dtype=torch.int64), 1)
            out.append([n - int(v) for v in valid[0, 1:].tolist()])
        return out

    @staticmethod
    def host_rows(fb) -> list:
        """The batch's req-pool rows on the host (attached by the ForwardBatch hook)."""
        rows = getattr(fb, "uniprefill_req_rows", None)
        if rows is None or len(rows) != fb.batch_size:
            rows = fb.req_pool_indices.tolist()
        return rows

    # ---- the drop ----------------------------------------------------------------------
    def drop(self, ctx: DropContext, layer, q: torch.Tensor) -> None:
        """At a drop layer, after its attention: keep the top blocks of each selecting request.

        At the first drop layer this also parks non-final chunks (their rows stop here but the
        last, which carries the logits SGLang expects) and lets a final chunk's parked rows
        rejoin as candidates scored by the prompt's true last queries."""
        drop_index = self.stages.drop_index[layer.layer_id]
        decisions = ctx.plan.decisions
        if (self.test_fault == "drop" and any(d.enabled or d.park for d in decisions)) or (
                self.test_fault == "last_drop" and drop_index == self.stages.num_drops - 1
                and any(d.enabled for d in decisions)):
            raise UniPrefillError(f"test fault at a drop layer (UNIPREFILL_TEST_FAULT="
                                  f"{self.test_fault})")
        q = q.view(q.shape[0], layer.tp_q_head_num, layer.qk_head_dim)
        total = ctx.positions.shape[0]
        cands, selecting, joining, parking, whole = self._gather_candidates(ctx, layer, q,
                                                                            drop_index)
        if self.test_fault == "rejoin" and joining.count:
            raise UniPrefillError("test fault as parked rows rejoin (UNIPREFILL_TEST_FAULT="
                                  "rejoin)")
        if not selecting and not parking and not whole:
            ctx.kept.append(list(ctx.lens))
            return
        rows_per_request = list(ctx.lens)
        keep = torch.ones(total + joining.count, dtype=torch.bool, device=q.device)
        keep[total:] = False
        stage = self.stages.stage(layer.layer_id)
        for b, rows, joined in whole:  # dense requests whose parked rows or prefix rejoin
            keep.index_fill_(0, rows, True)
            ctx.kept[0][b] = ctx.lens[b] = joined + ctx.lens[b]
            ctx.rejoined_whole[b] = joined
        if selecting:
            self._select(ctx, layer, cands, selecting, keep, total, stage)
        for b, seg in parking:
            self._park(ctx, b, seg, q, keep, stage)
        ctx.kept.append(list(ctx.lens))
        if joining.count:  # surviving parked rows get the later layers' KV in this forward
            joined, joined_kept = torch.cat(joining.slots), keep[sum(rows_per_request):]
            self.slots.mark_written(joined[joined_kept])
            # The others stay dropped at the first drop, and give back the later stages' slots
            # they kept while parked.
            self.slots.mark_dropped(joined[~joined_kept], 0)
        ctx.shrink(keep, joining, rows_per_request, park_sink=self.parking.append)
        if self.report_kept_positions:
            ctx.kept_digest.append(ctx.position_digest())
        if self.check_kv_lens:
            self._check_extend_lens(ctx, stage + 1)

    def _gather_candidates(self, ctx, layer, q, drop_index):
        """Per request: park it, skip it, or gather its queries and keys for the selection.
        Returns (DropCandidates, [(b, candidate rows, parked rows joining)], JoiningRows,
        [(b, rows to park)], [(b, rows, parked rows joining)] of dense requests whose parked
        rows or cached prefix rejoin whole)."""
        stage = self.stages.stage(layer.layer_id)
        first_drop = drop_index == 0
        fb, device = ctx.forward_batch, q.device
        req_rows = self.host_rows(fb)
        req_to_token = self.req_to_token_pool.req_to_token
        total = ctx.positions.shape[0]
        queries, query_pos, keys, key_pos = [], [], [], []
        c = DropCandidates(None, None, [], None, None, [], [], [], [])
        selecting, joining, parking, whole = [], JoiningRows(), [], []
        empty = torch.empty(0, dtype=torch.int64, device=device)
        # Cached prefixes that this step selects over anew rejoin like parked rows.
        rejoining = self.prefix_reuse.rejoining_prefixes(ctx, layer, q) if first_drop else {}
        for b, (d, start) in enumerate(zip(ctx.plan.decisions, ctx.segment_starts())):
            n = ctx.lens[b]
            own = torch.arange(start, start + n, device=device)
            if first_drop and d.park and n > 0 and self.parking.reserve(d.rid, d.prompt_len,
                                                                        ctx.fixed_lens[b]):
                parking.append((b, own))
                continue
            if first_drop and d.park and d.rid in self.parking.refused:
                ctx.note(b, f"non-final chunk, not parked ({self.parking.refused[d.rid]}): "
                            "runs dense")
            parked = self.parking.get(d.rid) if first_drop else None
            if not d.enabled and b not in rejoining and parked is None:
                continue
            if parked is not None:
                ctx.finished_parking.append(d.rid)
                if parked.count == 0:
                    parked = None
            if b in rejoining:
                parked = merge_parked(rejoining[b], parked)
            if parked is None and d.enabled and n < self.config.min_tokens_to_drop:
                ctx.note(b, "too few new tokens to score")
                continue
            if not d.enabled:  # every row kept: nothing to score
                joined = parked.count if parked is not None else 0
                rows = own
                if parked is not None:
                    rows = torch.cat([joining.add(b, parked, req_to_token[req_rows[b]], total),
                                      own])
                    ctx.fixed_lens[b] = parked.start_pos
                whole.append((b, rows, joined))
                continue
            rows, own_q, own_q_pos = own, q[start:start + n], ctx.positions[start:start + n]
            joined = parked.count if parked is not None else 0
            num_q = min(self.config.last_queries, joined + n)
            if parked is not None:  # candidates: parked rows of earlier chunks, then this step's
                rows = torch.cat([joining.add(b, parked, req_to_token[req_rows[b]], total), own])
                ctx.fixed_lens[b] = parked.start_pos  # the parked rows are this request's rows now
                if num_q > n:  # a final chunk shorter than the query window borrows queries
                    own_q = torch.cat([parked.last_q.to(own_q.dtype), own_q])
                    own_q_pos = torch.cat([parked.last_q_pos, own_q_pos])
            fixed_len = ctx.fixed_lens[b]
            queries.append(own_q[-num_q:]), query_pos.append(own_q_pos[-num_q:])
            prefix_slots = prefix_pos = empty
            if fixed_len:  # its count is known on the host: stage 0 holds every token
                count = fixed_len if stage == 0 else ctx.prefix_valid[b][stage]
                prefix_slots, prefix_pos = self.slots.valid_slots(
                    req_to_token[req_rows[b], :fixed_len], stage, count)
            # Keys: the valid prefix (scored, never dropped), parked rows, this step's rows.
            keys.append(prefix_slots.to(torch.int64))
            key_pos.append(prefix_pos.to(torch.int64))
            if joined:
                keys.append(joining.slots[-1])
                key_pos.append(joining.positions[-1])
            keys.append(ctx.out_cache_loc[start:start + n].to(torch.int64))
            key_pos.append(ctx.positions[start:start + n].to(torch.int64))
            c.query_counts.append(num_q)
            c.key_counts.append(prefix_slots.numel() + joined + n)
            c.prefix_counts.append(prefix_slots.numel())
            c.top_p.append(d.top_p)
            c.keep_ratio.append(d.ratio_at(drop_index))
            selecting.append((b, rows, joined))
        if selecting:
            c.queries, c.query_pos = torch.cat(queries), torch.cat(query_pos)
            c.key_slots, c.key_pos = torch.cat(keys), torch.cat(key_pos)
        return c, selecting, joining, parking, whole

    def _select(self, ctx, layer, cands, selecting, keep, total, stage) -> None:
        reduce = self.tp_agreement.reduce_scores if self.tp_agreement is not None else None
        cands.key_slots = self.slots.pool_slots(cands.key_slots, stage)
        keep_idx, counts = select_survivors(
            cands, self.token_to_kv_pool.get_key_buffer(layer.layer_id), layer.scaling,
            self.rule, reduce)
        if self.check_tp:
            self.tp_agreement.verify(keep_idx, counts)
        candidate_rows = torch.cat([rows for _, rows, _ in selecting])
        keep.index_fill_(0, candidate_rows, False)
        keep.index_fill_(0, candidate_rows[keep_idx], True)
        # Dropped rows keep KV for the layers up to this one only; parked rows that survive
        # get the later layers' KV from the rest of this forward.
        self.slots.mark_dropped(ctx.out_cache_loc[~keep[:total]], stage)
        for (b, _, joined), count in zip(selecting, counts.tolist()):
            if joined:
                ctx.kept[0][b] = joined + ctx.lens[b]
            if count < joined + ctx.lens[b]:
                ctx.sparse[b] = True
            ctx.lens[b] = int(count)

    def _park(self, ctx, b, rows, q, keep, stage) -> None:
        """All rows of a non-final chunk stop here and wait for the final chunk; the last one
        goes on alone so the forward still yields the logits SGLang expects (discarded)."""
        rid = ctx.plan.decisions[b].rid
        last = rows[-self.config.last_queries:]
        ctx.to_park.append((rid, rows))
        ctx.parked_now.append(b)
        keep.index_fill_(0, rows[:-1], False)
        self.slots.mark_dropped(ctx.out_cache_loc[rows[:-1]], stage, release=False)
        ctx.ghost_slots.append(ctx.out_cache_loc[rows[-1:]])
        self.parking.get(rid).set_last_queries(q[last], ctx.positions[last])
        ctx.sparse[b] = True
        ctx.lens[b] = 1

    def _check_extend_lens(self, ctx: DropContext, stage: int) -> None:
        fb = ctx.forward_batch  # debug: the views' lengths against the device
        self.stage_kv.check_extend(
            fb.req_pool_indices, fb.seq_lens,
            [p + n for p, n in zip(_prefix_lens(fb), fb.extend_seq_lens_cpu)],
            [p[stage] + n for p, n in zip(ctx.prefix_valid, ctx.lens)], stage)


def _stage_pools(stages: LayerStages, pool, allocator, device):
    """The stage pools when the KV pool was built with the staged layout (patches/kv_pool.py),
    wired to the allocator (patches/kv_allocator.py) and the pool's writes; else None."""
    layout = getattr(pool, "uniprefill_layout", None)
    if layout is None:
        return None
    if layout.stages.drop_layers != stages.drop_layers:
        raise UniPrefillError(
            f"UniPrefill: the KV pool was laid out for drop layers "
            f"{list(layout.stages.drop_layers)} but the model runs {list(stages.drop_layers)}; "
            "start with --uniprefill-kv-layout shared")
    if allocator is None:
        raise UniPrefillError("UniPrefill: the staged KV layout needs the KV allocator")
    bytes_per_slot = [0] * (stages.num_drops + 1)
    for layer, size in enumerate(_slot_bytes_per_layer(pool)):
        bytes_per_slot[stages.stage(layer)] += size
    pools = StagePools(layout, pool.size, pool.uniprefill_stage_sizes, bytes_per_slot, device)
    pool.uniprefill_stage_maps = pools.maps
    allocator.uniprefill_stage_pools = pools
    total = sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                for k, v in zip(pool.k_buffer, pool.v_buffer))
    logger.info("UniPrefill staged KV layout: stage pools of %s slots (full pool %d), "
                "%.1f GiB of KV in all", pools.sizes, pool.size, total / 2**30)
    return pools


def _slot_bytes_per_layer(pool) -> list:
    """K+V bytes of one slot, per layer of the pool (of its full-attention layers, for the pool
    of a model with linear-attention layers)."""
    pool = getattr(pool, "full_kv_pool", pool)
    return [k.shape[1:].numel() * k.element_size() + v.shape[1:].numel() * v.element_size()
            for k, v in zip(pool.k_buffer, pool.v_buffer)]


def _prefix_lens(fb) -> list:
    """Per request of an extend, the tokens before its new ones (cached or earlier chunks)."""
    return list(fb.extend_prefix_lens_cpu or [0] * len(fb.extend_seq_lens_cpu))
