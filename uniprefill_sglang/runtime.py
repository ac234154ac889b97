"""Process-wide UniPrefill state of one model runner, and the method's per-forward steps.

`UniPrefillRuntime` is created when the model runner has built its model and KV pool
(patches/model_runner.py). Per forward it opens a `DropContext`, performs the drop at each drop
layer (score with the last queries -> select blocks -> shrink the context -> mark dropped slots),
and closes the context.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from uniprefill_sglang import kernels
from uniprefill_sglang.config import UniPrefillConfig
from uniprefill_sglang.context import DropContext, set_current, to_device
from uniprefill_sglang.kv_validity import KVGaps, LayerStages, SlotStages, check_kv_lens, \
    gather_seq_slots
from uniprefill_sglang.request_plan import is_prefill_mode, log_fallback_once
from uniprefill_sglang.tp_agreement import check_enabled

logger = logging.getLogger(__name__)

_runtime: Optional["UniPrefillRuntime"] = None


def get_runtime() -> Optional["UniPrefillRuntime"]:
    return _runtime


def set_runtime(runtime: Optional["UniPrefillRuntime"]) -> None:
    global _runtime
    _runtime = runtime


class UniPrefillRuntime:
    def __init__(self, config: UniPrefillConfig, stages: LayerStages, req_to_token_pool,
                 token_to_kv_pool, device, tp_agreement=None):
        self.config = config
        self.stages = stages
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        # TPScoreAgreement when attention heads are split over ranks (tp_agreement.py).
        self.tp_agreement = tp_agreement
        self.check_tp = tp_agreement is not None and check_enabled()
        # Debug: report a fingerprint of each request's kept positions per stage, so runs can
        # be compared token for token (TP=1 vs TP=2); one host sync per drop.
        self.report_kept_positions = os.environ.get("UNIPREFILL_REPORT_KEPT", "0") == "1"
        # Debug: check the host-side KV lengths against the device at every use (one sync each).
        self.check_kv_lens = os.environ.get("UNIPREFILL_CHECK_KV_LENS", "0") == "1"
        num_slots = token_to_kv_pool.get_key_buffer(0).shape[0]
        self.slots = SlotStages(num_slots, stages.num_drops, device)
        # Host mirror of the KV each request lacks per stage: decode steps read their sparsity
        # and per-stage KV lengths from it without a device sync.
        self.kv_gaps = KVGaps(req_to_token_pool.req_to_token.shape[0], stages.num_drops)
        # Chunked prefill: rid -> ParkedRows; rids whose prompt exceeds the parking budget.
        self.parked: dict = {}
        self.refused_parking: set = set()
        self.can_park = False  # set once the model integration can park at the first drop
        self.mixed_forwards = 0  # prefill forwards that carried decode rows (observability)
        # Prompt tokens that reached a drop with UniPrefill on, and how many of them were left
        # after the last drop (cumulative; the keep ratio a server realised, e.g. under load).
        self.scored_tokens = 0
        self.kept_tokens = 0

    @property
    def has_schedule(self) -> bool:
        return self.stages.num_drops > 0

    # ---- forward lifecycle -------------------------------------------------------------
    def begin_forward(self, forward_batch) -> DropContext:
        fb = forward_batch
        mode = fb.forward_mode
        self.slots.mark_written(fb.out_cache_loc)
        plan = getattr(fb, "uniprefill_plan", None)
        is_extend = is_prefill_mode(mode) and fb.extend_seq_lens_cpu is not None
        ctx = DropContext(plan=plan, forward_batch=fb, is_extend=is_extend)
        if is_extend:
            if plan is not None and any(d.reason == "decode" for d in plan.decisions):
                self.mixed_forwards += 1
            ctx.positions = fb.positions
            ctx.out_cache_loc = fb.out_cache_loc
            ctx.lens = list(fb.extend_seq_lens_cpu)
            ctx.fixed_lens = list(fb.extend_prefix_lens_cpu or [0] * len(ctx.lens))
            ctx.kept.append(list(ctx.lens))
            ctx.prefix_valid = self._prefix_valid(fb)
            ctx.sparse = [valid[-1] < plen for valid, plen in zip(ctx.prefix_valid, ctx.fixed_lens)]
        elif mode.is_decode() and self.has_schedule:
            ctx.kv_gaps = [self.kv_gaps.get(r) for r in self._host_rows(fb)]
            ctx.sparse = [any(g) for g in ctx.kv_gaps]
            if self.check_kv_lens and any(ctx.sparse):
                self._check_decode_gaps(fb, ctx.kv_gaps)
        set_current(ctx)
        return ctx

    def end_forward(self, ctx: DropContext) -> None:
        set_current(None)
        for slots in ctx.ghost_slots:  # computed past the first drop on a partial view
            self.slots.mark_dropped(slots, 0)
        for rid in ctx.finished_parking:
            self.forget(rid)
        if ctx.is_extend and ctx.plan is not None and len(ctx.kept) > 1:
            self._count_kept(ctx)
        if ctx.is_extend and ctx.sparse is not None and self.has_schedule:
            self._record_gaps(ctx)

    def _record_gaps(self, ctx: DropContext) -> None:
        """After an extend: per request, the KV each stage after the first lacks, from the
        host-known counts (valid prefix + rows that entered the stage; a parking chunk's one
        row past the first drop is marked dropped at end_forward, so it does not count)."""
        fb = ctx.forward_batch
        prefix_lens = fb.extend_prefix_lens_cpu or [0] * len(fb.extend_seq_lens_cpu)
        for b, row in enumerate(self._host_rows(fb)):
            seq_len = prefix_lens[b] + fb.extend_seq_lens_cpu[b]
            ghost = 1 if b in ctx.parked_now else 0
            gaps = []
            for s in range(1, self.stages.num_drops + 1):
                entered = ctx.kept[min(s, len(ctx.kept) - 1)][b] - ghost
                gaps.append(seq_len - ctx.prefix_valid[b][s] - entered)
            self.kv_gaps.set(row, gaps)

    def _seq_valid_counts(self, req_pool_indices, seq_lens, n: int) -> torch.Tensor:
        """[bs, D + 1] on the device: per request, how many slots of positions [0, seq_len)
        hold KV for each stage (n = the lengths' sum, host-known)."""
        seq = gather_seq_slots(self.req_to_token_pool.req_to_token, req_pool_indices, seq_lens, n)
        return self.slots.valid_counts(seq.slots, seq.row, req_pool_indices.shape[0])

    def _check_decode_gaps(self, fb, gaps) -> None:
        """Debug: the host gaps of a decode batch agree with the device's slot stages."""
        bs = len(gaps)
        seq_lens = fb.seq_lens_cpu[:bs].to(torch.int32)
        device = self._seq_valid_counts(fb.req_pool_indices[:bs], fb.seq_lens[:bs],
                                        int(seq_lens.sum()))[:, 1:]
        host = seq_lens.unsqueeze(1) - torch.tensor(gaps, dtype=torch.int32)
        check_kv_lens(host, device, "decode, valid KV per request and stage from the host gaps")

    def _count_kept(self, ctx: DropContext) -> None:
        """Count the requests that went through every drop (not the chunks that parked)."""
        for b, d in enumerate(ctx.plan.decisions):
            if d.enabled and not (d.park and d.rid in self.parked):
                self.scored_tokens += ctx.kept[0][b]
                self.kept_tokens += ctx.kept[-1][b]

    @staticmethod
    def _host_rows(fb) -> list:
        """The batch's req-pool rows on the host (attached by the ForwardBatch hook)."""
        rows = getattr(fb, "uniprefill_req_rows", None)
        if rows is None or len(rows) != fb.batch_size:
            rows = fb.req_pool_indices.tolist()
        return rows

    def _prefix_valid(self, fb) -> list:
        """Per request, per stage 0..D: how many slots of its cached prefix hold KV for that
        stage (one device read per batch with a prefix; the whole prefix when nothing is
        dropped)."""
        prefix_lens = fb.extend_prefix_lens_cpu or [0] * len(fb.extend_seq_lens_cpu)
        valid = [[plen] * (self.stages.num_drops + 1) for plen in prefix_lens]
        with_prefix = [b for b, plen in enumerate(prefix_lens) if plen > 0]
        if not self.has_schedule or not with_prefix:
            return valid
        device = fb.req_pool_indices.device
        lens = [prefix_lens[b] for b in with_prefix]
        valid_counts = self._seq_valid_counts(
            fb.req_pool_indices[to_device(with_prefix, torch.int64, device)],
            to_device(lens, torch.int64, device), sum(lens)).tolist()
        for b, counts in zip(with_prefix, valid_counts):
            valid[b] = counts
        return valid

    # ---- chunked prefill: parked rows ---------------------------------------------------
    def _park(self, rid: str, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        self.parked[rid].append(hidden, residual)

    def forget(self, rid: str) -> None:
        """Drop a request's parked state (finished, aborted)."""
        self.parked.pop(rid, None)
        self.refused_parking.discard(rid)

    def _may_park(self, decision, prefix_len: int) -> bool:
        rid = decision.rid
        if rid in self.parked:
            return True
        if rid in self.refused_parking or not self.can_park:
            return False
        # First chunk of this request: does the rest of the prompt fit the parking budget?
        if decision.prompt_len - prefix_len > self.config.max_parked_tokens:
            self.refused_parking.add(rid)
            log_fallback_once("prompt longer than --uniprefill-max-parked-tokens: earlier "
                              "chunks run dense, the final chunk drops among its own tokens")
            return False
        # Only one chunked request is in flight in SGLang's scheduler; anything else parked is
        # left over from an abort that bypassed the hook.
        for stale in [r for r in self.parked if r != rid]:
            self.forget(stale)
        self.parked[rid] = ParkedRows(start_pos=prefix_len)
        return True

    # ---- the drop ----------------------------------------------------------------------
    def drop(self, ctx: DropContext, layer, q: torch.Tensor) -> None:
        self._drop(ctx, layer, q)
        if self.report_kept_positions:
            ctx.kept_digest.append(position_digest(ctx))
        if self.check_kv_lens:
            self._check_extend_lens(ctx, self.stages.drop_index[layer.layer_id] + 1)

    def _check_extend_lens(self, ctx: DropContext, stage: int) -> None:
        """Debug: the KV a request holds for the layers after this drop is, as the extend views
        assume, its valid prefix plus the rows still alive."""
        fb = ctx.forward_batch
        bs = len(ctx.lens)
        seq_lens = [p + n for p, n in zip(fb.extend_prefix_lens_cpu or [0] * bs,
                                          fb.extend_seq_lens_cpu)]
        device = self._seq_valid_counts(fb.req_pool_indices, fb.seq_lens, sum(seq_lens))
        host = torch.tensor([p[stage] + n for p, n in zip(ctx.prefix_valid, ctx.lens)])
        check_kv_lens(host, device[:, stage], f"extend after a drop, stage {stage}")

    def _drop(self, ctx: DropContext, layer, q: torch.Tensor) -> None:
        """At a drop layer, after its attention: keep the top blocks of each enabled request.

        At the first drop layer this also parks non-final chunks (all their rows stop here but
        the last, which carries the logits SGLang expects) and, for a final chunk, brings the
        parked rows back as candidates scored by the prompt's true last queries.
        """
        stage = self.stages.stage(layer.layer_id)
        drop_index = self.stages.drop_index[layer.layer_id]
        first_drop = drop_index == 0
        cfg = self.config
        fb = ctx.forward_batch
        device = q.device
        decisions = ctx.plan.decisions
        q = q.view(q.shape[0], layer.tp_q_head_num, layer.qk_head_dim)
        starts = ctx.segment_starts()
        req_rows = self._host_rows(fb)  # host copy: no sync before the scoring
        prefix_lens = ctx.fixed_lens
        req_to_token = self.req_to_token_pool.req_to_token
        total = ctx.positions.shape[0]
        empty = torch.empty(0, dtype=torch.int64, device=device)

        # Sources of rows after this drop: current rows [0, total), then parked rows joining.
        extra_pos, extra_slots, extra_hidden, extra_residual, extra_seg = [], [], [], [], []
        n_extra = 0
        q_parts, qpos_parts, k_slots, k_pos, cand_src = [], [], [], [], []
        q_indptr, k_indptr, cand_start, scored = [0], [0], [], []
        park_rows = []
        for b, d in enumerate(decisions):
            s, n = starts[b], ctx.lens[b]
            seg = torch.arange(s, s + n, device=device)
            plen = prefix_lens[b]
            if first_drop and d.park and n > 0 and self._may_park(d, plen):
                park_rows.append((b, seg))
                continue
            if first_drop and d.rid in self.refused_parking:
                if d.park:
                    d.reason = "non-final chunk of a prompt over the parking budget: runs dense"
                elif d.enabled:  # its final chunk: nothing to remember after it
                    self.refused_parking.discard(d.rid)
                    d.reason = ("prompt over --uniprefill-max-parked-tokens: drops among its "
                                "final chunk's tokens only")
            if not d.enabled:
                continue
            parked = self.parked.get(d.rid) if first_drop else None
            if parked is not None and parked.count == 0:
                parked = None
            # Candidates: parked rows of earlier chunks (if any), then this step's rows.
            if parked is not None:
                p0, pc = parked.start_pos, parked.count
                hid, res, pq, pqpos = parked.tensors()
                pslots_c = req_to_token[req_rows[b], p0:p0 + pc].to(torch.int64)
                ppos_c = torch.arange(p0, p0 + pc, device=device)
                src = torch.cat([total + n_extra + torch.arange(pc, device=device), seg])
                extra_pos.append(ppos_c), extra_slots.append(pslots_c)
                extra_hidden.append(hid), extra_residual.append(res)
                extra_seg.append(torch.full((pc,), b, dtype=torch.int64, device=device))
                n_extra += pc
                fixed_len = p0
                ctx.fixed_lens[b] = p0  # the parked rows are rows of this request from now on
            else:
                pc, src, fixed_len = 0, seg, plen
                pq = pqpos = None
                pslots_c = ppos_c = empty
            if parked is None and n < cfg.min_tokens_to_drop:
                d.reason = ("too few new tokens to score" if d.reason is None
                            else f"{d.reason}; too few of them to score")
                continue
            nq = min(cfg.last_queries, pc + n)
            own_q = q[s:s + n]
            own_qpos = ctx.positions[s:s + n]
            if nq > n and pq is not None:  # the final chunk is shorter than the query window
                own_q = torch.cat([pq.to(own_q.dtype), own_q])
                own_qpos = torch.cat([pqpos, own_qpos])
            q_parts.append(own_q[-nq:]), qpos_parts.append(own_qpos[-nq:])
            if fixed_len > 0:
                fslots, fpos = self.slots.valid_slots(req_to_token[req_rows[b], :fixed_len], stage)
            else:
                fslots = fpos = empty
            k_slots += [fslots.to(torch.int64), pslots_c, ctx.out_cache_loc[s:s + n].to(torch.int64)]
            k_pos += [fpos.to(torch.int64), ppos_c, ctx.positions[s:s + n].to(torch.int64)]
            cand_src.append(src)
            cand_start.append(fslots.numel())
            q_indptr.append(q_indptr[-1] + nq)
            k_indptr.append(k_indptr[-1] + fslots.numel() + pc + n)
            scored.append((b, pc))

        if not scored and not park_rows:
            ctx.kept.append(list(ctx.lens))
            return

        # Row sources: keep_mask over current rows + joining parked rows.
        keep_mask = torch.ones(total + n_extra, dtype=torch.bool, device=device)
        if n_extra:
            keep_mask[total:].fill_(False)
        all_pos = torch.cat([ctx.positions.to(torch.int64)] + extra_pos)
        all_slots = torch.cat([ctx.out_cache_loc.to(torch.int64)] + extra_slots)
        if scored:
            cand_src_t = torch.cat(cand_src)
            k_indptr_t = to_device(k_indptr, torch.int32, device)
            scores = kernels.score_tokens(
                torch.cat(q_parts), torch.cat(qpos_parts), to_device(q_indptr, torch.int32, device),
                self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                torch.cat(k_slots), torch.cat(k_pos), k_indptr_t, layer.scaling,
                max_q=max(hi - lo for lo, hi in zip(q_indptr, q_indptr[1:])),
                max_k=max(hi - lo for lo, hi in zip(k_indptr, k_indptr[1:])),
            )
            if self.tp_agreement is not None:
                # Each rank scored its own heads: every rank selects from the same summed bits.
                scores = self.tp_agreement.reduce_scores(scores)
            ds = [decisions[b] for b, _ in scored]
            keep_idx, new_counts = kernels.select_tokens(
                scores, torch.cat(k_pos), k_indptr_t, to_device(cand_start, torch.int64, device),
                cfg.block_size, to_device([d.top_p for d in ds], torch.float32, device),
                to_device([d.ratio_at(drop_index) for d in ds], torch.float32, device),
                cfg.sink_tokens, cfg.last_queries,
            )
            if self.check_tp:
                self.tp_agreement.verify(keep_idx, new_counts)
            keep_mask.index_fill_(0, cand_src_t, False)
            keep_mask.index_fill_(0, cand_src_t[keep_idx], True)
            # Dropped rows keep KV for the layers up to this one only; parked rows that
            # survive get full KV written by the rest of this forward.
            dropped_current = ~keep_mask[:total]
            self.slots.mark_dropped(ctx.out_cache_loc[dropped_current], stage)
            if n_extra:
                self.slots.mark_written(all_slots[total:][keep_mask[total:]])
            for (b, pc), count in zip(scored, new_counts.tolist()):
                if pc:
                    ctx.kept[0][b] = pc + ctx.lens[b]
                    ctx.finished_parking.append(decisions[b].rid)
                if count < pc + ctx.lens[b]:
                    ctx.sparse[b] = True
                ctx.lens[b] = int(count)
        for b, seg in park_rows:
            # All rows stop here and wait for the final chunk; the last one goes on alone so
            # the forward still yields the logits SGLang expects (they are discarded).
            ctx.to_park.append((decisions[b].rid, seg))
            ctx.parked_now.append(b)
            keep_mask.index_fill_(0, seg[:-1], False)
            self.slots.mark_dropped(ctx.out_cache_loc[seg[:-1]], stage)
            ctx.ghost_slots.append(ctx.out_cache_loc[seg[-1:]])
            self.parked[decisions[b].rid].add_queries(q[seg[-cfg.last_queries:]],
                                                      ctx.positions[seg[-cfg.last_queries:]])
            ctx.sparse[b] = True
            ctx.lens[b] = 1
        ctx.kept.append(list(ctx.lens))

        rows = torch.nonzero(keep_mask, as_tuple=True)[0]
        if rows.numel() == total and not n_extra and not park_rows:
            return
        if n_extra:
            # Parked rows rejoin their request ahead of its new rows: order by (request, position).
            seg_of_row = torch.cat([
                torch.repeat_interleave(torch.arange(len(decisions), device=device),
                                        to_device(starts_lens(starts, ctx, total), torch.int64,
                                                  device)),
                torch.cat(extra_seg),
            ])
            key = seg_of_row[rows] * (int(all_pos.max()) + 1) + all_pos[rows]
            rows = rows[torch.argsort(key, stable=True)]
        ctx.positions = all_pos.index_select(0, rows).to(ctx.positions.dtype)
        ctx.out_cache_loc = all_slots.index_select(0, rows).to(ctx.out_cache_loc.dtype)
        if n_extra:
            ctx.extra_hidden = torch.cat(extra_hidden)
            ctx.extra_residual = torch.cat(extra_residual)
        if ctx.pending_rows is not None:  # a previous drop's gather was never applied
            rows = ctx.pending_rows.index_select(0, rows)
        else:
            ctx.rows_before_pending = total
        ctx.park_sink = self._park
        ctx.pending_rows = rows
        ctx.compacted = True


def position_digest(ctx: DropContext) -> list:
    """Per request, a fingerprint of the positions that survive the current drop."""
    pos = ctx.positions.to(torch.int64)
    seg = torch.repeat_interleave(torch.arange(len(ctx.lens), device=pos.device),
                                  torch.tensor(ctx.lens, device=pos.device))
    digest = torch.zeros(len(ctx.lens), dtype=torch.int64, device=pos.device)
    digest.index_add_(0, seg, pos * pos % 1000003 + pos)
    return digest.tolist()


def starts_lens(starts, ctx, total):
    """Row counts per request before this drop, from the segment starts."""
    ends = starts[1:] + [total]
    return [e - s for s, e in zip(starts, ends)]


class ParkedRows:
    """Hidden state of a chunked request's earlier chunks, right after the first drop layer's
    attention (attention output and residual), plus the queries of its latest rows."""

    def __init__(self, start_pos: int):
        self.start_pos = start_pos
        self.hidden, self.residual = [], []
        self.q = self.q_pos = None
        self.count = 0

    def append(self, hidden, residual) -> None:
        self.hidden.append(hidden)
        self.residual.append(residual)
        self.count += hidden.shape[0]

    def add_queries(self, q, q_pos) -> None:
        self.q, self.q_pos = q, q_pos.to(torch.int64)

    def tensors(self):
        hidden, residual = torch.cat(self.hidden), torch.cat(self.residual)
        self.hidden, self.residual = [hidden], [residual]
        return hidden, residual, self.q, self.q_pos
