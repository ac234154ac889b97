"""Prefix reuse under token dropping: which survivors a request that hits a cached prefix uses.

The radix cache shares a prefix's KV slots by token content. Under UniPrefill the later layers
of a cached prefix hold KV only for the tokens the *first* request's question kept, so a later
question about the same document may find the tokens it needs dropped. The policies
(`--uniprefill-prefix-policy`, per request `custom_params["uniprefill_prefix_policy"]`):

* ``reuse-sparse``: read whatever the cache holds (the behaviour before these policies).
* ``dense-prefix``: a request that generates nothing (``max_new_tokens`` 0: what SGLang's
  frontend sends to cache the shared prefix before a ``fork``) runs dense, so the prefix it caches
  holds every token in every layer; other requests reuse as ``reuse-sparse``.
* ``reselect``: as ``dense-prefix``, and every request with a cached prefix selects anew over
  prefix plus new tokens, as if nothing were cached.
* ``verify`` (the default): as ``dense-prefix``; a request whose cached prefix lacks tokens past
  the first drop scores it with its own last queries at the first drop layer (whose KV holds every
  token), selects as if nothing were cached, and re-selects when the tokens of that selection which
  the cache lacks carry more than 1 - top-p of the attention mass (selection.prefix_coverage; the
  loss a top-p selection itself accepts); otherwise it reuses the cache. A cached prefix of at most
  `--uniprefill-sink-tokens` tokens (a chat template's system turn) is always re-selected: it is
  cheaper than verifying and keeps block boundaries where the uncached run has them.

Under ``verify`` and ``reselect`` a request that asked for no drop (``uniprefill: false``) over a
prefix cached sparse gets the dropped tokens back ("restored"): they rejoin with every row kept.

Re-selecting costs no recomputation of the first stage: every cached token's residual stream and
query at the first drop layer are kept (prefix_checkpoint.py), so the prefix's tokens rejoin there
as the parked rows of a chunked prefill do (parking.py), scored together with the new tokens.
They get KV slots of their own (the stage-0 KV copied from the shared slots, the later layers
written by this forward): KV another request shares is never overwritten. Those private slots
are the request's until it leaves (`release`, from the radix-cache hook), and the tree keeps
the prefix as the first request cached it.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import torch

from uniprefill_sglang.config import PREFIX_POLICIES
from uniprefill_sglang.parking import ParkedRows
from uniprefill_sglang.selection import DropCandidates, prefix_coverage

VERIFY, RESELECT, REUSE_SPARSE, DENSE_PREFIX = PREFIX_POLICIES
# Policies that need the checkpoint (prefix_checkpoint.py).
NEEDS_CHECKPOINT = (VERIFY, RESELECT)


def needs_checkpoint(server_args, config) -> bool:
    """Does this server keep the checkpoint (radix cache on, a re-selecting policy, and
    `--uniprefill-prefix-checkpoint` or the reselect policy)?"""
    return (not getattr(server_args, "disable_radix_cache", False)
            and config.prefix_policy in NEEDS_CHECKPOINT and config.prefix_checkpoint)


def reuse_tolerance(top_p: float) -> float:
    """The attention mass a verified reuse may miss: 1 - top-p, what a top-p selection itself
    lets go (a keep-ratio request uses the server's top-p, 0.99 unless set). Top-p 1 tolerates
    nothing."""
    return max(0.0, 1.0 - top_p)


@dataclasses.dataclass
class PrefixOutcome:
    """What a request with a cached prefix did with it (reported in meta_info)."""
    policy: str
    cached_tokens: int
    action: str = "reused"  # "reused" | "re-selected" | "restored" (a dense request)
    why: Optional[str] = None
    # verify: attention mass the cache lacks of this request's selection, mass the selection
    # drops itself, and how much may be missing for a reuse (fractions of the request's mass)
    missing_mass: Optional[float] = None
    dropped_mass: Optional[float] = None
    tolerance: Optional[float] = None

    def as_dict(self) -> dict:
        out = {"policy": self.policy, "cached_tokens": self.cached_tokens, "action": self.action}
        if self.why:
            out["why"] = self.why
        if self.missing_mass is not None:
            out["missing_mass"] = round(self.missing_mass, 6)
            out["dropped_mass"] = round(self.dropped_mass, 6)
            out["tolerance"] = round(self.tolerance, 6)
        return out


@dataclasses.dataclass
class MovedPrefixes:
    """One forward's requests whose cached prefix moved to private slots (`DropContext.prefixes`;
    `PrefixReuse.point_back` undoes it when the forward fails)."""
    # b -> (req-pool row, the shared slots it pointed at).
    moved: Dict[int, tuple] = dataclasses.field(default_factory=dict)


class PrivatePrefixes:
    """KV slots re-selected requests hold for their cached prefix's positions, by request id."""

    def __init__(self, allocator):
        self.allocator = allocator
        self.slots: Dict[str, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def held(self) -> int:
        return sum(int(s.numel()) for s in self.slots.values())

    def take(self, rid: str, count: int) -> Optional[torch.Tensor]:
        if self.allocator is None or rid in self.slots:
            return None
        slots = self.allocator.alloc(count)
        if slots is not None:
            self.slots[rid] = slots
        return slots

    def release(self, rid: str) -> None:
        slots = self.slots.pop(rid, None)
        if slots is not None:
            self.allocator.free(slots)


class PrefixReuse:
    """The first drop's decision for requests with a cached prefix, and the re-selection."""

    def __init__(self, runtime, allocator, checkpoint):
        self.runtime = runtime
        self.checkpoint = checkpoint  # None: nothing can be re-selected on this server
        self.private = PrivatePrefixes(allocator)
        stages = runtime.stages
        self.stage0_layers = [l for l in range(stages.num_layers) if stages.stage(l) == 0]

    def prefix_action(self, ctx, b: int, d):
        """What request b does with its cached prefix at the first drop, known from the host
        before the forward: (action, why). action: None (no cached prefix to report), "keep"
        (it reads the cache as it is; why says why, if not by policy), "restore" (a dense
        request gets the dropped tokens back), VERIFY (scores it first) or RESELECT."""
        cached = d.cached_len
        if d.restore_prefix:
            if ctx.kv.prefix_valid[b][-1] >= cached:
                return "keep", "cached prefix holds every token"
            if cached != ctx.survivors.fixed_lens[b]:
                return "keep", "cached prefix not contiguous with this step's rows"
            return "restore", None
        if not d.enabled or cached <= 0:
            return None, None
        if d.prefix_policy not in NEEDS_CHECKPOINT:
            return "keep", None
        parked = self.runtime.parking.get(d.rid)
        if cached != (parked.start_pos if parked is not None else ctx.survivors.fixed_lens[b]):
            return "keep", "cached prefix not contiguous with this step's rows"
        if d.prefix_policy == VERIFY:
            if cached <= self.runtime.config.sink_tokens:
                return RESELECT, "short cached prefix"
            if ctx.kv.prefix_valid[b][1] >= cached:  # (parked rows hold stage 0 only)
                return "keep", "cached prefix holds every token past the first drop"
            return VERIFY, None
        return RESELECT, None

    def rejoining_prefixes(self, ctx, layer, q) -> Dict[int, ParkedRows]:
        """At the first drop layer: per request that re-selects, its cached prefix as rows that
        rejoin here (moved to private slots). Records every cached-prefix request's outcome."""
        rt = self.runtime
        fb = ctx.forward_batch
        rows = rt.host_rows(fb)
        req_to_token = rt.req_to_token_pool.req_to_token
        candidates: List[int] = []  # requests that may re-select
        verifying: List[int] = []
        for b, d in enumerate(ctx.plan.decisions):
            action, why = self.prefix_action(ctx, b, d)
            if action is None:
                continue
            ctx.report.prefix_outcomes[b] = PrefixOutcome(d.prefix_policy, d.cached_len, why=why)
            if action == VERIFY:
                verifying.append(b)
            if action != "keep":
                candidates.append(b)
        if not candidates:
            return {}
        if self.checkpoint is None:
            for b in candidates:
                ctx.report.prefix_outcomes[b].why = ("this server keeps no prefix checkpoint (radix "
                                              "cache off, or a policy that never re-selects)")
            return {}
        prefix_slots = {b: req_to_token[rows[b], :ctx.plan.decisions[b].cached_len]
                        for b in candidates}
        # One host read for every decision of the batch: has each prefix a checkpoint, and
        # (verify) the masses.
        parts = [torch.stack([self.checkpoint.all_valid(prefix_slots[b])
                              for b in candidates]).double()]
        if verifying:
            coverage = self._verify(ctx, layer, q, verifying, rows)
            parts += [coverage.missing.double(), coverage.dropped.double()]
        host = torch.cat(parts).tolist()
        has_checkpoint = host[:len(candidates)]
        missing = dict(zip(verifying, host[len(candidates):len(candidates) + len(verifying)]))
        dropped = dict(zip(verifying, host[len(candidates) + len(verifying):]))
        out: Dict[int, ParkedRows] = {}
        for i, b in enumerate(candidates):
            outcome = ctx.report.prefix_outcomes[b]
            if b in missing:
                outcome.missing_mass, outcome.dropped_mass = missing[b], dropped[b]
                outcome.tolerance = reuse_tolerance(ctx.plan.decisions[b].top_p_at(0))
                if outcome.missing_mass <= outcome.tolerance:
                    outcome.why = "the cached survivors cover this request's selection"
                    continue
                outcome.why = "the cached survivors miss attention mass this request selects"
            if not has_checkpoint[i]:
                outcome.why = "cached prefix has no checkpoint (computed in a prefill CUDA graph)"
                continue
            rejoin = self._move_to_private(ctx, b, rows[b], prefix_slots[b], layer, q.dtype)
            if rejoin is None:
                outcome.why = "KV pool too full for a private copy of the prefix"
                continue
            if ctx.plan.decisions[b].restore_prefix:
                outcome.action = "restored"
                outcome.why = "a dense request: the tokens the cache dropped rejoin, all kept"
            else:
                outcome.action = "re-selected"
            out[b] = rejoin
        return out

    def _verify(self, ctx, layer, q, verifying: List[int], rows: List[int]):
        """prefix_coverage for the verifying requests: their last queries, keys = cached prefix
        (stage 0: every token), parked rows of earlier chunks, this step's rows."""
        rt = self.runtime
        req_to_token = rt.req_to_token_pool.req_to_token
        survivors = ctx.survivors
        starts = survivors.segment_starts()
        queries, query_pos, keys, key_pos, cached, qc, kc = [], [], [], [], [], [], []
        top_p, ratio = [], []
        for b in verifying:
            d = ctx.plan.decisions[b]
            n, start, fixed_len = survivors.lens[b], starts[b], survivors.fixed_lens[b]
            fixed = req_to_token[rows[b], :fixed_len].to(torch.int64)
            own_q, own_q_pos = self._last_queries(ctx, b, start, layer, q, fixed)
            queries.append(own_q)
            query_pos.append(own_q_pos)
            keys += [fixed, survivors.out_cache_loc[start:start + n].to(torch.int64)]
            key_pos += [torch.arange(fixed_len, device=q.device),
                        survivors.positions[start:start + n].to(torch.int64)]
            held = rt.slots.valid_mask(fixed[:d.cached_len], 1)
            own = torch.ones(fixed_len - d.cached_len + n, dtype=torch.bool, device=q.device)
            cached += [held, own]
            qc.append(own_q.shape[0])
            kc.append(fixed_len + n)
            top_p.append(d.top_p_at(0))
            ratio.append(d.ratio_at(0))
        cands = DropCandidates(torch.cat(queries), torch.cat(query_pos), qc, torch.cat(keys),
                               torch.cat(key_pos), kc, [0] * len(verifying), top_p, ratio)
        reduce = rt.tp_agreement.reduce_scores if rt.tp_agreement is not None else None
        return prefix_coverage(cands, rt.token_to_kv_pool.get_key_buffer(layer.layer_id),
                               layer.scaling, rt.rule, torch.cat(cached), reduce)

    def _last_queries(self, ctx, b: int, start: int, layer, q, fixed: torch.Tensor):
        """Request b's last `--uniprefill-last-queries` queries at this layer: this step's rows,
        preceded where it is shorter by the parked chunks' last queries or the cached prefix's
        saved ones."""
        rt = self.runtime
        n, positions = ctx.survivors.lens[b], ctx.survivors.positions
        q = q.view(q.shape[0], layer.tp_q_head_num, layer.qk_head_dim)
        own_q, own_pos = q[start:start + n], positions[start:start + n].to(torch.int64)
        num_q = min(rt.config.last_queries, fixed.numel() + n)
        if num_q > n:
            parked = rt.parking.get(ctx.plan.decisions[b].rid)
            if parked is not None and parked.last_q is not None:
                prev_q, prev_pos = parked.last_q.to(own_q.dtype), parked.last_q_pos
            else:
                k = min(num_q - n, fixed.numel())
                prev_q = self.checkpoint.queries(fixed[-k:], layer.tp_q_head_num, own_q.dtype)
                prev_pos = torch.arange(fixed.numel() - k, fixed.numel(), device=q.device)
            own_q, own_pos = torch.cat([prev_q, own_q]), torch.cat([prev_pos, own_pos])
        return own_q[-num_q:], own_pos[-num_q:]

    def _move_to_private(self, ctx, b: int, row: int, shared: torch.Tensor, layer, dtype):
        """Give request b private slots for its cached prefix, holding the prefix's stage-0 KV,
        and return the prefix as rows that rejoin after the first drop layer's attention."""
        rt = self.runtime
        d = ctx.plan.decisions[b]
        count = shared.numel()
        private = self.private.take(d.rid, count)
        if private is None:
            return None
        src = shared.to(torch.int64)
        dst = private.to(device=shared.device, dtype=torch.int64)
        pool = rt.token_to_kv_pool
        for l in self.stage0_layers:
            for buf in (pool.get_key_buffer(l), pool.get_value_buffer(l)):
                buf.index_copy_(0, dst, buf.index_select(0, src))
        ctx.prefixes.moved[b] = (row, shared.clone())
        rt.slots.mark_dropped(dst, 0, release=False)  # it rejoins at the first drop
        self.checkpoint.copy(src, dst)
        req_to_token = rt.req_to_token_pool.req_to_token
        req_to_token[row, :count] = dst.to(req_to_token.dtype)
        rejoin = ParkedRows(start_pos=0)
        rejoin.append(*self.checkpoint.rows(src, dtype))
        k = min(rt.config.last_queries, count)
        rejoin.set_last_queries(self.checkpoint.queries(src[-k:], layer.tp_q_head_num, dtype),
                                torch.arange(count - k, count, device=src.device))
        # The prefix holds no later-stage KV for this request any more: its valid counts past
        # stage 0 are those of the rows that rejoin (counted when they enter a stage).
        ctx.kv.prefix_valid[b] = [ctx.kv.prefix_valid[b][0]] + [0] * rt.stages.num_drops
        return rejoin

    def point_back(self, moved: MovedPrefixes, decisions) -> None:
        """A failed forward: the requests whose prefix it moved to private slots point at the
        shared prefix again, and the private slots are freed."""
        req_to_token = self.runtime.req_to_token_pool.req_to_token
        for b, (row, shared) in moved.moved.items():
            req_to_token[row, :shared.numel()] = shared
            self.release(decisions[b].rid)

    def release(self, rid: str) -> None:
        """The request left (finished, aborted or retracted): free its private prefix slots."""
        self.private.release(rid)
