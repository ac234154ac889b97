"""Per-request UniPrefill knobs: one parser, used where SGLang validates sampling parameters
(patches/sampling_params.py: a bad knob is an HTTP 400 naming it, the parse itself is not
kept) and, once per request, on the scheduler side (request_plan.request_knobs keeps it on the
`Req` as `req.uniprefill_knobs`, which every plan of the request reads).

Clients set the knobs in ``sampling_params["custom_params"]`` (``/generate``) or in the request
body's ``custom_params`` (OpenAI API; the Python client: ``extra_body={"custom_params": {...}}``):

* ``uniprefill``: ``true``/``false``; ``false`` runs the request dense.
* ``uniprefill_top_p``: keep blocks holding this much attention mass: a number in (0, 1], a
  non-empty list of them (one per drop layer, the last repeats) or a comma-separated string of
  them (as ``--uniprefill-top-p``).
* ``uniprefill_keep_ratio``: a fixed fraction of the blocks instead, in the same forms (as
  ``--uniprefill-keep-ratio``).
* ``uniprefill_prefix_policy``: one of ``verify``, ``reselect``, ``reuse-sparse``,
  ``dense-prefix`` (as ``--uniprefill-prefix-policy``; prefix_reuse.py).
* ``uniprefill_max_dropped_mass``: a number in [0, 1] (as ``--uniprefill-max-dropped-mass``): a
  first drop that would let go more of the request's attention mass keeps every token instead.
* ``uniprefill_block_sparse_density`` / ``uniprefill_block_sparse_top_p``: a number in (0, 1]
  (as ``--uniprefill-block-sparse-density`` / ``--uniprefill-block-sparse-top-p``): block-sparse
  prefill attention for this request, replacing the server's rule (the two together are
  refused); where the prefill backend has no block-sparse path the request attends densely and
  ``meta_info`` says why.
* ``uniprefill_block_sparse_estimate``: one of ``pooled``, ``last_queries``, ``both`` (as
  ``--uniprefill-block-sparse-estimate``): what scores the key blocks of the block-sparse rule
  in effect (the request's or the server's); refused where no rule is in effect, since it
  would change nothing.

Rules, all enforced with a ``ValueError`` that names the knob:

* ``null`` is not a value of any knob. To get the server default, leave the key out: a client
  that sends ``null`` may mean "off" as well as "default", and we do not guess.
* Booleans are not numbers (``true`` is not a top-p of 1), and a number is not a boolean.
* NaN and infinities are out of range.
* ``uniprefill_top_p`` and ``uniprefill_keep_ratio`` together are refused, as their flags are at
  start-up. Either one given alone replaces the server's selection rule for that request (a
  per-request top-p overrides a server ``--uniprefill-keep-ratio`` and the other way round).
* A key that starts with ``uniprefill`` (any case, ``_`` or ``-``) but is none of the above is
  refused, so a typo (``uniprefill_topp``) is not silently served with the defaults. Keys that
  are not ours (other plugins', SGLang's own ``__req__``) are left alone.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from uniprefill_sglang.config import (BLOCK_SPARSE_ESTIMATES, DEFAULT_PREFIX_POLICY,
                                      PREFIX_POLICIES, UniPrefillConfig, fractions_per_drop,
                                      is_number)

ENABLE = "uniprefill"
TOP_P = "uniprefill_top_p"
KEEP_RATIO = "uniprefill_keep_ratio"
PREFIX_POLICY = "uniprefill_prefix_policy"
MAX_DROPPED_MASS = "uniprefill_max_dropped_mass"
BLOCK_SPARSE_DENSITY = "uniprefill_block_sparse_density"
BLOCK_SPARSE_TOP_P = "uniprefill_block_sparse_top_p"
BLOCK_SPARSE_ESTIMATE = "uniprefill_block_sparse_estimate"
KNOBS = (ENABLE, TOP_P, KEEP_RATIO, PREFIX_POLICY, MAX_DROPPED_MASS, BLOCK_SPARSE_DENSITY,
         BLOCK_SPARSE_TOP_P, BLOCK_SPARSE_ESTIMATE)


class RequestKnobError(ValueError):
    """A per-request knob with a wrong type or out of range; the message names the knob."""


@dataclasses.dataclass(frozen=True)
class RequestKnobs:
    enabled: bool  # False: the request asked to run dense
    top_p: tuple  # one per drop (the last repeats)
    keep_ratio: tuple  # one fraction per drop (the last repeats); empty: select by top-p
    prefix_policy: str = DEFAULT_PREFIX_POLICY
    max_dropped_mass: Optional[float] = None  # None: no bound
    # Block-sparse attention: ("density" or "top_p", value, estimate, last queries), or None
    # (dense attention).
    block_sparse: Optional[tuple] = None


def _name(key: str) -> str:
    return f'custom_params["{key}"]'


def _bound(key: str, value: Any) -> float:
    if not is_number(value):
        raise RequestKnobError(f"{_name(key)} must be a number in [0, 1], got {_show(value)}")
    value = float(value)
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise RequestKnobError(f"{_name(key)} must be in [0, 1], got {_show(value)}")
    return value


def _fraction(key: str, value: Any) -> float:
    """A number in (0, 1]."""
    if not is_number(value):
        raise RequestKnobError(f"{_name(key)} must be a number in (0, 1], got {_show(value)}")
    value = float(value)
    if not (math.isfinite(value) and 0.0 < value <= 1.0):
        raise RequestKnobError(f"{_name(key)} must be in (0, 1], got {_show(value)}")
    return value


def _block_sparse_rule(custom_params: dict, config: UniPrefillConfig) -> Optional[tuple]:
    """("density" or "top_p", value, estimate, last queries) from the knobs, else the server's
    flags; None: off."""
    if BLOCK_SPARSE_DENSITY in custom_params and BLOCK_SPARSE_TOP_P in custom_params:
        raise RequestKnobError(
            f"{_name(BLOCK_SPARSE_DENSITY)} and {_name(BLOCK_SPARSE_TOP_P)} are mutually "
            "exclusive: set at most one")
    estimate = config.block_sparse_estimate
    if BLOCK_SPARSE_ESTIMATE in custom_params:
        estimate = custom_params[BLOCK_SPARSE_ESTIMATE]
        if not isinstance(estimate, str) or estimate not in BLOCK_SPARSE_ESTIMATES:
            raise RequestKnobError(
                f"{_name(BLOCK_SPARSE_ESTIMATE)} must be one of "
                f"{', '.join(BLOCK_SPARSE_ESTIMATES)}, got {_show(estimate)}")
    if BLOCK_SPARSE_DENSITY in custom_params:
        rule = "density", _fraction(BLOCK_SPARSE_DENSITY, custom_params[BLOCK_SPARSE_DENSITY])
    elif BLOCK_SPARSE_TOP_P in custom_params:
        rule = "top_p", _fraction(BLOCK_SPARSE_TOP_P, custom_params[BLOCK_SPARSE_TOP_P])
    else:
        rule = _server_selection(config)
        if rule is None and BLOCK_SPARSE_ESTIMATE in custom_params:
            raise RequestKnobError(
                f"{_name(BLOCK_SPARSE_ESTIMATE)} needs a block-sparse rule: set "
                f"{_name(BLOCK_SPARSE_TOP_P)} or {_name(BLOCK_SPARSE_DENSITY)} too (this server "
                "attends densely by default)")
        if rule is None:
            return None
    return rule + (estimate, config.last_queries)


def _server_selection(config: UniPrefillConfig) -> Optional[tuple]:
    """The flags' ("density" or "top_p", value), or None."""
    if config.block_sparse_density is not None:
        return "density", config.block_sparse_density
    if config.block_sparse_top_p is not None:
        return "top_p", config.block_sparse_top_p
    return None


def server_block_sparse_rule(config: UniPrefillConfig) -> Optional[tuple]:
    """The flags' rule: ("density" or "top_p", value, estimate, last queries), or None."""
    rule = _server_selection(config)
    return None if rule is None else rule + (config.block_sparse_estimate, config.last_queries)


def _show(value: Any) -> str:
    if value is None:
        return "null (leave the key out for the server default)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value)
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _per_drop(knob: str, value: Any) -> tuple:
    """A fraction, or one per drop layer (a list or a comma-separated string; the last
    repeats)."""
    return fractions_per_drop(value, _name(knob), RequestKnobError, _show)


def _is_ours(key: Any) -> bool:
    return isinstance(key, str) and key.lower().replace("-", "_").startswith(ENABLE)


def parse_request_knobs(custom_params: Optional[dict], config: UniPrefillConfig) -> RequestKnobs:
    """The request's knobs, from its ``custom_params`` and the server's config.

    Raises ``RequestKnobError`` (a ``ValueError``) naming the first bad knob.
    """
    top_p, keep_ratio = config.top_p, tuple(config.keep_ratio or ())
    policy, bound = config.prefix_policy, config.max_dropped_mass
    if not isinstance(custom_params, dict):
        return RequestKnobs(True, top_p, keep_ratio, policy, bound,
                            server_block_sparse_rule(config))
    unknown = sorted(k for k in custom_params if _is_ours(k) and k not in KNOBS)
    if unknown:
        raise RequestKnobError(
            f"unknown UniPrefill knob {_name(unknown[0])}; the per-request knobs are "
            f"{', '.join(KNOBS)}")
    enabled = True
    if ENABLE in custom_params:
        enabled = custom_params[ENABLE]
        if not isinstance(enabled, bool):
            raise RequestKnobError(
                f"{_name(ENABLE)} must be true or false, got {_show(enabled)}")
    if TOP_P in custom_params and KEEP_RATIO in custom_params:
        raise RequestKnobError(
            f"{_name(TOP_P)} and {_name(KEEP_RATIO)} are mutually exclusive: set at most one "
            "(top-p selects by attention mass, keep-ratio by a fixed budget)")
    if TOP_P in custom_params:
        top_p, keep_ratio = _per_drop(TOP_P, custom_params[TOP_P]), ()
    elif KEEP_RATIO in custom_params:
        keep_ratio = _per_drop(KEEP_RATIO, custom_params[KEEP_RATIO])
    if config.bound_from_profile and (TOP_P in custom_params or KEEP_RATIO in custom_params):
        bound = None  # calibrated with the profile's top-p, not with this selection
    if PREFIX_POLICY in custom_params:
        policy = custom_params[PREFIX_POLICY]
        if policy not in PREFIX_POLICIES:
            raise RequestKnobError(
                f"{_name(PREFIX_POLICY)} must be one of {', '.join(PREFIX_POLICIES)}, "
                f"got {_show(policy)}")
    if MAX_DROPPED_MASS in custom_params:
        bound = _bound(MAX_DROPPED_MASS, custom_params[MAX_DROPPED_MASS])
    return RequestKnobs(enabled, top_p, keep_ratio, policy, bound,
                        _block_sparse_rule(custom_params, config))
