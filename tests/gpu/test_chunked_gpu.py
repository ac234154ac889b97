"""Chunked prefill on the GPU: the kept tokens and greedy outputs do not depend on the chunking.

Skipped without CUDA. Run in a pytest process of its own:

    pytest tests/gpu/test_chunked_gpu.py -x -q

The model is test_backends_gpu.py's 6-layer Llama with random q/k projections (`qk_std`), so the
UniPrefill scores depend on the tokens' content. Prompts of 2K-6K tokens run on FlashInfer and
on Triton with chunked prefill off (one step) and at 256 tokens (the earlier chunks park at the
first drop and the final chunk scores every prompt token with the prompt's last queries). All
engines report a fingerprint of each request's kept positions per stage (UNIPREFILL_REPORT_KEPT=1).

A chunk's attention runs over the cached prefix and over the chunk itself in two passes that are
merged, so chunked and unchunked hidden states agree within bf16 rounding, not bit for bit, and
this small random model is chaotic: on the H200 (2026-11-29) even unchunked FlashInfer and
Triton gave different first tokens on 3 of 6 keep-ratio prompts. So the test holds chunking to
the yardstick of kernel noise: its kept positions must match the unchunked ones about as often
as two unchunked backends match each other; the greedy tokens are printed, not asserted. The
bit-exact version of this test (kept tokens and greedy outputs) runs on the CPU in float32,
tests/test_engine_uniprefill.py.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_harness import (EngineResults, cuda_device_count, log_dir_or,  # noqa: E402
                            run_engines, selected_engines, serve_and_record, idle_state)
from test_backends_gpu import _flush, _prompt, _record, build_model  # noqa: E402

ENGINE_KWARGS = dict(
    enable_uniprefill=True,
    uniprefill_min_prompt_tokens=0,  # correctness on short prompts: no cost rule
    uniprefill_keep_ratio=0.5,
    uniprefill_drop_layers="1,3",
    uniprefill_last_queries=64,
    dtype="bfloat16",
    context_length=8192,
    max_running_requests=8,
    max_total_tokens=65536,  # six engines start at once on one GPU: cap each KV pool
    mem_fraction_static=0.5,
    random_seed=0,
    log_level="info",
)
ENGINES = {
    "fi_whole": dict(attention_backend="flashinfer", chunked_prefill_size=8192),
    "fi_chunked": dict(attention_backend="flashinfer", chunked_prefill_size=256),
    "tr_whole": dict(attention_backend="triton", chunked_prefill_size=8192),
    "tr_chunked": dict(attention_backend="triton", chunked_prefill_size=256),
    # FA3 prefill (FlashInfer decode): the rejoin's attention in pieces of 256 rows.
    "fa3_whole": dict(attention_backend="fa3", chunked_prefill_size=8192),
    "fa3_chunked": dict(attention_backend="fa3", chunked_prefill_size=256),
}
PAIRS = [("fi_whole", "fi_chunked"), ("tr_whole", "tr_chunked"), ("fa3_whole", "fa3_chunked")]
QK_STD = 0.05
GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
PROMPTS = [_prompt(300 + i, n) for i, n in enumerate([2048, 2900, 3700, 4500, 5300, 6000])]
TIMEOUT_S = 330  # all six engines at once, start-up included


def run_workload(engine) -> dict:
    res = {}
    for name, custom in (("keep", {}), ("top_p", {"uniprefill_top_p": 0.9})):
        res[name] = []
        for ids in PROMPTS:
            res[name].append(_record(engine.generate(
                input_ids=ids, sampling_params=dict(GREEDY, custom_params=custom))))
            _flush(engine)
    res["state"] = idle_state(engine)
    return res


@pytest.fixture(scope="module")
def results():
    if cuda_device_count() < 1:
        pytest.skip("CUDA not available")
    with tempfile.TemporaryDirectory(prefix="uniprefill-chunked-") as tmp:
        tmp = Path(tmp)
        model_dir = build_model(tmp / "model", qk_std=QK_STD, max_positions=8192)
        # All at once on one GPU: start-up dominates.
        names, skipped = selected_engines(ENGINES)
        yield EngineResults(*run_engines(__file__, names, model_dir, tmp, log_dir_or(tmp),
                                         TIMEOUT_S, prefix="chunked_engine_"), skipped)


def _meta(rec) -> dict:
    return rec["uniprefill"][-1]


def _same_positions(a: list, b: list) -> int:
    """How many prompts kept the same positions in both runs."""
    return sum(x["uniprefill"][-1]["kept_digest"] == y["uniprefill"][-1]["kept_digest"]
               for x, y in zip(a, b))


@pytest.mark.parametrize("pair", PAIRS, ids=[p[1] for p in PAIRS])
def test_chunked_keeps_what_unchunked_keeps(results, pair):
    """Chunking may move a kept block no more often than switching attention kernels does."""
    whole, chunked = (results[n] for n in pair)
    other_whole = results["tr_whole" if pair[0] != "tr_whole" else "fi_whole"]
    for variant in ("keep", "top_p"):
        w = [_meta(r) for r in whole[variant]]
        c = [_meta(r) for r in chunked[variant]]
        assert all(m["enabled"] for m in w + c)
        # The final chunk scored the whole prompt: stage 0 holds every prompt token.
        assert [m["kept_tokens"][0] for m in c] == [len(p) for p in PROMPTS]
        assert any(m["kept_tokens"][-1] < m["kept_tokens"][0] for m in c)
        if variant == "keep":
            assert [m["kept_tokens"] for m in w] == [m["kept_tokens"] for m in c]
        same_pos = _same_positions(whole[variant], chunked[variant])
        kernels = _same_positions(whole[variant], other_whole[variant])
        same_out = sum(a["output_ids"] == b["output_ids"]
                       for a, b in zip(whole[variant], chunked[variant]))
        n = len(w)
        print(f"{pair} {variant}: kept positions equal on {same_pos}/{n} prompts (unchunked "
              f"FlashInfer vs Triton: {kernels}/{n}), greedy tokens on {same_out}/{n}")
        # Counted in prompts (a fraction compare failed on float rounding at the boundary):
        # at most one prompt more disagreement than switching kernels, capped at 80% agreement.
        assert same_pos >= min(kernels, int(0.8 * n)) - 1, (variant, same_pos, kernels)


@pytest.mark.parametrize("name", list(ENGINES))
def test_no_parked_state_or_slot_left(results, name):
    state = results[name]["state"]
    assert state["idle"] and state["parked_requests"] == 0, state
    assert state["available_kv_tokens"] + state["evictable_kv_tokens"] == \
        state["max_total_num_tokens"], state


if __name__ == "__main__":
    os.environ["UNIPREFILL_REPORT_KEPT"] = "1"
    name, model_dir, out_path = sys.argv[1:4]
    serve_and_record(name, ENGINES, ENGINE_KWARGS, model_dir, out_path, run_workload, 33000)
