"""UniPrefill's Prometheus outcome per request (uniprefill_sglang/metrics.py), without a server.

The counting on a live server's /metrics is in test_http_server.py.
"""

from uniprefill_sglang.metrics import DENSE, DROPPED, NO_PREFILL, reason_label, request_outcome


def _entry(enabled, reason, kept):
    return {"enabled": enabled, "reason": reason, "kept_tokens": kept}


def test_the_last_prefill_forward_decides_and_decode_rows_are_skipped():
    entries = [
        _entry(False, "non-final chunk, parked at the first drop layer", [512]),
        _entry(True, None, [1024, 700, 400]),
        _entry(False, "decode", []),
        _entry(False, "decode", []),
    ]
    outcome, reason, fraction = request_outcome(entries)
    assert (outcome, reason) == (DROPPED, "") and fraction == 400 / 1024


def test_dense_reasons_and_requests_without_prefill():
    assert request_outcome([_entry(False, "disabled by the request", [])]) == (
        DENSE, "disabled by the request", None)
    assert request_outcome([_entry(False, "prompt under the minimum length", [20]),
                            _entry(False, "decode", [])]) == (
        DENSE, "prompt under the minimum length", None)
    assert request_outcome(None) == (NO_PREFILL, "", None)
    assert request_outcome([_entry(False, "decode", [])]) == (NO_PREFILL, "", None)


def test_reason_labels_stay_bounded():
    # Per-request detail after the colon never becomes a label value.
    assert reason_label("invalid per-request parameter: custom_params[...] got 7") == (
        "invalid per-request parameter")
    assert reason_label("unsupported architecture Gemma3ForCausalLM (sliding-window hybrid): "
                        "no UniPrefill integration") == (
        "unsupported architecture Gemma3ForCausalLM (sliding-window hybrid)")
    assert reason_label(None) == "" and len(reason_label("x" * 500)) == 120
    # A drop that kept every block is still a drop, with a kept fraction of 1.
    assert request_outcome([_entry(True, None, [600, 600])]) == (DROPPED, "", 1.0)


def test_a_request_held_to_every_token_counts_as_dense():
    """The dropped-mass bound keeps every token of a request it holds (drop.py notes why)."""
    held = _entry(True, "over the dropped-mass bound: the first drop would let go 0.08 of the "
                        "mass, over --uniprefill-max-dropped-mass 0", [900, 900, 900])
    assert request_outcome([held]) == (DENSE, "over the dropped-mass bound", None)
    # A note on a request that still dropped (e.g. a later drop that kept more) stays a drop.
    noted = _entry(True, "too few tokens to score at a later drop", [900, 500, 500])
    assert request_outcome([noted]) == (DROPPED, "", 500 / 900)
