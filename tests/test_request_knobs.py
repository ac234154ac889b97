"""Per-request knobs (uniprefill_sglang/request_knobs.py), without an engine.

The HTTP answers to the same bad values (400 naming the knob) are in test_http_server.py.
"""

from __future__ import annotations

import math

import pytest

from uniprefill_sglang.config import DEFAULT_TOP_P, build_config
from uniprefill_sglang.request_knobs import (
    KNOBS,
    RequestKnobError,
    RequestKnobs,
    parse_request_knobs,
)

FLAGS = dict(top_p=None, keep_ratio=None, block_size=64, sink_tokens=128, last_queries=128,
             drop_layers=None, min_prompt_tokens=0)
TOP_P_SERVER = build_config(**FLAGS)
KEEP_SERVER = build_config(**{**FLAGS, "keep_ratio": "0.3,0.6"})

# (custom_params, the knob the message must name, a fragment of the reason)
BAD = [
    ({"uniprefill_top_p": 2}, "uniprefill_top_p", "in (0, 1], got 2.0"),
    ({"uniprefill_top_p": -1}, "uniprefill_top_p", "in (0, 1], got -1.0"),
    ({"uniprefill_top_p": 0}, "uniprefill_top_p", "in (0, 1], got 0.0"),
    ({"uniprefill_top_p": "abc"}, "uniprefill_top_p", "comma-separated"),
    ({"uniprefill_top_p": "0.99,1.5"}, "uniprefill_top_p", "[1] must be in (0, 1]"),
    ({"uniprefill_top_p": None}, "uniprefill_top_p", "null"),
    ({"uniprefill_top_p": True}, "uniprefill_top_p", "got true"),
    ({"uniprefill_top_p": [0.5, "x"]}, "uniprefill_top_p", "[1] must be a number"),
    ({"uniprefill_top_p": []}, "uniprefill_top_p", "non-empty"),
    ({"uniprefill_top_p": math.nan}, "uniprefill_top_p", "got nan"),
    ({"uniprefill_top_p": math.inf}, "uniprefill_top_p", "got inf"),
    ({"uniprefill_keep_ratio": [0.5, 0]}, "uniprefill_keep_ratio", "[1] must be in (0, 1]"),
    ({"uniprefill_keep_ratio": [1.5]}, "uniprefill_keep_ratio", "[0] must be in (0, 1]"),
    ({"uniprefill_keep_ratio": 0}, "uniprefill_keep_ratio", "in (0, 1], got 0.0"),
    ({"uniprefill_keep_ratio": 1.5}, "uniprefill_keep_ratio", "in (0, 1], got 1.5"),
    ({"uniprefill_keep_ratio": []}, "uniprefill_keep_ratio", "non-empty"),
    ({"uniprefill_keep_ratio": "0.5,abc"}, "uniprefill_keep_ratio", "comma-separated"),
    ({"uniprefill_keep_ratio": "0.5,nan"}, "uniprefill_keep_ratio", "[1] must be in (0, 1]"),
    ({"uniprefill_keep_ratio": None}, "uniprefill_keep_ratio", "null"),
    ({"uniprefill_keep_ratio": [0.5, None]}, "uniprefill_keep_ratio", "[1] must be a number"),
    ({"uniprefill_keep_ratio": {"a": 0.5}}, "uniprefill_keep_ratio", "must be a number"),
    ({"uniprefill": "yes"}, "uniprefill", "true or false, got 'yes'"),
    ({"uniprefill": 1}, "uniprefill", "true or false, got 1"),
    ({"uniprefill": None}, "uniprefill", "null"),
    ({"uniprefill_topp": 0.5}, "uniprefill_topp", "unknown UniPrefill knob"),
    ({"UniPrefill_Top_P": 0.5}, "UniPrefill_Top_P", "unknown UniPrefill knob"),
    ({"uniprefill-top-p": 0.5}, "uniprefill-top-p", "unknown UniPrefill knob"),
    ({"uniprefill_top_p": 0.5, "uniprefill_keep_ratio": 0.5}, "uniprefill_keep_ratio",
     "mutually exclusive"),
    ({"uniprefill_prefix_policy": "reuse"}, "uniprefill_prefix_policy", "got 'reuse'"),
    ({"uniprefill_prefix_policy": None}, "uniprefill_prefix_policy", "null"),
    ({"uniprefill_prefix_policy": 1}, "uniprefill_prefix_policy", "must be one of verify"),
    ({"uniprefill_max_dropped_mass": 1.5}, "uniprefill_max_dropped_mass", "in [0, 1], got 1.5"),
    ({"uniprefill_max_dropped_mass": -0.1}, "uniprefill_max_dropped_mass", "in [0, 1], got -0.1"),
    ({"uniprefill_max_dropped_mass": math.nan}, "uniprefill_max_dropped_mass", "got nan"),
    ({"uniprefill_max_dropped_mass": None}, "uniprefill_max_dropped_mass", "null"),
    ({"uniprefill_max_dropped_mass": False}, "uniprefill_max_dropped_mass", "got false"),
    ({"uniprefill_max_dropped_mass": "0.1"}, "uniprefill_max_dropped_mass", "must be a number"),
    ({"uniprefill_block_sparse_density": 0}, "uniprefill_block_sparse_density",
     "in (0, 1], got 0.0"),
    ({"uniprefill_block_sparse_density": 1.5}, "uniprefill_block_sparse_density",
     "in (0, 1], got 1.5"),
    ({"uniprefill_block_sparse_density": "0.3"}, "uniprefill_block_sparse_density",
     "must be a number in (0, 1], got '0.3'"),
    ({"uniprefill_block_sparse_density": None}, "uniprefill_block_sparse_density", "null"),
    ({"uniprefill_block_sparse_top_p": True}, "uniprefill_block_sparse_top_p", "got true"),
    ({"uniprefill_block_sparse_top_p": math.nan}, "uniprefill_block_sparse_top_p", "got nan"),
    ({"uniprefill_block_sparse_top_p": 0.9, "uniprefill_block_sparse_density": 0.3},
     "uniprefill_block_sparse_top_p", "mutually exclusive"),
    ({"uniprefill_block_sparse_top_p": 0.9, "uniprefill_block_sparse_estimate": "mean"},
     "uniprefill_block_sparse_estimate", "must be one of pooled, last_queries, both, got 'mean'"),
    ({"uniprefill_block_sparse_top_p": 0.9, "uniprefill_block_sparse_estimate": None},
     "uniprefill_block_sparse_estimate", "null"),
    ({"uniprefill_block_sparse_top_p": 0.9, "uniprefill_block_sparse_estimate": 1},
     "uniprefill_block_sparse_estimate", "got 1"),
    ({"uniprefill_block_sparse_estimate": "last_queries"}, "uniprefill_block_sparse_estimate",
     "needs a block-sparse rule"),
]


@pytest.mark.parametrize("params, knob, reason", BAD, ids=[repr(b[0]) for b in BAD])
def test_bad_knobs_raise_a_value_error_naming_the_knob(params, knob, reason):
    with pytest.raises(ValueError) as info:
        parse_request_knobs(params, TOP_P_SERVER)
    assert isinstance(info.value, RequestKnobError)
    message = str(info.value)
    assert f'custom_params["{knob}"]' in message, message
    assert reason in message, message


def test_server_defaults_without_knobs():
    for params in (None, {}, {"__req__": object(), "thinking_budget": 5}, "not a dict"):
        assert parse_request_knobs(params, TOP_P_SERVER) == RequestKnobs(True, (DEFAULT_TOP_P,),
                                                                         ())
        assert parse_request_knobs(params, KEEP_SERVER) == RequestKnobs(True, (DEFAULT_TOP_P,),
                                                                        (0.3, 0.6))


def test_good_knobs():
    parse = parse_request_knobs
    assert parse({"uniprefill": False}, TOP_P_SERVER) == RequestKnobs(False, (DEFAULT_TOP_P,), ())
    assert parse({"uniprefill": True}, KEEP_SERVER).keep_ratio == (0.3, 0.6)
    # A per-request top-p replaces a server keep ratio, and the other way round.
    assert parse({"uniprefill_top_p": 0.9}, KEEP_SERVER) == RequestKnobs(True, (0.9,), ())
    assert parse({"uniprefill_top_p": 1}, TOP_P_SERVER) == RequestKnobs(True, (1.0,), ())
    # One top-p per drop layer, as a list or a comma-separated string (the last repeats).
    assert parse({"uniprefill_top_p": [0.995, 0.9]}, TOP_P_SERVER).top_p == (0.995, 0.9)
    assert parse({"uniprefill_top_p": "0.995,0.9"}, KEEP_SERVER).top_p == (0.995, 0.9)
    assert parse({"uniprefill_keep_ratio": 0.5}, TOP_P_SERVER).keep_ratio == (0.5,)
    assert parse({"uniprefill_keep_ratio": [0.2, 1]}, TOP_P_SERVER).keep_ratio == (0.2, 1.0)
    assert parse({"uniprefill_keep_ratio": "0.2, 0.4"}, TOP_P_SERVER).keep_ratio == (0.2, 0.4)
    # Keys of other plugins pass untouched next to ours.
    assert parse({"uniprefill_top_p": 0.8, "my_plugin_knob": "x"}, TOP_P_SERVER).top_p == (0.8,)
    assert parse({}, TOP_P_SERVER).prefix_policy == "verify"
    assert parse({"uniprefill_prefix_policy": "reselect"}, TOP_P_SERVER).prefix_policy == "reselect"
    server = build_config(**{**FLAGS, "prefix_policy": "reuse-sparse"})
    assert parse({"uniprefill_top_p": 0.9}, server).prefix_policy == "reuse-sparse"
    with pytest.raises(ValueError, match="--uniprefill-prefix-policy"):
        build_config(**{**FLAGS, "prefix_policy": "sometimes"})
    # The dropped-mass bound: the server's unless the request sets its own, 0 and 1 included.
    assert parse({}, TOP_P_SERVER).max_dropped_mass is None
    bounded = build_config(**{**FLAGS, "max_dropped_mass": 0.05})
    assert parse({}, bounded).max_dropped_mass == 0.05
    assert parse({"uniprefill_max_dropped_mass": 0}, bounded).max_dropped_mass == 0.0
    assert parse({"uniprefill_max_dropped_mass": 1}, TOP_P_SERVER).max_dropped_mass == 1.0
    # The flag's bound holds whatever the request selects by; a profile's only with the
    # profile's top-p it was calibrated with.
    assert parse({"uniprefill_keep_ratio": 0.3}, bounded).max_dropped_mass == 0.05
    from dataclasses import replace

    profiled = replace(bounded, bound_from_profile=True)
    assert parse({}, profiled).max_dropped_mass == 0.05
    assert parse({"uniprefill_keep_ratio": 0.3}, profiled).max_dropped_mass is None
    assert parse({"uniprefill_top_p": 0.9}, profiled).max_dropped_mass is None
    assert parse({"uniprefill_top_p": 0.9, "uniprefill_max_dropped_mass": 0.1},
                 profiled).max_dropped_mass == 0.1
    # Block-sparse attention: the server's rule unless the request sets one of its own.
    assert parse({}, TOP_P_SERVER).block_sparse is None
    assert parse({"uniprefill_block_sparse_density": 0.3}, TOP_P_SERVER).block_sparse == (
        "density", 0.3, "pooled", 128)
    sparse_server = build_config(**{**FLAGS, "block_sparse_density": 0.5})
    assert parse({}, sparse_server).block_sparse == ("density", 0.5, "pooled", 128)
    assert parse({"uniprefill_block_sparse_top_p": 1}, sparse_server).block_sparse == (
        "top_p", 1.0, "pooled", 128)
    # The estimate: the server's unless the request names one; the last queries are the drop's
    # --uniprefill-last-queries.
    assert parse({"uniprefill_block_sparse_top_p": 0.9,
                  "uniprefill_block_sparse_estimate": "last_queries"},
                 TOP_P_SERVER).block_sparse == ("top_p", 0.9, "last_queries", 128)
    assert parse({"uniprefill_block_sparse_estimate": "both"}, sparse_server).block_sparse == (
        "density", 0.5, "both", 128)
    estimating = build_config(**{**FLAGS, "block_sparse_top_p": 0.9, "last_queries": 64,
                                 "block_sparse_estimate": "last_queries"})
    assert parse({}, estimating).block_sparse == ("top_p", 0.9, "last_queries", 64)
    assert parse({"uniprefill_block_sparse_density": 0.2}, estimating).block_sparse == (
        "density", 0.2, "last_queries", 64)
    assert parse({"uniprefill_block_sparse_estimate": "pooled"}, estimating).block_sparse == (
        "top_p", 0.9, "pooled", 64)
    assert parse({"uniprefill": False, "uniprefill_block_sparse_top_p": 0.9,
                  "uniprefill_block_sparse_estimate": "both"}, TOP_P_SERVER).enabled is False
    assert KNOBS == ("uniprefill", "uniprefill_top_p", "uniprefill_keep_ratio",
                     "uniprefill_prefix_policy", "uniprefill_max_dropped_mass",
                     "uniprefill_block_sparse_density", "uniprefill_block_sparse_top_p",
                     "uniprefill_block_sparse_estimate")


# One-per-drop forms: the start-up flags and the per-request knobs share one parser, so a value
# a client may send is one an operator may start the server with, and the other way round.
FORMS = [0.5, 1, "0.9", "0.995, 0.9", [0.3, 0.6], (1.0,), "", [], True, "0.9,nan", [0.5, 2],
         "abc", math.inf, -0.1, [0.5, "0.4"]]


@pytest.mark.parametrize("value", FORMS, ids=[repr(v) for v in FORMS])
def test_flags_and_knobs_accept_the_same_per_drop_forms(value):
    def outcome(parse):
        try:
            return parse()
        except ValueError as error:
            # the reason, without the value's rendering (JSON for a request, Python for a flag)
            return type(error).__name__, str(error).split(" must ")[1].split(", got")[0]

    flag = outcome(lambda: build_config(**{**FLAGS, "top_p": value}).top_p)
    knob = outcome(lambda: parse_request_knobs({"uniprefill_top_p": value}, TOP_P_SERVER).top_p)
    if flag and flag[0] == "UniPrefillConfigError":
        assert knob == ("RequestKnobError", flag[1])
    else:
        assert flag == knob and all(0 < f <= 1 for f in flag)


class _Req:
    def __init__(self, custom_params):
        self.sampling_params = type("SP", (), {"custom_params": custom_params})()
        self.rid = "r"


def test_the_scheduler_parses_a_requests_knobs_once():
    """Every plan of a request (each chunk, each step) reads the knobs its first plan parsed,
    kept on the Req; a bad knob is kept as its error and runs the request dense."""
    from uniprefill_sglang.request_plan import decide

    req = _Req({"uniprefill_top_p": 0.9})
    assert decide(req, 4096, TOP_P_SERVER, None, None).top_p == (0.9,)
    assert req.uniprefill_knobs == RequestKnobs(True, (0.9,), ())
    req.sampling_params.custom_params = {"uniprefill_top_p": 0.5}  # not read again
    assert decide(req, 4096, TOP_P_SERVER, None, None).top_p == (0.9,)
    bad = _Req({"uniprefill_top_p": 2})
    assert "uniprefill_top_p" in decide(bad, 4096, TOP_P_SERVER, None, None).reason
    assert isinstance(bad.uniprefill_knobs, RequestKnobError)
