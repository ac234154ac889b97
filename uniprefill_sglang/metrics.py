"""Prometheus metrics of what UniPrefill did to live traffic (`--enable-metrics`).

Counted once per finished request, in the process that serves `/metrics` (the tokenizer manager;
patches/metrics.py), from the same per-forward entries the client reads in
`meta_info["uniprefill"]` (patches/logits.py builds them). SGLang runs Prometheus in
multiprocess mode (`PROMETHEUS_MULTIPROC_DIR`, set by the launcher before any process imports
`prometheus_client`), so these metrics appear next to SGLang's own on `/metrics`:

* ``sglang:uniprefill_requests_total{outcome, reason}``: ``outcome`` is ``dropped`` (the request's
  last prefill forward ran the drop schedule; it may still have kept every block, see the
  histogram), ``dense`` (``reason`` says why: the request switched it off, the prompt was under
  the minimum length, logprobs in the batch, no drop layers, a first drop over the
  dropped-mass bound, which keeps every token, ...) or ``no_prefill`` (finished, typically
  aborted, before its prefill ran).
* ``sglang:uniprefill_kept_fraction``: histogram of the fraction of the prefill's tokens still
  kept after the last drop (last stage's kept tokens over the first stage's), for ``dropped``.

Each scheduler rank also keeps `RuntimeStats`, counters of its forwards, which the scheduler's
internal state reports (patches/scheduler.py).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

DROPPED, DENSE, NO_PREFILL = "dropped", "dense", "no_prefill"
KEPT_FRACTION_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
REQUESTS_METRIC = "sglang:uniprefill_requests"  # exposed as ..._total
KEPT_FRACTION_METRIC = "sglang:uniprefill_kept_fraction"


def reason_label(reason: Optional[str]) -> str:
    """A bounded label value: the reason up to its first colon (details are per request)."""
    return (reason or "").split(":", 1)[0].strip()[:120]


def request_outcome(entries: Optional[Iterable[dict]]) -> tuple[str, str, Optional[float]]:
    """(outcome, reason, kept fraction after the last drop) of one request's meta_info entries.

    The request's last prefill forward decides (a chunked prompt's final chunk); entries of
    forwards where the request was a decode row beside another prefill are skipped.
    """
    prefill = [e for e in (entries or []) if e.get("reason") != "decode"]
    if not prefill:
        return NO_PREFILL, "", None
    last = prefill[-1]
    if not last.get("enabled"):
        return DENSE, reason_label(last.get("reason")), None
    kept = last.get("kept_tokens") or []
    if last.get("reason") and kept and min(kept) == kept[0]:
        # Held to every token, saying why (e.g. over the dropped-mass bound): it ran dense.
        return DENSE, reason_label(last["reason"]), None
    fraction = kept[-1] / kept[0] if kept and kept[0] > 0 else None
    return DROPPED, "", fraction


class UniPrefillMetrics:
    """The counter and the histogram; create after PROMETHEUS_MULTIPROC_DIR is set."""

    def __init__(self, labels: dict):
        from prometheus_client import Counter, Histogram

        self.labels = dict(labels)
        names = list(self.labels)
        self.requests = Counter(
            name=REQUESTS_METRIC,
            documentation="Finished requests by UniPrefill outcome (dropped; dense, by reason).",
            labelnames=names + ["outcome", "reason"],
        )
        self.kept_fraction = Histogram(
            name=KEPT_FRACTION_METRIC,
            documentation="Fraction of a request's prefill tokens kept after the last drop.",
            labelnames=names,
            buckets=KEPT_FRACTION_BUCKETS,
        )

    def observe(self, entries: Optional[Iterable[dict]]) -> tuple[str, str, Optional[float]]:
        outcome, reason, fraction = request_outcome(entries)
        self.requests.labels(**self.labels, outcome=outcome, reason=reason).inc()
        if fraction is not None:
            self.kept_fraction.labels(**self.labels).observe(fraction)
        return outcome, reason, fraction


@dataclasses.dataclass
class RuntimeStats:
    """What the forwards so far did, as the scheduler's internal state reports it
    (patches/scheduler.py), each counter named as it is reported there."""
    # Prefill forwards that carried decode rows.
    mixed_forwards: int = 0
    # MLP and linear-attention mixer calls run in pieces (model_integration.py).
    pieced_mlp_calls: int = 0
    pieced_mixer_calls: int = 0
    # Prompt tokens that reached a drop with UniPrefill on, and how many were left after the
    # last drop.
    scored_tokens: int = 0
    kept_tokens: int = 0
    # Attention-view buffers an adapter made in a request's path after start-up made them.
    views_allocated_late: int = 0
    # Decode steps run eagerly because a batch's per-stage lists outgrew the decode graph's
    # (patches/cuda_graphs.py).
    eager_decode_overflows: int = 0
    # The latest rejoin (parking.rejoin_record).
    last_rejoin: Optional[dict] = None
