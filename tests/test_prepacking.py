"""Prepacking baseline (uniprefill_sglang/tools/prepacking.py) on a tiny random-weight Llama,
CPU, fp32.

The packed and the padded batch must give each prompt the same last-token logits as running the
prompt alone. Outputs are checked finite before they are compared, and comparisons are written
so that NaN fails them (``max_rel_err`` is NaN-propagating and ``nan <= tol`` is False).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from uniprefill_sglang.tools.prepacking import (
    build_packed_batch,
    build_padded_batch,
    first_fit_decreasing,
    run_one_by_one,
    run_packed,
    run_padded,
    ttft_packed,
    ttft_padded,
)

REL_TOL = 1e-4  # fp32; observed errors are below 1e-6


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    assert torch.isfinite(a).all() and torch.isfinite(b).all(), "non-finite logits"
    return ((a - b).abs().max() / b.abs().max()).item()


# ---------------------------------------------------------------------------- bin packing


def test_ffd_hand_checked_example():
    # sorted 5,4,3,3,2,2,1 into capacity 10: 5,4 -> row 0 (9); 3,3,2,2 -> row 1 (10); 1 -> row 0
    assert first_fit_decreasing([5, 4, 3, 3, 2, 2, 1], 10) == [[0, 1, 6], [2, 3, 4, 5]]


@pytest.mark.parametrize("seed", range(8))
def test_ffd_never_overfills_and_places_every_prompt_once(seed):
    rng = random.Random(1000 + seed)
    n = rng.randint(1, 300)
    capacity = rng.randint(8, 5000)
    lengths = [rng.randint(1, capacity) for _ in range(n)]
    bins = first_fit_decreasing(lengths, capacity)

    placed = sorted(i for b in bins for i in b)
    assert placed == list(range(n)), "every prompt exactly once"
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert all(0 < load <= capacity for load in loads), "no row overfilled, no empty row"
    assert len(bins) >= math.ceil(sum(lengths) / capacity)
    # First fit: any two rows together exceed the capacity (else the later row's items fitted
    # in the earlier one when they were placed).
    for i in range(len(loads)):
        for j in range(i + 1, len(loads)):
            assert loads[i] + loads[j] > capacity, (i, j, loads[i], loads[j])
    # Decreasing: inside a row, items were placed longest first.
    for b in bins:
        assert [lengths[i] for i in b] == sorted((lengths[i] for i in b), reverse=True)


def test_ffd_rejects_items_that_cannot_fit():
    with pytest.raises(ValueError, match="capacity"):
        first_fit_decreasing([3, 11], 10)
    with pytest.raises(ValueError, match="at least one token"):
        first_fit_decreasing([3, 0], 10)


# ---------------------------------------------------------------------------- batch builders


def random_prompts(seed: int, n: int, lo: int, hi: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (m,), generator=g).tolist() for m in lengths]


def test_packed_batch_layout():
    prompts = random_prompts(0, 12, 1, 40, 100)
    b = build_packed_batch(prompts, dtype=torch.float32)
    assert b.attention_mask.shape == (b.num_rows, 1, b.width, b.width)
    assert b.attention_mask.dtype == torch.float32
    assert b.width <= max(map(len, prompts))
    neg = torch.finfo(torch.float32).min
    for i, (r, s, n) in enumerate(b.index):
        assert b.input_ids[r, s:s + n].tolist() == prompts[i]
        assert b.position_ids[r, s:s + n].tolist() == list(range(n))
        block = b.attention_mask[r, 0, s:s + n]
        # inside its own block: causal; outside it: masked
        assert (block[:, s:s + n] == torch.triu(torch.full((n, n), neg), 1)).all()
        assert (block[:, :s] == neg).all() and (block[:, s + n:] == neg).all()
    # every mask row (also tail padding) can attend to something
    assert ((b.attention_mask == 0).sum(-1) > 0).all()
    assert b.real_tokens == sum(map(len, prompts))


def test_padded_batch_layout():
    prompts = random_prompts(1, 5, 1, 30, 100)
    b = build_padded_batch(prompts, pad_token_id=7)
    assert b.input_ids.shape == (5, max(map(len, prompts)))
    for i, p in enumerate(prompts):
        assert b.input_ids[i, : len(p)].tolist() == p
        assert b.attention_mask[i].tolist() == [1] * len(p) + [0] * (b.input_ids.shape[1] - len(p))
    assert b.padded_tokens == b.input_ids.numel() - sum(map(len, prompts))


# ---------------------------------------------------------------------------- logits


@pytest.fixture(scope="module", params=["eager", "sdpa"])
def tiny_llama(request):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.2,  # far from uniform attention, so a wrong mask shows
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    cfg._attn_implementation = request.param
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    assert model.config._attn_implementation == request.param
    return model


@pytest.mark.parametrize("seed", [0, 1])
def test_packed_logits_equal_one_by_one(tiny_llama, seed):
    prompts = random_prompts(10 + seed, 16, 1, 96, 256)
    ref = run_one_by_one(tiny_llama, prompts)
    batch = build_packed_batch(prompts, dtype=torch.float32)
    assert batch.num_rows < len(prompts), "some row must hold several prompts"
    packed = run_packed(tiny_llama, batch)
    assert max_rel_err(packed, ref) <= REL_TOL
    # a larger capacity packs more prompts per row; still exact
    wide = build_packed_batch(prompts, dtype=torch.float32, capacity=400)
    assert wide.num_rows < batch.num_rows
    assert max_rel_err(run_packed(tiny_llama, wide), ref) <= REL_TOL


@pytest.mark.parametrize("seed", [0, 1])
def test_padded_logits_equal_one_by_one(tiny_llama, seed):
    prompts = random_prompts(20 + seed, 8, 1, 96, 256)
    ref = run_one_by_one(tiny_llama, prompts)
    padded = run_padded(tiny_llama, build_padded_batch(prompts))
    assert max_rel_err(padded, ref) <= REL_TOL


@pytest.mark.parametrize("seed", [0, 1])
def test_left_padded_logits_equal_one_by_one(tiny_llama, seed):
    prompts = random_prompts(25 + seed, 8, 1, 96, 256)
    ref = run_one_by_one(tiny_llama, prompts)
    padded = run_padded(tiny_llama, build_padded_batch(prompts, side="left"))
    assert max_rel_err(padded, ref) <= REL_TOL


@pytest.mark.parametrize("seed", [0, 1])
def test_ttft_packed_and_padded_equal_one_by_one(tiny_llama, seed):
    """The paper's TTFT path: packed prefix, unpacked KV, one step over the last tokens."""
    prompts = random_prompts(50 + seed, 16, 2, 96, 256)
    ref = run_one_by_one(tiny_llama, prompts)
    assert build_packed_batch([p[:-1] for p in prompts]).num_rows < len(prompts)
    assert max_rel_err(ttft_packed(tiny_llama, prompts), ref) <= REL_TOL
    assert max_rel_err(ttft_padded(tiny_llama, prompts), ref) <= REL_TOL


def test_ttft_packed_needs_two_tokens(tiny_llama):
    with pytest.raises(ValueError, match="at least 2 tokens"):
        ttft_packed(tiny_llama, [[5, 6, 7], [8]])


def test_plain_causal_mask_over_a_packed_row_is_wrong(tiny_llama):
    """The check above can fail: without the block-diagonal mask, prompts see their row-mates."""
    prompts = random_prompts(30, 16, 1, 96, 256)
    ref = run_one_by_one(tiny_llama, prompts)
    batch = build_packed_batch(prompts, dtype=torch.float32)
    w = batch.width
    causal = torch.full((w, w), torch.finfo(torch.float32).min).triu(1)
    batch.attention_mask = causal.expand(batch.num_rows, 1, w, w).clone()
    wrong = run_packed(tiny_llama, batch)
    not_first = [i for i, (_, s, _) in enumerate(batch.index) if s > 0]
    assert not_first
    assert max_rel_err(wrong[not_first], ref[not_first]) > 100 * REL_TOL


def test_nan_never_passes(tiny_llama):
    prompts = random_prompts(40, 4, 1, 20, 256)
    ref = run_one_by_one(tiny_llama, prompts)
    poisoned = ref.clone()
    poisoned[2, 5] = float("nan")
    with pytest.raises(AssertionError, match="non-finite"):
        max_rel_err(poisoned, ref)


def test_flash_attention_is_refused(tiny_llama):
    batch = build_packed_batch([[1, 2, 3]], dtype=torch.float32)
    old = tiny_llama.config._attn_implementation
    tiny_llama.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(ValueError, match="eager' or 'sdpa"):
            run_packed(tiny_llama, batch)
    finally:
        tiny_llama.config._attn_implementation = old


# ---------------------------------------------------------------------------- benchmark smoke run


def _run_bench(tmp_path, *extra):
    """benchmarks/bench_prepacking.py on the CPU: SmolLM2, 4 prompts of <= 16 tokens, batch 2."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "prepacking_smoke.json"
    cmd = [sys.executable, str(repo / "benchmarks" / "bench_prepacking.py"), "--device", "cpu",
           "--profiles", "mmlu", "--pool", "4", "--batch-size", "2", "--sweep-sizes", "2",
           "--max-len", "16", "--repeats", "1", "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def _check_common(res):
    assert set(res["header"]) >= {"command", "date", "commit", "device", "sglang", "model"}
    prof = res["profiles"]["mmlu"]
    assert prof["lengths"]["n"] == 4 and prof["lengths"]["max"] <= 16
    for m in ("hf_padded", "hf_lenorder", "hf_packed"):
        for metric in ("prefill", "ttft"):
            e = prof["hf"][f"{m}/{metric}"]["2"]
            assert e["num_batches"] == 2 and e["mean_s_per_batch"] > 0, (m, metric, e)
    # The paper's TTFT path gives the same first token as the padded batch (fp32).
    assert prof["checks"]["ttft_first_token_packed_equals_padded"] == "4/4"
    assert prof["checks"]["ttft_logits_packed_vs_padded_max_rel_err"] < 1e-4
    return prof


def test_bench_smoke_hf_methods(tmp_path):
    """The HF half of the benchmark (no SGLang engine): seconds on an idle 2-core CPU."""
    res = _run_bench(tmp_path, "--methods", "hf_padded,hf_lenorder,hf_packed")
    _check_common(res)
    assert "sglang" not in res


@pytest.mark.engine
@pytest.mark.extended  # the baseline's benchmark end to end (offline tooling)
def test_bench_smoke_all_methods(tmp_path):
    """Every method, SGLang's CPU engine included (one engine start)."""
    res = _run_bench(tmp_path)
    prof = _check_common(res)
    for m in ("sglang_dense", "sglang_uniprefill"):
        e = prof["sglang"][m]["2"]
        assert e["num_batches"] == 2 and e["mean_s_per_batch"] > 0
    assert res["sglang"]["memory_usage"]["token_capacity"] > 0
