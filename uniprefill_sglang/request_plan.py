"""Per-request UniPrefill decisions for one forward batch, and the dense-fallback log.

Built on the scheduler side from the batch's `Req` objects (they carry the sampling params and
the chunking state) and attached to the ForwardBatch; the model side only reads it.

Per-request overrides travel in `sampling_params["custom_params"]` (OpenAI API: `extra_body=
{"custom_params": {...}}`): `uniprefill` (bool), `uniprefill_top_p`, `uniprefill_keep_ratio`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import List, Optional

from uniprefill_sglang.config import UniPrefillConfig
from uniprefill_sglang.request_knobs import RequestKnobError, parse_request_knobs

logger = logging.getLogger(__name__)

_logged_reasons: set = set()

# Why requests run dense when the runtime has no drop schedule: "no drop layers" (the user said
# `--uniprefill-drop-layers none`) unless the model runner found an unsupported architecture.
NO_SCHEDULE_REASON = "no drop layers"
_no_schedule_reason = NO_SCHEDULE_REASON


def set_no_schedule_reason(reason: Optional[str]) -> None:
    """Set (None: reset) the reason reported for every request of a model without a schedule."""
    global _no_schedule_reason
    _no_schedule_reason = reason or NO_SCHEDULE_REASON


def log_fallback_once(reason: str) -> None:
    """Log each kind of dense fallback once per process."""
    if reason not in _logged_reasons:
        _logged_reasons.add(reason)
        logger.info("UniPrefill: running dense (%s); logged once per kind", reason)


@dataclasses.dataclass(frozen=True)
class RequestDecision:
    enabled: bool
    top_p: float
    keep_ratio: tuple  # one fraction per drop (the last repeats); empty: use top-p
    reason: Optional[str] = None  # why the request runs dense this step (the drop may add a
    # note, e.g. too few tokens to score: DropContext.note)
    # A non-final chunk whose rows stop at the first drop layer and wait there for the final
    # chunk (runtime.py decides whether the parked state fits).
    park: bool = False
    rid: Optional[str] = None
    prompt_len: int = 0  # tokens of the whole prompt (all chunks)

    def ratio_at(self, drop_index: int) -> float:
        """Keep ratio of the given drop, or 0.0 for top-p selection."""
        if not self.keep_ratio:
            return 0.0
        return self.keep_ratio[min(drop_index, len(self.keep_ratio) - 1)]


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    decisions: List[RequestDecision]

    def all_dense(self, reason: str) -> "BatchPlan":
        """The same batch with every request dense (a forward that failed runs again)."""
        return BatchPlan([dataclasses.replace(d, enabled=False, park=False,
                                              reason=d.reason if d.reason == "decode" else reason)
                          for d in self.decisions])

    @property
    def any_enabled(self) -> bool:
        """Does any request drop or park rows at the drop layers?"""
        return any(d.enabled or d.park for d in self.decisions)


def is_prefill_mode(mode) -> bool:
    """Plain prefill (EXTEND) or prefill mixed with 1-token decodes (MIXED); not spec-verify etc."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return mode == ForwardMode.EXTEND or mode == ForwardMode.MIXED


def _custom_params(req) -> dict:
    sp = getattr(req, "sampling_params", None)
    params = getattr(sp, "custom_params", None) if sp is not None else None
    return params if isinstance(params, dict) else {}


def decide(req, extend_len: int, config: UniPrefillConfig, has_schedule: bool,
           batch_reason: Optional[str]) -> RequestDecision:
    top_p, keep_ratio = config.top_p, config.keep_ratio

    def dense(reason: str) -> RequestDecision:
        return RequestDecision(False, top_p, keep_ratio or (), reason)

    try:
        knobs = parse_request_knobs(_custom_params(req), config)
    except RequestKnobError as e:
        # The tokenizer already answers these with a 400 (patches/sampling_params.py); a
        # request that reached the scheduler another way still runs dense, saying why.
        return dense(f"invalid per-request parameter: {e}")
    top_p, keep_ratio = knobs.top_p, knobs.keep_ratio
    if not knobs.enabled:
        return dense("disabled by the request")
    if not has_schedule:
        return dense(_no_schedule_reason)
    if batch_reason is not None:
        return dense(batch_reason)
    if getattr(req, "multimodal_inputs", None) is not None:
        return dense("multimodal input")
    fill = getattr(req, "full_untruncated_fill_ids", None)
    rng = getattr(req, "extend_range", None)
    prompt_len = len(fill) if fill is not None else extend_len
    if fill is not None and rng is not None and rng.end < len(fill):
        # Earlier chunks cannot see the prompt's last queries: they stop at the first drop
        # layer and the final chunk scores their tokens together with its own.
        if prompt_len < config.min_tokens_to_drop:
            return dense("prompt under the minimum length")
        return RequestDecision(False, top_p, keep_ratio or (),
                               "non-final chunk, parked at the first drop layer",
                               park=True, rid=req.rid, prompt_len=prompt_len)
    # A final chunk counts the earlier chunks' tokens too.
    tokens = rng.end if rng is not None and rng.start > 0 else extend_len
    if tokens < config.min_tokens_to_drop:
        return dense("prompt under the minimum length")
    return RequestDecision(True, top_p, keep_ratio or (), None,
                           rid=getattr(req, "rid", None), prompt_len=prompt_len)


def plan_batch(batch, config: UniPrefillConfig, has_schedule: bool) -> BatchPlan:
    """Decisions for every request of an extend/mixed ScheduleBatch, in batch order."""
    reqs = batch.reqs
    extend_lens = list(batch.extend_lens or [])
    decoding = set(id(r) for r in (getattr(batch, "decoding_reqs", None) or []))
    batch_reason = None
    if getattr(batch, "return_logprob", False):
        # Input logprobs need every position's hidden state, for the whole batch.
        batch_reason = "logprobs requested in the batch"
    decisions = []
    for i, req in enumerate(reqs):
        if id(req) in decoding or i >= len(extend_lens):
            decisions.append(RequestDecision(False, config.top_p, (), "decode"))
            continue
        d = decide(req, extend_lens[i], config, has_schedule, batch_reason)
        if d.reason is not None and not d.park:
            log_fallback_once(d.reason)
        decisions.append(d)
    return BatchPlan(decisions)
