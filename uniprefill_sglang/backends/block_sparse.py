"""Block-sparse prefill attention in the serving path (off unless a flag or a knob sets it).

A request's prefill chunk attends, layer by layer, only to the key blocks an estimate picks
(`kernels.block_mask_reference`: mean-pooled query and key blocks, or the exact attention of the
chunk's last `--uniprefill-last-queries` queries, or the union of both picks, per
`--uniprefill-block-sparse-estimate`; then a fixed density or the blocks holding a top-p of the
estimated mass, the sink block and each query block's own diagonal block always kept) and runs
`kernels.block_sparse_attention` over them: the Triton kernel on a GPU (the triton and fa3
prefill backends), its torch path on the CPU.

Which keys a chunk's queries read is what the adapter's dense attention would read: at a layer
before the first drop every token of the request's sequence (its cached or earlier chunks'
prefix, then its new rows, so a chunk's queries see the prefix's key blocks); after a drop the
stage's valid prefix and the survivors through the rows this call runs (`common.stage_keys`),
blocks then cut over those entries, which keep position order. The queries are the last keys
(bottom-right). Every row's KV is still written, so what the radix cache holds is complete.
No query block is forced dense (the kernel module's `last_blocks`): a prefix's KV does not
depend on where its request ended, so a follow-up over the cached prefix computes what the
whole prompt computes (given block-aligned prefixes, as the radix cache may not give).

Dense stays: sliding-window layers, soft-capped logits (the kernel has no cap), cross
attention, a request with fewer keys in the step than `--uniprefill-block-sparse-min-tokens`,
and every request on a prefill backend without a path or of a model with multi-head latent
attention (its `meta_info` says why; the server flags are refused at start-up there). In a call
where some request runs block-sparse, the others attend here too, over every causal block.

Per request the step tallies the kept and the causal (KV head, query block, key block) pairs
on the device, read once when the forward reports (`BlockSparseStep.entry`): the realised
density over the layers and chunks that ran block-sparse, 1.0 where none did. The chunks of a
chunked prompt carry the tally to its next chunk (`UniPrefillRuntime.block_sparse_chunks`).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import torch

from uniprefill_sglang import environ, kernels
from uniprefill_sglang.backends.common import (row_piece, sliding_window, stage_keys, view_cache,
                                               write_kv)
from uniprefill_sglang.kernels.block_sparse_reference import causal_block_pairs

# The prefill backend classes with a block-sparse path (their adapters call `extend_attention`).
SERVED_BY = ("TorchNativeAttnBackend", "TritonAttnBackend", "FlashAttentionBackend")
SINK_BLOCKS = 1
LOCAL_BLOCKS = 1
META_KEY = "block_sparse_density"


@dataclasses.dataclass
class BlockSparseStep:
    """One extend forward's block-sparse plan (per request: the rule it runs, or None) and
    its tally."""
    rules: List[Optional[Tuple[str, float, str, int]]]  # request_knobs.RequestKnobs.block_sparse
    asked: List[bool]  # did the request ask for block-sparse attention (it is reported)
    block_size: int
    kept: List = dataclasses.field(default_factory=list)  # device scalars (or 0)
    causal: List[int] = dataclasses.field(default_factory=list)
    earlier: List[Tuple[float, int]] = dataclasses.field(default_factory=list)  # earlier chunks
    carry: Optional[Dict] = None  # the runtime's per-rid tallies of unfinished prompts

    def applies_to(self, layer) -> bool:
        return (any(self.rules) and sliding_window(layer) is None
                and not getattr(layer, "is_cross_attention", False)
                and not getattr(layer, "logit_cap", 0.0))

    def tally(self, b: int, kept: torch.Tensor, causal: int) -> None:
        self.kept[b] = self.kept[b] + kept
        self.causal[b] += causal

    def entry(self, b: int, decision) -> dict:
        """The request's `meta_info` entry; a chunk before its prompt's last passes its tally on
        to the next chunk."""
        if not self.asked[b]:
            return {}
        kept = self.earlier[b][0] + float(self.kept[b])
        causal = self.earlier[b][1] + self.causal[b]
        if not decision.final_chunk and decision.rid is not None:
            self.carry[decision.rid] = (kept, causal)
        return {META_KEY: round(kept / causal, 6) if causal else 1.0}


def step_of(ctx, runtime) -> Optional[BlockSparseStep]:
    """The extend forward's step, planned at its first use (a layer's attention, or the report
    where none asked: patches/logits.py) and kept as `ctx.report.block_sparse`."""
    cache = view_cache(ctx, "block_sparse")
    if "step" not in cache:
        cache["step"] = ctx.report.block_sparse = plan_step(runtime, ctx)
    return cache["step"]


def runs_in(ctx, runtime) -> bool:
    """Does some request of this extend attend block-sparse (so that it runs eagerly, not in a
    prefill CUDA graph: patches/cuda_graphs.py)?"""
    step = step_of(ctx, runtime)
    return step is not None and any(step.rules)


def unserved_reason(prefill_backend: str, latent_attention: bool) -> Optional[str]:
    """Why a server attends densely where a request asks for block-sparse attention (None: it
    does not). `prefill_backend`: the class name of its prefill attention backend. Multi-head
    latent attention's layers before the first drop run the multi-head form over keys that
    the latent pool does not hold, and its absorbed form has no block-sparse path."""
    if latent_attention:
        return "multi-head latent attention has no block-sparse path"
    if prefill_backend not in SERVED_BY:
        return f"the prefill backend {prefill_backend} has no block-sparse path"
    return None


def plan_step(runtime, ctx) -> Optional[BlockSparseStep]:
    """The forward's plan, or None where no request asks for block-sparse attention."""
    if ctx.plan is None or not ctx.plan.any_block_sparse:
        return None
    decisions = ctx.plan.decisions
    config = runtime.config
    unserved = runtime.block_sparse_unserved
    rules, asked, earlier = [], [], []
    for b, d in enumerate(decisions):
        ask = d.block_sparse is not None and d.reason != "decode"
        rule = d.block_sparse if ask else None
        if ask and unserved is not None:
            ctx.note(b, f"block-sparse attention: {unserved}, attended densely")
            rule = None
        elif ask and (ctx.survivors.fixed_lens[b] + ctx.survivors.lens[b]
                      < config.block_sparse_min_tokens):
            rule = None  # a short sequence: dense this step
        rules.append(rule)
        asked.append(ask)
        earlier.append(runtime.block_sparse_chunks.pop(d.rid, (0.0, 0)) if ask else (0.0, 0))
    n = len(decisions)
    return BlockSparseStep(rules, asked, config.block_sparse_block_size, [0] * n, [0] * n,
                           earlier, runtime.block_sparse_chunks)


def causal_pairs(n_q: int, n_k: int, block_size: int) -> int:
    """(query block, key block) pairs with a key some query sees, bottom-right (host ints)."""
    if n_q == 0:
        return 0
    a0 = (n_k - n_q) // block_size
    rows = (n_k - 1) // block_size - a0 + 1
    return rows * a0 + rows * (rows + 1) // 2


def _estimate_dtype(device: torch.device) -> torch.dtype:
    """The estimates' arithmetic: float64 on the CPU (where the fidelity runs were measured),
    float32 on an accelerator, whose float64 work runs at a fraction of the rate (in float64
    the pooled estimate of a 131K chunk cost about as much as the kernel on an H100)."""
    return torch.float64 if device.type == "cpu" else torch.float32


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           rule: Optional[Tuple[str, float, str, int]], block_size: int, sm_scale: float,
           path: Optional[str] = None):
    """One request's queries (the last of its keys) over the key blocks `rule` keeps (None:
    every causal block; else ("density" or "top_p", value, estimate, last queries)). Returns
    (out [n_q, Hq, Dv] in q's dtype, kept pairs as a device scalar, causal pairs as a host int,
    both over the mask's heads)."""
    n_q, n_k = q.shape[0], k.shape[0]
    if rule is None:
        mask = causal_block_pairs(n_q, n_k, block_size, device=q.device)[None]
    else:
        kind, value, estimate, last_queries = rule
        mask = kernels.block_mask_reference(q, k, block_size, **{kind: value},
                                            sink_blocks=SINK_BLOCKS, local_blocks=LOCAL_BLOCKS,
                                            sm_scale=sm_scale, estimate=estimate,
                                            last_queries=last_queries,
                                            estimate_dtype=_estimate_dtype(q.device))
    out = kernels.block_sparse_attention(q, k, v, mask, block_size, sm_scale, path=path)
    return out, mask.sum(), causal_pairs(n_q, n_k, block_size) * mask.shape[0]


def request_keys(runtime, ctx, stage: int, piece) -> List[torch.Tensor]:
    """Per request, the pool slots of the keys its rows in `piece` attend to, in position
    order, its own rows last (the module docstring)."""
    req_to_token = runtime.req_to_token_pool.req_to_token
    if stage == 0:
        rows = runtime.host_rows(ctx.forward_batch)
        return [req_to_token[rows[b], :ctx.survivors.fixed_lens[b] + t]
                for b, t in enumerate(piece.through)]
    _, indices, _ = stage_keys(runtime, req_to_token, ctx, stage, piece.through)
    counts = [p[stage] + t for p, t in zip(ctx.kv.prefix_valid, piece.through)]
    return list(torch.split(indices, counts))


def extend_attention(pool, q, k, v, layer, forward_batch,
                     save_kv_cache: bool) -> Optional[torch.Tensor]:
    """An adapter's `forward_extend` hook: the layer's attention when some request of the call
    runs block-sparse (KV written first), else None (the adapter goes on as before)."""
    from uniprefill_sglang.context import drop_context
    from uniprefill_sglang.runtime import get_runtime

    ctx, runtime = drop_context(forward_batch), get_runtime()
    if ctx is None or runtime is None or not ctx.is_extend or k is None or v is None:
        return None
    step = step_of(ctx, runtime)
    if step is None or not step.applies_to(layer):
        return None
    piece = row_piece(ctx)
    if not any(step.rules[b] for b, n in enumerate(piece.lens) if n):
        return None
    stage = runtime.stages.stage(layer.layer_id)
    if save_kv_cache:
        write_kv(pool, layer, ctx.survivors.out_cache_loc[piece.rows], k, v)
    hq, dv = layer.tp_q_head_num, layer.v_head_dim
    q = q.reshape(-1, hq, layer.qk_head_dim)
    out = q.new_zeros((q.shape[0], hq, dv))  # rows past the batch's (graph padding) stay zero
    k_buffer, v_buffer = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
    path = environ.kernel_path()
    s = 0
    for b, slots in enumerate(request_keys(runtime, ctx, stage, piece)):
        n = piece.lens[b]
        if n == 0:
            continue
        o, kept, causal = attend(q[s:s + n], k_buffer[slots].to(q.dtype),
                                 v_buffer[slots].to(q.dtype), step.rules[b], step.block_size,
                                 layer.scaling, path)
        out[s:s + n] = o
        if step.rules[b] is not None:
            step.tally(b, kept, causal)
        s += n
    return out.view(-1, hq * dv)
