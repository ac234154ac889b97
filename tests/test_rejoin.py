"""Parked rows rejoining at the final chunk, on the real SmolLM2 and SGLang's CPU engine.

Scaled down from a 128K prompt in 8K chunks: 256-token chunks, prompts of 1-1.4K tokens (four
to six chunks), drop layers 4 and 12. Bounded rejoin: the final chunk's MLPs and attention
sublayers run in pieces of at most a chunk while the earlier chunks' rows are in the step (the
second drop layer's too), and the kept positions equal the unchunked run's; at top-p 1.0 the
answer is dense's. Honest recovery: a fault after the
parked rows rejoined re-prefills the prompt dense (every later layer then holds every token,
read from the device slot map), and a fault that the dense re-run hits too fails the request
with an error instead of answering from incomplete KV.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from uniprefill_sglang.tools.cpu_engine import (flush_cache, idle_state, make_cpu_engine,
                                                 uniprefill_state)

pytestmark = pytest.mark.engine
os.environ["UNIPREFILL_CHECK_KV_LENS"] = "1"

CHUNK = 256
COMMON = dict(enable_uniprefill=True, uniprefill_drop_layers="4,12", context_length=2048,
              uniprefill_min_prompt_tokens=256)
CHUNKED = dict(chunked_prefill_size=CHUNK, max_prefill_tokens=CHUNK)
GREEDY = {"temperature": 0.0, "max_new_tokens": 6}


def _prompts():
    rng = random.Random(41)
    return [[rng.randrange(100, 40000) for _ in range(n)] for n in (1030, 1370)]


def _run(engine, prompt, **knobs):
    out = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "custom_params": knobs})
    flush_cache(engine)  # every run starts from an empty radix cache
    return out["output_ids"], out["meta_info"]["uniprefill"][-1]


def _runs(engine, out, name, **knobs):
    """Each prompt's run as `_run`, under `name`, and the rejoin it recorded (None: none yet)."""
    out[name], out[name + "_rejoins"] = [], []
    for p in _prompts():
        out[name].append(_run(engine, p, **knobs))
        out[name + "_rejoins"].append(uniprefill_state(engine)["last_rejoin"])


@pytest.fixture(scope="module")
def kept_runs(smollm2_path):
    before = os.environ.get("UNIPREFILL_REPORT_KEPT")  # other modules set it at import
    os.environ["UNIPREFILL_REPORT_KEPT"] = "1"
    out = {}
    try:
        for name, extra in (("chunked", CHUNKED), ("unchunked", {})):
            engine = make_cpu_engine(smollm2_path, **COMMON, **extra)
            try:
                _runs(engine, out, name, uniprefill_keep_ratio=0.5)
                if name == "chunked":
                    _runs(engine, out, "top_p_1", uniprefill_top_p=1.0)
                    out["dense"] = [_run(engine, p, uniprefill=False) for p in _prompts()]
                out[name + "_idle"] = idle_state(engine)
            finally:
                engine.shutdown()
    finally:
        if before is None:
            os.environ.pop("UNIPREFILL_REPORT_KEPT", None)
        else:
            os.environ["UNIPREFILL_REPORT_KEPT"] = before
    return out


def test_chunked_rejoin_keeps_the_unchunked_positions(kept_runs):
    for (_, chunked), (_, whole), prompt in zip(kept_runs["chunked"], kept_runs["unchunked"],
                                               _prompts()):
        assert chunked["kept_tokens"][0] == whole["kept_tokens"][0] == len(prompt)
        assert chunked["kept_tokens"] == whole["kept_tokens"]
        assert chunked["kept_digest"] == whole["kept_digest"]


def test_rejoin_runs_its_mlps_in_pieces_of_a_chunk(kept_runs):
    chunked, unchunked = kept_runs["chunked_idle"], kept_runs["unchunked_idle"]
    # Each final chunk: 1030 / 1370 rows rejoin at layer 4, half stay: MLPs past the first drop
    # get more than a chunk of rows, and run in pieces.
    assert chunked["pieced_mlp_calls"] > 0
    assert unchunked["pieced_mlp_calls"] == 0  # no limit without chunking
    assert chunked["parked_requests"] == 0


def test_rejoin_runs_its_attention_in_pieces_of_a_chunk(kept_runs, smollm2_path):
    """Every attention sublayer after the first drop (layers 5-29 of SmolLM2's 30, the second drop
    layer's included) runs the rejoining rows in pieces: at top-p 1.0 all of them, with every row
    kept; at keep 0.5 at least those before the second drop, with half the rows."""
    layers = json.loads((Path(smollm2_path) / "config.json").read_text())["num_hidden_layers"]
    after_first_drop = layers - 1 - 4
    numbers = []
    for rejoin, prompt in zip(kept_runs["top_p_1_rejoins"], _prompts()):
        assert rejoin["rows"] == len(prompt)
        assert rejoin["pieced_attention_calls"] == after_first_drop
        assert rejoin["peak_bytes"] is None  # measured on a GPU only
        numbers.append(rejoin["number"])
    for rejoin in kept_runs["chunked_rejoins"]:
        assert CHUNK < rejoin["rows"] and 12 - 4 <= rejoin["pieced_attention_calls"]
        numbers.append(rejoin["number"])
    assert sorted(numbers) == list(range(1, 5))  # one rejoin per run
    assert kept_runs["unchunked_idle"]["last_rejoin"] is None  # no chunks, no rejoin


def test_chunked_top_p_one_answers_as_dense(kept_runs):
    for (ids, meta), (dense_ids, dense_meta), prompt in zip(kept_runs["top_p_1"],
                                                             kept_runs["dense"], _prompts()):
        assert meta["enabled"] and not dense_meta["enabled"]
        assert meta["kept_tokens"] == [len(prompt)] * 3
        assert meta["kv_missing"] == [0, 0]
        assert ids == dense_ids


def _faulted(smollm2_path, monkeypatch, fault):
    """Each prompt with keep 0.5 under the fault switch: its output, or the error it got."""
    monkeypatch.setenv("UNIPREFILL_TEST_FAULT", fault)
    engine = make_cpu_engine(smollm2_path, **COMMON, **CHUNKED)
    try:
        faulted = []
        for p in _prompts():
            try:
                faulted.append(engine.generate(input_ids=p, sampling_params={
                    **GREEDY, "custom_params": {"uniprefill_keep_ratio": 0.5}}))
            except Exception as error:  # sglang.Engine raises what a client gets as an error
                faulted.append(error)
        state = idle_state(engine)
        flush_cache(engine)
        dense = [_run(engine, p, uniprefill=False)[0] for p in _prompts()]
    finally:
        engine.shutdown()
    return faulted, state, dense


def _assert_no_leak(state):
    assert state["parked_requests"] == 0
    assert state["available_kv_tokens"] + state["evictable_kv_tokens"] == \
        state["max_total_num_tokens"]
    assert state.get("kv_pool_problems", []) == []


def test_a_fault_after_the_rejoin_re_prefills_the_prompt_dense(smollm2_path, monkeypatch):
    """The second drop layer raises after the parked rows rejoined at the first one."""
    faulted, state, dense = _faulted(smollm2_path, monkeypatch, "last_drop")
    for out, dense_ids, prompt in zip(faulted, dense, _prompts()):
        entry = out["meta_info"]["uniprefill"][-1]
        assert entry["reason"].startswith("UniPrefill error, re-prefilled dense"), entry
        # Every prompt token went through every layer: the slot map lacks nothing.
        assert entry["kept_tokens"] == [len(prompt)] * 3
        assert entry["kv_missing"] == [0, 0]
        assert out["output_ids"] == dense_ids
    _assert_no_leak(state)


def test_a_fault_the_dense_re_run_hits_too_fails_the_request(smollm2_path, monkeypatch):
    """Every rejoin raises, the dense re-run's too: the request gets an error, the server serves
    on (the dense requests after it answer) and holds no slot of it."""
    faulted, state, dense = _faulted(smollm2_path, monkeypatch, "rejoin")
    for error in faulted:
        assert isinstance(error, Exception), error
        assert "500" in str(error) and "incomplete KV" in str(error), error
    assert all(len(ids) == GREEDY["max_new_tokens"] for ids in dense)
    _assert_no_leak(state)


def test_under_tensor_parallelism_only_the_plugins_own_errors_are_recovered():
    """A rank re-running a forward alone would hang the collectives: with a TP group only the
    plugin's own errors (raised alike on every rank) are recovered from."""
    from types import SimpleNamespace

    from uniprefill_sglang.errors import UniPrefillError
    from uniprefill_sglang.patches.model_runner import _recoverable

    tp, single = SimpleNamespace(tp_agreement=object()), SimpleNamespace(tp_agreement=None)
    assert _recoverable(tp, UniPrefillError("a drop failed"))
    assert not _recoverable(tp, RuntimeError("CUDA out of memory"))
    assert _recoverable(single, RuntimeError("CUDA out of memory"))
