"""UniPrefill in one model runner: its bookkeeping across forwards, and a forward's life.

`UniPrefillRuntime` is created when the model runner has built its model and KV pool
(patches/model_runner.py), from the process's schedule (schedule.py). It holds what outlives a
forward: which KV each slot holds per stage (kv_validity.py, stage_pools.py), the parked rows
of chunked prefill (parking.py), the prefix checkpoint and reuse (prefix_reuse.py). Per forward
it opens a `DropContext` on the batch's side-car (begin_forward: `forward_batch.uniprefill_inputs`
.drop_context, where the layer hooks and attention adapters read it from the batch they are
given), which each drop layer shrinks (drop.py), and closes it
(end_forward: per request, the KV each stage lacks, the host mirror decode plans with), or rolls
back what a failed forward changed (abandon_forward).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from uniprefill_sglang import environ
from uniprefill_sglang.config import UniPrefillConfig
from uniprefill_sglang.context import DropContext
from uniprefill_sglang.kv_validity import KVGaps, LayerStages, RequestStageKV, SlotStages
from uniprefill_sglang.metrics import RuntimeStats
from uniprefill_sglang.parking import ParkingLot, rejoin_record, start_peak_measure
from uniprefill_sglang.prefix_reuse import PrefixReuse
from uniprefill_sglang.prefix_checkpoint import PrefixCheckpoint
from uniprefill_sglang.request_plan import ForwardInputs, forward_plan, is_prefill_mode
from uniprefill_sglang.selection import SelectionRule
from uniprefill_sglang.stage_pools import slot_bytes_per_layer, wire_stage_pools
from uniprefill_sglang.state import plugin_state

logger = logging.getLogger(__name__)


def get_runtime() -> Optional["UniPrefillRuntime"]:
    """The model runner's runtime in this process (None: UniPrefill is off here)."""
    return plugin_state().runtime


def _kv_rows(pool, layer_id: int) -> int:
    """Rows of a full-attention layer's KV buffer. A hybrid model's pool holds its
    full-attention layers only, by id: without drop layers (a schedule refused at start-up)
    layer 0 may be a linear one, so its first full-attention layer is asked instead."""
    mapping = getattr(pool, "full_attention_layer_id_mapping", None)
    if mapping and layer_id not in mapping:
        layer_id = next(iter(mapping))
    return pool.get_key_buffer(layer_id).shape[0]


class UniPrefillRuntime:
    """UniPrefill in one model runner: the drop schedule, the per-stage KV bookkeeping and the
    parked rows of chunked prefill, and the steps of a forward."""

    def __init__(self, config: UniPrefillConfig, stages: LayerStages, req_to_token_pool,
                 token_to_kv_pool, device, tp_agreement=None, checkpoint_shape=None,
                 allocator=None):
        self.config = config
        self.stages = stages
        self.dense_reason = None  # why nothing drops, when nothing does (schedule.Schedule)
        self.rule = SelectionRule(config.block_size, config.sink_tokens, config.last_queries,
                                  config.neighbor_blocks)
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        # TPScoreAgreement when attention heads are split over ranks (tp_agreement.py).
        self.tp_agreement = tp_agreement
        self.check_tp = tp_agreement is not None and environ.CHECK_TP.get()
        self.report_kept_positions = environ.REPORT_KEPT.get()
        self.check_kv_lens = environ.CHECK_KV_LENS.get()
        self.test_fault = environ.TEST_FAULT.get()
        self.test_selection = environ.TEST_SELECTION.get()
        num_slots = _kv_rows(token_to_kv_pool, stages.drop_layers[0] if stages.drop_layers else 0)
        self.slots = SlotStages(num_slots, stages.num_drops, device,
                                wire_stage_pools(stages, token_to_kv_pool, allocator, device))
        self.kv_gaps = KVGaps(req_to_token_pool.req_to_token.shape[0], stages.num_drops)
        self.stage_kv = RequestStageKV(self.slots, self.kv_gaps, req_to_token_pool.req_to_token)
        # Unset, parking follows the longest sequence the request table holds (the context
        # length, plus the few slots SGLang adds): every prompt the server takes may park.
        max_parked = config.max_parked_tokens
        self.parking = ParkingLot(req_to_token_pool.req_to_token.shape[1] if max_parked is None
                                  else max_parked)
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
        self.stats = RuntimeStats()
        # Entries of the decode graphs' per-stage index lists (backends/common.py
        # `decode_graph_entries`; None: none captured).
        self.decode_graph_entries = None
        # Block-sparse attention (backends/block_sparse.py): why this server attends densely
        # where a request asks for it (None: it does not; set with the runtime), and per rid the
        # (kept, causal) block pairs of a chunked prompt's chunks so far.
        self.block_sparse_unserved = None
        self.block_sparse_chunks = {}

    @property
    def piece_rows(self) -> int:
        """Rows one MLP, linear-attention mixer or attention sublayer call takes at most in a
        compacted step (model_integration.py): the chunk size, set by the model runner hook (0:
        no limit). The parking lot prices a rejoin's pieces with it."""
        return self.parking.piece_rows

    @piece_rows.setter
    def piece_rows(self, rows: int) -> None:
        self.parking.piece_rows = rows

    @property
    def has_schedule(self) -> bool:
        return self.stages.num_drops > 0

    @property
    def no_schedule_reason(self):
        """Why no request drops in this process (None when the model has drop layers)."""
        if self.has_schedule:
            return None
        from uniprefill_sglang.schedule import NO_DROP_LAYERS

        return self.dense_reason or NO_DROP_LAYERS

    # ---- forward lifecycle -------------------------------------------------------------
    def begin_forward(self, fb) -> DropContext:
        self.slots.mark_written(fb.out_cache_loc)
        if self.checkpoint is not None:
            self.checkpoint.invalidate(fb.out_cache_loc)
        plan = forward_plan(fb)
        is_extend = is_prefill_mode(fb.forward_mode) and fb.extend_seq_lens_cpu is not None
        ctx = DropContext(plan=plan, forward_batch=fb, is_extend=is_extend)
        if is_extend:
            if plan is not None and any(d.reason == "decode" for d in plan.decisions):
                self.stats.mixed_forwards += 1
            survivors, kv = ctx.survivors, ctx.kv
            survivors.positions, survivors.out_cache_loc = fb.positions, fb.out_cache_loc
            survivors.lens = list(fb.extend_seq_lens_cpu)
            survivors.fixed_lens = self.prefix_lens(fb)
            ctx.report.kept.append(list(survivors.lens))
            kv.prefix_valid = self.stage_kv.prefix_valid(fb.req_pool_indices, survivors.fixed_lens)
            kv.sparse = [v[-1] < p for v, p in zip(kv.prefix_valid, survivors.fixed_lens)]
            if plan is not None and self.has_schedule:
                self._note_refused_parking(ctx)
                parked = {d.rid: self.parking.get(d.rid) for d in plan.decisions
                          if self.parking.is_parked(d.rid)}
                ctx.parking.before = {rid: (rows, rows.count) for rid, rows in parked.items()}
                # A dense step of a request with parked rows (a recovery, a final chunk in a
                # batch that asks for logprobs) must still let them rejoin, all kept.
                ctx.parking.rejoins = any(d.rid in parked and not d.park for d in plan.decisions)
                if ctx.parking.rejoins:
                    start_peak_measure(ctx.parking, fb.out_cache_loc.device)
        elif fb.forward_mode.is_decode() and self.has_schedule:
            rows = self.host_rows(fb)
            self.stage_kv.refresh_stale(rows, fb.req_pool_indices, fb.seq_lens, fb.seq_lens_cpu)
            ctx.kv.gaps = [self.kv_gaps.get(r) for r in rows]
            ctx.kv.sparse = [any(g) for g in ctx.kv.gaps]
            if self.check_kv_lens and any(ctx.kv.sparse):
                self.stage_kv.check_decode(fb.req_pool_indices, fb.seq_lens, fb.seq_lens_cpu,
                                           ctx.kv.gaps)
        inputs = getattr(fb, "uniprefill_inputs", None)
        if inputs is None:  # a batch the ForwardBatch hook did not build (an idle one)
            inputs = fb.uniprefill_inputs = ForwardInputs(req_rows=None)
        inputs.drop_context = ctx
        return ctx

    def _note_refused_parking(self, ctx: DropContext) -> None:
        """A final chunk whose earlier chunks were refused parking says why; nothing is left to
        remember of the request after it."""
        for b, d in enumerate(ctx.plan.decisions):
            why = self.parking.refused.pop(d.rid, None) if d.final_chunk else None
            if why is not None:
                ctx.note(b, f"earlier chunks not parked ({why})" + (
                    ": drops among its final chunk's tokens only" if d.enabled else ""))

    @staticmethod
    def _close(ctx: DropContext) -> None:
        """The batch no longer runs in this drop context."""
        ctx.forward_batch.uniprefill_inputs.drop_context = None

    def end_forward(self, ctx: DropContext) -> None:
        self._close(ctx)
        for slots in ctx.parking.ghost_slots:  # computed past the first drop on a partial view
            self.slots.mark_dropped(slots, 0, release=False)  # parked: it rejoins later
        for rid in ctx.parking.finished:
            self.parking.forget(rid)
        if ctx.is_extend and ctx.plan is not None and len(ctx.report.kept) > 1:
            for b, d in enumerate(ctx.plan.decisions):  # requests through every drop
                if d.enabled and b not in ctx.parking.parked_now:
                    self.stats.scored_tokens += ctx.report.kept[0][b]
                    self.stats.kept_tokens += ctx.report.kept[-1][b]
        if ctx.is_extend and ctx.kv.sparse is not None and self.has_schedule:
            self._record_gaps(ctx)
        if ctx.parking.rejoins:
            self.stats.last_rejoin = rejoin_record(ctx, self.parking.cost,
                                                   self.stats.last_rejoin, self.piece_rows,
                                                   self.config.block_sparse_block_size)

    def abandon_forward(self, ctx: DropContext, give_up_parking: bool = False) -> None:
        """A forward failed in UniPrefill's code: undo what it changed, so that the batch can
        run again dense with every token's KV complete. Its new slots are reset when the new
        forward begins; requests whose prefix it moved to private slots point at the shared
        prefix again; the parked rows are as they were when it began, so that the dense run
        lets them rejoin whole (every later layer then holds every token of the prompt).

        `give_up_parking` (the dense run failed as well): the parked rows are dropped instead,
        leaving their requests' earlier chunks with stage-0 KV only; the caller fails those
        requests (`failed_requests`)."""
        self._close(ctx)
        rows = self.host_rows(ctx.forward_batch)
        decisions = ctx.plan.decisions if ctx.plan else []
        self.prefix_reuse.point_back(ctx.prefixes, decisions)
        self.parking.roll_back(ctx.parking.before, [d.rid for d in decisions])
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
        for b, (row, plen) in enumerate(zip(self.host_rows(fb), self.prefix_lens(fb))):
            ghost = 1 if b in ctx.parking.parked_now else 0
            entered = [ctx.report.kept[min(s, len(ctx.report.kept) - 1)][b] - ghost
                       for s in range(1, self.stages.num_drops + 1)]
            if not self.stage_kv.record_extend(row, plen + fb.extend_seq_lens_cpu[b],
                                               ctx.kv.prefix_valid[b], entered,
                                               corrupt=self.test_fault == "kv_gaps"):
                # An inconsistent host mirror must not take the server down: the device's
                # slot map is the truth, read back before the row's next decode.
                logger.error("UniPrefill: inconsistent KV gaps for request row %d; re-reading "
                             "them from the device", row)

    def kv_pool_report(self, allocator) -> list:
        """Per stage (0 = the full pool): layers, slots, free slots, K+V bytes per slot."""
        free = allocator.available_size()
        if self.slots.staged:
            return self.slots.pools.report(free)
        per_layer = slot_bytes_per_layer(self.token_to_kv_pool)
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
        inputs = getattr(fb, "uniprefill_inputs", None)
        rows = inputs.req_rows if inputs is not None else None
        if rows is None or len(rows) != fb.batch_size:
            rows = fb.req_pool_indices.tolist()
        return rows

    @staticmethod
    def prefix_lens(fb) -> list:
        """Per request of an extend, the tokens before its new ones (cached or earlier chunks)."""
        return list(fb.extend_prefix_lens_cpu or [0] * len(fb.extend_seq_lens_cpu))
