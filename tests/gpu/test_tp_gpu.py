"""Tensor parallelism on two GPUs: TP=2 UniPrefill against TP=1 on the same weights.

Skipped without two CUDA GPUs. Run in a pytest process of its own:

    pytest tests/gpu/test_tp_gpu.py -x -q

The model is test_backends_gpu.py's 6-layer Llama, with random q/k projections (`qk_std`) so
that attention and the UniPrefill scores depend on the tokens (with q = k = 0 every block would
tie and any TP bug would still keep the same blocks). Weights are real safetensors, so TP=1 and
TP=2 load the same model (SGLang's dummy loader would seed each rank's shard on its own).

Every engine runs with UNIPREFILL_CHECK_TP=1 (each drop all-gathers a digest of every rank's
selection and raises on a mismatch, which stops the engine and fails the test) and
UNIPREFILL_REPORT_KEPT=1 (each request reports a fingerprint of its kept positions per stage).
The engines run one after another (TP=2 holds both GPUs): FlashInfer TP=1 and TP=2, and Triton
TP=2, each with decode CUDA graphs on, chunked prefill at 2048 tokens (so the longer prompts
park chunks), the radix cache on, and a 200-request load of mixed lengths (once with
UniPrefill, once dense).

TP=2 adds the two halves of the heads' partial sums in another order than TP=1 (row-parallel
o_proj / down_proj, and the score sum), so TP=1 and TP=2 are equal only within bf16 noise: the
tests ask for the same kept positions and greedy tokens on nearly every request, no more
disagreement than dense TP=2 has with dense TP=1, and never a degenerate ("!!!!") output.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_harness import EngineResults, cuda_device_count, log_dir_or, run_engines  # noqa: E402
from test_backends_gpu import _flush, _prompt, _record, build_model  # noqa: E402

ENGINE_KWARGS = dict(
    enable_uniprefill=True,
    uniprefill_min_prompt_tokens=0,  # correctness on short prompts: no cost rule
    uniprefill_keep_ratio=0.5,
    uniprefill_drop_layers="1,3",
    dtype="bfloat16",
    context_length=8192,
    chunked_prefill_size=2048,
    max_running_requests=64,
    cuda_graph_max_bs_decode=16,
    mem_fraction_static=0.5,
    random_seed=0,
    log_level="info",
)
ENGINES = {
    "fi_tp1": dict(attention_backend="flashinfer", tp_size=1),
    "fi_tp2": dict(attention_backend="flashinfer", tp_size=2),
    "tr_tp2": dict(attention_backend="triton", tp_size=2),
}
# Triton TP=2 is held against FlashInfer TP=1: kernel noise adds to the TP noise there.
PAIRS = [("fi_tp1", "fi_tp2"), ("fi_tp1", "tr_tp2")]
MAX_EXTRA_FLIPS = 0.05  # first-token flips UniPrefill TP=2 may add to dense TP=2's (see below)
QK_STD = 0.05  # attention logits of std ~3: peaked, content-dependent scores
GREEDY = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
LENGTHS = [700, 1200, 1900, 2600, 3300, 4100, 5200, 6400]  # > 2048: chunked, parked
SINGLES = [_prompt(100 + i, n) for i, n in enumerate(LENGTHS)]
DOC, QUESTIONS = _prompt(200, 1500), [_prompt(201, 80), _prompt(202, 80)]
LOAD_N = 200
TIMEOUT_S = 300  # all three engines, start-up included


def _load_prompts() -> list:
    rng = random.Random(7)
    return [_prompt(1000 + i, rng.choice([rng.randint(64, 600), rng.randint(600, 3000)]))
            for i in range(LOAD_N)]


def run_workload(engine) -> dict:
    res = {}
    variants = {"keep": {}, "top_p": {"uniprefill_top_p": 0.9}, "dense": {"uniprefill": False}}
    for name, custom in variants.items():
        res[name] = []
        for ids in SINGLES:
            res[name].append(_record(engine.generate(
                input_ids=ids, sampling_params=dict(GREEDY, custom_params=custom))))
            _flush(engine)
    res["radix"] = [_record(engine.generate(input_ids=DOC + q, sampling_params=GREEDY))
                    for q in QUESTIONS]
    _flush(engine)
    # Everything at once: chunked, mixed prefill/decode batches, decode graphs at many sizes.
    outs = engine.generate(input_ids=_load_prompts(),
                           sampling_params=dict(GREEDY, max_new_tokens=8))
    res["load"] = [_record(o) for o in outs]
    _flush(engine)
    # The same load dense: the baseline of how often TP alone flips a first token.
    outs = engine.generate(input_ids=_load_prompts(), sampling_params=dict(
        GREEDY, max_new_tokens=1, custom_params={"uniprefill": False}))
    res["load_dense"] = [_record(o) for o in outs]
    return res


def run_engine(name: str, model_dir: str, out_path: str) -> None:
    import sglang

    os.environ["UNIPREFILL_CHECK_TP"] = "1"
    os.environ["UNIPREFILL_REPORT_KEPT"] = "1"
    engine = sglang.Engine(model_path=model_dir, port=32000 + 100 * list(ENGINES).index(name),
                           **ENGINE_KWARGS, **ENGINES[name])
    try:
        t0 = time.time()
        res = run_workload(engine)
        res["workload_s"] = time.time() - t0
        for _ in range(100):  # the scheduler retires the last requests after they return
            res["state"] = engine.get_server_info()["internal_states"][0].get("uniprefill")
            if res["state"]["idle"]:
                break
            time.sleep(0.1)
    finally:
        engine.shutdown()
    Path(out_path).write_text(json.dumps(res))


@pytest.fixture(scope="module")
def results():
    if cuda_device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    with tempfile.TemporaryDirectory(prefix="uniprefill-tp-") as tmp:
        tmp = Path(tmp)
        model_dir = build_model(tmp / "model", qk_std=QK_STD, max_positions=8192)
        # One at a time: TP=2 holds both GPUs.
        yield EngineResults(*run_engines(__file__, ENGINES, model_dir, tmp, log_dir_or(tmp),
                                         TIMEOUT_S, prefix="tp_engine_", concurrent=False))


def _share_equal(a: list, b: list) -> float:
    """Fraction of positions where the two lists hold equal values."""
    return sum(x == y for x, y in zip(a, b)) / len(a)


def _meta(recs: list, key: str) -> list:
    return [(r["uniprefill"] or [{}])[-1].get(key) for r in recs]


def _outputs(recs: list) -> list:
    return [r["output_ids"] for r in recs]


@pytest.mark.parametrize("pair", PAIRS, ids=[p[1] for p in PAIRS])
def test_tp2_keeps_what_tp1_keeps(results, pair):
    tp1, tp2 = (results[n] for n in pair)
    for variant in ("keep", "top_p"):
        assert all(r["uniprefill"][-1]["enabled"] for r in tp2[variant])
        if variant == "keep":  # a keep ratio fixes the counts; top-p counts follow the scores
            assert _meta(tp1[variant], "kept_tokens") == _meta(tp2[variant], "kept_tokens")
        dropped = [r["uniprefill"][-1]["kept_tokens"] for r in tp2[variant]]
        assert any(k[-1] < k[0] for k in dropped), dropped
        d1, d2 = _meta(tp1[variant], "kept_digest"), _meta(tp2[variant], "kept_digest")
        agree = _share_equal(d1, d2)
        print(f"{pair}: {variant}: kept positions equal on {agree:.0%} of requests")
        assert agree >= 0.7, (variant, d1, d2)


def _first_token_flips(pairs: list) -> float:
    """Share of (TP=1, TP=2) record pairs whose first generated token differs."""
    return sum(a["output_ids"][0] != b["output_ids"][0] for a, b in pairs) / len(pairs)


@pytest.mark.parametrize("pair", PAIRS, ids=[p[1] for p in PAIRS])
def test_tp2_first_tokens_match_tp1(results, pair):
    """TP=2 alone flips the first (prefill) token of a few prompts: this random 6-layer model
    has near-tied logits, and TP=2 sums bf16 partials in another order. On the H200 dense TP=2
    flipped 10 (FlashInfer) and 9 (Triton) of 208 first tokens. So one prompt in 8 is no test;
    the prompts are pooled instead. Among all UniPrefill requests (singles, radix,
    the 200-request load) whose TP=1 and TP=2 kept the same positions, the share of flipped
    first tokens may exceed dense's share on the same prompts (singles and the load run dense)
    by at most MAX_EXTRA_FLIPS. A bug in a TP path (a wrong head split, a stale plan) flips far
    more: the 40-odd chunked prompts of the load alone are 20 points. Later tokens are only
    reported: greedy decode amplifies the noise (dense TP=1 and TP=2 part within 16 tokens on
    about half the prompts)."""
    tp1, tp2 = (results[n] for n in pair)
    dense = list(zip(tp1["dense"] + tp1["load_dense"], tp2["dense"] + tp2["load_dense"]))
    dense_flips = _first_token_flips(dense)
    pooled = []
    for variant in ("keep", "top_p", "radix", "load"):
        pairs = list(zip(tp1[variant], tp2[variant]))
        same_kept = [_meta([a], "kept_digest") == _meta([b], "kept_digest") for a, b in pairs]
        same_first = [a["output_ids"][0] == b["output_ids"][0] for a, b in pairs]
        full = _share_equal(_outputs(tp1[variant]), _outputs(tp2[variant]))
        print(f"{pair}: {variant}: first token equal on {sum(same_first)}/{len(pairs)}, all "
              f"tokens on {full:.0%}; same kept positions on {sum(same_kept)}/{len(pairs)}")
        if variant in ("keep", "top_p"):
            print(f"{pair}: {variant}: per prompt (length, same kept, same first token): "
                  f"{list(zip(LENGTHS, same_kept, same_first))}")
        pooled += [(p, k) for p, k in zip(pairs, same_kept)]
    same_selection = [p for p, k in pooled if k]
    up_flips = _first_token_flips(same_selection)
    all_flips = _first_token_flips([p for p, _ in pooled])
    print(f"{pair}: first tokens flipped: dense {dense_flips:.1%} of {len(dense)}; UniPrefill "
          f"{up_flips:.1%} of {len(same_selection)} with the same selection, {all_flips:.1%} "
          f"of all {len(pooled)}")
    assert up_flips <= dense_flips + MAX_EXTRA_FLIPS, (up_flips, dense_flips)
    assert all_flips <= 0.15, all_flips


@pytest.mark.parametrize("name", list(ENGINES))
def test_no_degenerate_output_and_no_leak(results, name):
    res = results[name]
    load = res["load"]
    assert len(load) == LOAD_N and all(len(r["output_ids"]) == 8 for r in load)
    degenerate = [r["output_ids"] for r in load if len(set(r["output_ids"])) == 1]
    dense_degenerate = sum(len(set(r["output_ids"])) == 1 for r in res["dense"])
    assert len(degenerate) <= max(2, dense_degenerate), degenerate[:5]
    assert res["radix"][1]["cached_tokens"] >= len(DOC) - 64  # the prefix was reused
    state = res["state"]
    assert state["parked_requests"] == 0
    assert state["available_kv_tokens"] + state["evictable_kv_tokens"] == \
        state["max_total_num_tokens"], state


if __name__ == "__main__":
    run_engine(*sys.argv[1:4])
