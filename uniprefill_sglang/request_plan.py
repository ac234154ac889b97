"""Per-request UniPrefill decisions for one forward batch, and the dense-fallback log.

Built on the scheduler side from the batch's `Req` objects (they carry the sampling params and
the chunking state) and attached to the ForwardBatch; the model side only reads it.

Per-request overrides travel in `sampling_params["custom_params"]` (OpenAI API: `extra_body=
{"custom_params": {...}}`): `uniprefill` (bool), `uniprefill_top_p`, `uniprefill_keep_ratio`,
`uniprefill_prefix_policy`, `uniprefill_max_dropped_mass` (request_knobs.py), parsed once per
request on this side (`request_knobs`: kept on the Req as `req.uniprefill_knobs`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, List, Optional, Union

from uniprefill_sglang import versions
from uniprefill_sglang.config import PREFIX_POLICIES, UniPrefillConfig, per_drop
from uniprefill_sglang.request_knobs import RequestKnobError, RequestKnobs, parse_request_knobs

if TYPE_CHECKING:
    from uniprefill_sglang.context import DropContext

logger = logging.getLogger(__name__)

# Prefix policies under which a request generating nothing runs dense, and under which a dense
# request gets back what a cached prefix dropped (prefix_reuse.py).
CACHES_DENSE = tuple(p for p in PREFIX_POLICIES if p != "reuse-sparse")
RESTORES_DENSE = ("verify", "reselect")


def log_fallback_once(reason: str) -> None:
    """Log each kind of dense fallback once per process."""
    from uniprefill_sglang.state import plugin_state

    logged = plugin_state().logged
    if reason not in logged:
        logged.add(reason)
        logger.info("UniPrefill: running dense (%s); logged once per kind", reason)


@dataclasses.dataclass(frozen=True)
class RequestDecision:
    enabled: bool
    top_p: tuple  # attention mass kept, one per drop (the last repeats)
    keep_ratio: tuple  # one fraction per drop (the last repeats); empty: use top-p
    reason: Optional[str] = None  # why the request runs dense this step (the drop may add a
    # note, e.g. too few tokens to score: DropContext.note)
    # A non-final chunk whose rows stop at the first drop layer and wait there for the final
    # chunk (runtime.py decides whether the parked state fits).
    park: bool = False
    rid: Optional[str] = None
    prompt_len: int = 0  # tokens of the whole prompt (all chunks)
    # Prefix reuse (prefix_reuse.py): the policy, and the leading tokens the radix tree holds
    # for this request (0 without a radix cache).
    prefix_policy: str = "reuse-sparse"
    cached_len: int = 0
    # A dense request (it asked for no drop) over a cached prefix that may lack tokens in later
    # layers: under verify / reselect those rejoin at the first drop layer, all kept.
    restore_prefix: bool = False
    # A first drop that would let go more than this share of the scored attention mass keeps
    # every token at every drop (drop.py); None: no bound.
    max_dropped_mass: Optional[float] = None
    # False for a chunk before the prompt's last (parked or not): what concerns the whole
    # prompt (e.g. why its chunks were not parked) is reported on the final chunk.
    final_chunk: bool = True
    # Block-sparse prefill attention: ("density" or "top_p", value, estimate, last queries), or
    # None (dense attention; backends/block_sparse.py), whether or not the request drops.
    block_sparse: Optional[tuple] = None

    def ratio_at(self, drop_index: int) -> float:
        """Keep ratio of the given drop, or 0.0 for top-p selection."""
        return per_drop(self.keep_ratio, drop_index) if self.keep_ratio else 0.0

    def top_p_at(self, drop_index: int) -> float:
        return per_drop(self.top_p, drop_index)


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    decisions: List[RequestDecision]

    @property
    def any_block_sparse(self) -> bool:
        """Does some request attend block-sparse (backends/block_sparse.py)?"""
        return any(d.block_sparse for d in self.decisions)

    def all_dense(self, reason: str, restore: bool = False) -> "BatchPlan":
        """The same batch with every request dense (a forward that failed runs again), its
        attention too (no block-sparse rule). `restore`: a cached prefix lacking tokens past the
        first drop gets them back, as a request that asked for no drop does under verify /
        reselect (parked rows of earlier chunks rejoin whole in any dense step: runtime.py)."""
        return BatchPlan([dataclasses.replace(
            d, enabled=False, park=False, block_sparse=None,
            restore_prefix=restore and d.cached_len > 0 and d.prefix_policy in RESTORES_DENSE,
            reason=d.reason if d.reason == "decode" else reason)
            for d in self.decisions])


@dataclasses.dataclass
class ForwardInputs:
    """What a ForwardBatch carries for UniPrefill, as `forward_batch.uniprefill_inputs`: the
    batch's req-pool rows on the host (decode and every drop read them without a device sync)
    and, for an extend, its plan (both set by the ForwardBatch hook), and the drop context of
    the forward that runs it (runtime.begin_forward opens it, end_forward closes it)."""
    req_rows: Optional[List[int]]
    plan: Optional[BatchPlan] = None
    drop_context: Optional["DropContext"] = None


def forward_plan(fb) -> Optional[BatchPlan]:
    inputs = getattr(fb, "uniprefill_inputs", None)
    return inputs.plan if inputs is not None else None


def is_prefill_mode(mode) -> bool:
    """Plain prefill (EXTEND) or prefill mixed with 1-token decodes (MIXED); not spec-verify etc."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return mode == ForwardMode.EXTEND or mode == ForwardMode.MIXED


def _custom_params(req) -> dict:
    sp = getattr(req, "sampling_params", None)
    params = getattr(sp, "custom_params", None) if sp is not None else None
    return params if isinstance(params, dict) else {}


def request_knobs(req, config: UniPrefillConfig) -> Union[RequestKnobs, RequestKnobError]:
    """The request's knobs (or why they are invalid), parsed from its `custom_params` at its
    first plan and kept on it as `req.uniprefill_knobs`: each chunk and step of the request
    reads them there."""
    knobs = getattr(req, "uniprefill_knobs", None)
    if knobs is None:
        try:
            knobs = parse_request_knobs(_custom_params(req), config)
        except RequestKnobError as e:
            knobs = e
        req.uniprefill_knobs = knobs
    return knobs


def decide(req, extend_len: int, config: UniPrefillConfig, no_schedule: Optional[str],
           batch_reason: Optional[str], cached_len: int = 0) -> RequestDecision:
    """One request's decision for this step. `no_schedule`: why nothing drops in this process
    (None: the model has drop layers)."""
    top_p, keep_ratio = config.top_p, config.keep_ratio
    policy = config.prefix_policy

    def dense(reason: str) -> RequestDecision:
        # With its rid: a dense final chunk still lets its earlier chunks' parked rows rejoin.
        return RequestDecision(False, top_p, keep_ratio or (), reason, prefix_policy=policy,
                               cached_len=cached_len, rid=getattr(req, "rid", None))

    knobs = request_knobs(req, config)
    if isinstance(knobs, RequestKnobError):
        # The tokenizer already answers these with a 400 (patches/sampling_params.py); a
        # request that reached the scheduler another way still runs dense, saying why.
        return dense(f"invalid per-request parameter: {knobs}")
    top_p, keep_ratio, policy = knobs.top_p, knobs.keep_ratio, knobs.prefix_policy
    if not knobs.enabled:
        restore = cached_len > 0 and policy in RESTORES_DENSE and no_schedule is None
        return dataclasses.replace(dense("disabled by the request"), restore_prefix=restore)
    if no_schedule is not None:
        return dense(no_schedule)
    if batch_reason is not None:
        return dense(batch_reason)
    if getattr(req, "multimodal_inputs", None) is not None:
        return dense("multimodal input")
    if policy in CACHES_DENSE and _max_new_tokens(req) == 0:
        # SGLang's frontend caches a fork's shared prefix so; the requests after it ask.
        return dense("generates nothing: a prefix being cached runs dense")
    fill = getattr(req, "full_untruncated_fill_ids", None)
    rng = versions.extend_range(req)
    prompt_len = len(fill) if fill is not None else extend_len
    if fill is not None and rng is not None and rng[1] < len(fill):
        # Earlier chunks cannot see the prompt's last queries: they stop at the first drop
        # layer and the final chunk scores their tokens together with its own.
        if prompt_len - cached_len < config.min_tokens_to_drop:
            return dataclasses.replace(dense("prompt under the minimum length"),
                                       final_chunk=False)
        return RequestDecision(False, top_p, keep_ratio or (),
                               "non-final chunk, parked at the first drop layer",
                               park=True, rid=req.rid, prompt_len=prompt_len,
                               prefix_policy=policy, cached_len=cached_len, final_chunk=False)
    # The cost rule counts what the step computes: its new tokens and the rows its earlier
    # chunks parked, which rejoin here; a cached prefix only where it may rejoin (re-selection).
    may_reselect = cached_len > 0 and policy in RESTORES_DENSE and config.prefix_checkpoint
    start = rng[0] if rng is not None else 0
    tokens = extend_len + max(0, start - (0 if may_reselect else cached_len))
    if tokens < config.min_tokens_to_drop:
        return dense("prompt under the minimum length")
    return RequestDecision(True, top_p, keep_ratio or (), None,
                           rid=getattr(req, "rid", None), prompt_len=prompt_len,
                           prefix_policy=policy, cached_len=cached_len,
                           max_dropped_mass=knobs.max_dropped_mass)


def _max_new_tokens(req) -> Optional[int]:
    sp = getattr(req, "sampling_params", None)
    return getattr(sp, "max_new_tokens", None) if sp is not None else None


def _is_radix_tree(tree_cache, hooked_trees: tuple) -> bool:
    """Only a tree of `hooked_trees` (the classes patches/radix_cache.py hooks) holds prefixes
    UniPrefill re-selects."""
    return type(tree_cache) in hooked_trees and not tree_cache.disable


def _cached_len(req, radix: bool) -> int:
    """Leading tokens the radix tree holds (and locks) for this request."""
    return versions.cache_protected_len(req) if radix else 0


def _asks_input_logprobs(batch, extend_lens: list) -> bool:
    """Does a request of this step want log-probabilities of its prompt tokens? SGLang then
    gathers hidden states at every such token's original row. Output logprobs alone (OpenAI's
    `logprobs`, SGLang's `return_logprob` with the default start) come from each request's last
    row, which every drop keeps; SGLang's logits processor takes its last-row path for them."""
    if not getattr(batch, "return_logprob", False):
        return False
    starts = getattr(batch, "extend_logprob_start_lens", None)
    if starts is None or len(starts) < len(extend_lens):
        return True  # not known: assume the worst
    return any(start < n for start, n in zip(starts, extend_lens))


def plan_batch(batch, config: UniPrefillConfig, no_schedule: Optional[str],
               hooked_trees: tuple) -> BatchPlan:
    """Decisions for every request of an extend/mixed ScheduleBatch, in batch order;
    `hooked_trees`: the prefix cache classes the plugin hooks (only theirs are reused)."""
    reqs = batch.reqs
    extend_lens = list(batch.extend_lens or [])
    decoding = set(id(r) for r in (getattr(batch, "decoding_reqs", None) or []))
    batch_reason = None
    if _asks_input_logprobs(batch, extend_lens):
        # Input logprobs need every position's hidden state, for the whole batch.
        batch_reason = "input logprobs requested in the batch"
    radix = _is_radix_tree(getattr(batch, "tree_cache", None), hooked_trees)
    decisions = []
    for i, req in enumerate(reqs):
        if id(req) in decoding or i >= len(extend_lens):
            decisions.append(RequestDecision(False, config.top_p, (), "decode"))
            continue
        d = decide(req, extend_lens[i], config, no_schedule, batch_reason,
                   _cached_len(req, radix))
        if d.reason is not None and not d.park:
            log_fallback_once(d.reason)
        decisions.append(_with_block_sparse(d, req, config))
    return BatchPlan(decisions)


def _with_block_sparse(d: RequestDecision, req, config: UniPrefillConfig) -> RequestDecision:
    """The request's block-sparse rule; none where it asked to run dense or sent a bad knob
    (its decision says so)."""
    knobs = request_knobs(req, config)
    if isinstance(knobs, RequestKnobError):
        return d
    return dataclasses.replace(d, block_sparse=knobs.block_sparse if knobs.enabled else None)
