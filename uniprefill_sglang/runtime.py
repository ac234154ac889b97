"""Process-wide UniPrefill state of one model runner, and the method's per-forward steps.

`UniPrefillRuntime` is created when the model runner has built its model and KV pool
(patches/model_runner.py). Per forward it opens a `DropContext`, performs the drop at each drop
layer (score with the last queries -> select blocks -> shrink the context -> mark dropped slots),
and closes the context.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from uniprefill_sglang import kernels
from uniprefill_sglang.config import UniPrefillConfig
from uniprefill_sglang.context import DropContext, set_current
from uniprefill_sglang.kv_validity import LayerStages, SlotStages
from uniprefill_sglang.request_plan import is_prefill_mode

logger = logging.getLogger(__name__)

_runtime: Optional["UniPrefillRuntime"] = None


def get_runtime() -> Optional["UniPrefillRuntime"]:
    return _runtime


def set_runtime(runtime: Optional["UniPrefillRuntime"]) -> None:
    global _runtime
    _runtime = runtime


class UniPrefillRuntime:
    def __init__(self, config: UniPrefillConfig, stages: LayerStages, req_to_token_pool,
                 token_to_kv_pool, device, tp_group=None):
        self.config = config
        self.stages = stages
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        self.tp_group = tp_group  # scores are summed over it before selection
        num_slots = token_to_kv_pool.get_key_buffer(0).shape[0]
        self.slots = SlotStages(num_slots, req_to_token_pool.req_to_token.shape[0],
                                stages.num_drops, device)

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
            ctx.positions = fb.positions
            ctx.out_cache_loc = fb.out_cache_loc
            ctx.lens = list(fb.extend_seq_lens_cpu)
            ctx.kept.append(list(ctx.lens))
            ctx.sparse = self._prefix_sparsity(fb)
        elif mode.is_decode() and self.has_schedule:
            ctx.sparse = self.slots.req_sparse[fb.req_pool_indices].tolist()
        set_current(ctx)
        return ctx

    def end_forward(self, ctx: DropContext) -> None:
        set_current(None)
        fb = ctx.forward_batch
        if ctx.is_extend and ctx.sparse is not None and self.has_schedule:
            flags = torch.tensor(ctx.sparse, dtype=torch.bool, device=fb.req_pool_indices.device)
            self.slots.req_sparse[fb.req_pool_indices] = flags

    def _prefix_sparsity(self, fb) -> list:
        """Per request: does its cached prefix miss KV in some layer?"""
        sparse = [False] * len(fb.extend_seq_lens_cpu)
        if not self.has_schedule:
            return sparse
        prefix_lens = fb.extend_prefix_lens_cpu or [0] * len(sparse)
        rows = fb.req_pool_indices.tolist()
        req_to_token = self.req_to_token_pool.req_to_token
        for b, (row, plen) in enumerate(zip(rows, prefix_lens)):
            if plen > 0:
                sparse[b] = bool(self.slots.count_sparse(req_to_token[row, :plen]).item())
        return sparse

    # ---- the drop ----------------------------------------------------------------------
    def drop(self, ctx: DropContext, layer, q: torch.Tensor) -> None:
        """At a drop layer, after its attention: keep the top blocks of each enabled request."""
        stage = self.stages.stage(layer.layer_id)
        cfg = self.config
        fb = ctx.forward_batch
        enabled = [
            b for b, d in enumerate(ctx.plan.decisions)
            if d.enabled and ctx.lens[b] >= cfg.min_tokens_to_drop
        ]
        if not enabled:
            ctx.kept.append(list(ctx.lens))
            return
        device = q.device
        q = q.view(q.shape[0], layer.tp_q_head_num, layer.qk_head_dim)
        starts = ctx.segment_starts()
        req_rows = fb.req_pool_indices.tolist()
        prefix_lens = fb.extend_prefix_lens_cpu
        req_to_token = self.req_to_token_pool.req_to_token

        q_rows, k_slots, k_pos, cand_rows = [], [], [], []
        q_indptr, k_indptr, cand_start = [0], [0], []
        for b in enabled:
            s, n = starts[b], ctx.lens[b]
            seg = torch.arange(s, s + n, device=device)
            nq = min(cfg.last_queries, n)
            q_rows.append(seg[n - nq:])
            plen = prefix_lens[b] if prefix_lens is not None else 0
            if plen > 0:
                pslots, ppos = self.slots.valid_slots(req_to_token[req_rows[b], :plen], stage)
            else:
                pslots = ppos = torch.empty(0, dtype=torch.int64, device=device)
            k_slots += [pslots.to(torch.int64), ctx.out_cache_loc[s:s + n].to(torch.int64)]
            k_pos += [ppos.to(torch.int64), ctx.positions[s:s + n].to(torch.int64)]
            cand_rows.append(seg)
            cand_start.append(pslots.numel())
            q_indptr.append(q_indptr[-1] + nq)
            k_indptr.append(k_indptr[-1] + pslots.numel() + n)

        q_rows = torch.cat(q_rows)
        k_slots, k_pos, cand_rows = torch.cat(k_slots), torch.cat(k_pos), torch.cat(cand_rows)
        q_indptr = torch.tensor(q_indptr, dtype=torch.int32, device=device)
        k_indptr = torch.tensor(k_indptr, dtype=torch.int32, device=device)
        scores = kernels.score_tokens(
            q.index_select(0, q_rows), ctx.positions.index_select(0, q_rows), q_indptr,
            self.token_to_kv_pool.get_key_buffer(layer.layer_id), k_slots, k_pos, k_indptr,
            layer.scaling,
        )
        if self.tp_group is not None:
            # Each rank scored its own heads: sum them so every rank selects the same tokens.
            scores = self.tp_group.all_reduce(scores)
        decisions = [ctx.plan.decisions[b] for b in enabled]
        keep_idx, new_counts = kernels.select_tokens(
            scores, k_pos, k_indptr,
            torch.tensor(cand_start, dtype=torch.int64, device=device),
            cfg.block_size,
            torch.tensor([d.top_p for d in decisions], dtype=torch.float32, device=device),
            torch.tensor([d.keep_ratio for d in decisions], dtype=torch.float32, device=device),
            cfg.sink_tokens, cfg.last_queries,
        )

        total = ctx.positions.shape[0]
        keep_mask = torch.ones(total, dtype=torch.bool, device=device)
        keep_mask[cand_rows] = False
        keep_mask[cand_rows[keep_idx]] = True
        self.slots.mark_dropped(ctx.out_cache_loc[~keep_mask], stage)
        rows = torch.nonzero(keep_mask, as_tuple=True)[0]

        for b, count in zip(enabled, new_counts.tolist()):
            if count < ctx.lens[b]:
                ctx.sparse[b] = True
            ctx.lens[b] = int(count)
        ctx.kept.append(list(ctx.lens))
        if rows.numel() == total:
            return
        ctx.positions = ctx.positions.index_select(0, rows)
        ctx.out_cache_loc = ctx.out_cache_loc.index_select(0, rows)
        if ctx.pending_rows is not None:  # a previous drop's gather was never applied
            rows = ctx.pending_rows.index_select(0, rows)
        else:
            ctx.rows_before_pending = total
        ctx.pending_rows = rows
        ctx.compacted = True
