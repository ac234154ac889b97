"""The serving side of block-sparse attention (uniprefill_sglang/backends/block_sparse.py), without
an engine: one request's attention and its tally against the kernels' float64 reference on fresh
random inputs, and the forward's plan. The engine test is test_engine_block_sparse.py."""

from __future__ import annotations

import types

import pytest
import torch

from uniprefill_sglang.backends import block_sparse
from uniprefill_sglang.config import UniPrefillConfigError, build_config
from uniprefill_sglang.context import Survivors
from uniprefill_sglang.kernels import (block_density, block_mask_reference,
                                       block_sparse_attention_reference)
from uniprefill_sglang.kernels.block_sparse_reference import causal_block_pairs
from uniprefill_sglang.kv_validity import ForwardKV
from uniprefill_sglang.request_plan import BatchPlan, RequestDecision

SEEDS = [0, 1, 2]
# (queries, keys, query heads, kv heads, block size): a whole prompt, a chunk after a prefix
# (starting mid-block), a chunk shorter than a block, partial last blocks.
SHAPES = [(128, 128, 4, 2, 16), (70, 200, 6, 3, 16), (5, 99, 4, 1, 32), (64, 64, 2, 2, 64)]


def _qkv(seed, n_q, n_k, hq, hkv, d=16, dv=8):
    g = torch.Generator().manual_seed(seed)
    q = 2.0 * torch.randn(n_q, hq, d, generator=g)
    return q, torch.randn(n_k, hkv, d, generator=g), torch.randn(n_k, hkv, dv, generator=g)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rule", [("density", 0.3, "pooled", 128), ("top_p", 0.8, "pooled", 128),
                                  ("density", 1.0, "pooled", 128),
                                  ("top_p", 0.8, "last_queries", 8), ("top_p", 0.8, "both", 32),
                                  ("density", 0.3, "last_queries", 128)])
def test_attend_is_the_reference_over_the_estimated_mask(seed, shape, rule):
    n_q, n_k, hq, hkv, bs = shape
    q, k, v = _qkv(seed, n_q, n_k, hq, hkv)
    out, kept, causal = block_sparse.attend(q, k, v, rule, bs, 0.25, path="reference")
    mask = block_mask_reference(q, k, bs, **{rule[0]: rule[1]}, sink_blocks=1, local_blocks=1,
                                sm_scale=0.25, estimate=rule[2], last_queries=rule[3])
    want = block_sparse_attention_reference(q, k, v, mask, bs, 0.25)
    assert out.dtype == q.dtype and out.shape == (n_q, hq, v.shape[2])
    assert torch.allclose(out.double(), want, atol=1e-5, rtol=1e-5)
    assert int(kept) / causal == pytest.approx(block_density(mask, n_q, n_k, bs))
    if rule[:2] == ("density", 1.0):
        assert int(kept) == causal


def test_the_flag_offers_the_kernels_estimates():
    from uniprefill_sglang.config import BLOCK_SPARSE_ESTIMATES, DEFAULT_LAST_QUERIES
    from uniprefill_sglang.kernels import ESTIMATES
    from uniprefill_sglang.kernels.block_sparse_reference import DEFAULT_ESTIMATE_LAST_QUERIES

    assert BLOCK_SPARSE_ESTIMATES == ESTIMATES  # the torch-free config keeps its own copy
    assert DEFAULT_ESTIMATE_LAST_QUERIES == DEFAULT_LAST_QUERIES


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_attend_without_a_rule_is_causal_attention(seed, shape):
    n_q, n_k, hq, hkv, bs = shape
    q, k, v = _qkv(seed, n_q, n_k, hq, hkv)
    out, kept, causal = block_sparse.attend(q, k, v, None, bs, 0.25, path="reference")
    # every key at or before each query, written out
    logits = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(hq // hkv, 1))
    seen = torch.arange(n_k)[None, :] <= (n_k - n_q + torch.arange(n_q))[:, None]
    probs = torch.softmax((0.25 * logits).masked_fill(~seen, float("-inf")), -1)
    want = torch.einsum("hqk,khd->qhd", probs, v.double().repeat_interleave(hq // hkv, 1))
    assert torch.allclose(out.double(), want, atol=1e-5, rtol=1e-5)
    assert int(kept) == causal == int(causal_block_pairs(n_q, n_k, bs).sum())


@pytest.mark.parametrize("n_q, n_k, bs", [(1, 1, 16), (16, 16, 16), (17, 300, 16), (0, 40, 16),
                                          (100, 1000, 64), (64, 65, 64)])
def test_causal_pairs_counts_the_reference_grid(n_q, n_k, bs):
    assert block_sparse.causal_pairs(n_q, n_k, bs) == int(causal_block_pairs(n_q, n_k, bs).sum())


def _ctx(decisions, fixed_lens, lens):
    notes = {}
    return types.SimpleNamespace(plan=BatchPlan(decisions),
                                 survivors=Survivors(lens=lens, fixed_lens=fixed_lens),
                                 note=lambda b, why: notes.__setitem__(b, why), notes=notes)


def _runtime(config, chunks=None, backend="TorchNativeAttnBackend", latent=False):
    unserved = block_sparse.unserved_reason(backend, latent)
    return types.SimpleNamespace(config=config, block_sparse_chunks=chunks or {},
                                 block_sparse_unserved=unserved)


def _decision(rid, block_sparse=("density", 0.3, "pooled", 128), final_chunk=True, reason=None):
    return RequestDecision(True, (0.99,), (), reason, rid=rid, final_chunk=final_chunk,
                           block_sparse=block_sparse)


def test_plan_keeps_short_sequences_and_decode_rows_dense_and_carries_chunks():
    config = build_config(top_p=None, keep_ratio=None, block_size=64, sink_tokens=128,
                          last_queries=128, drop_layers=None, min_prompt_tokens=0,
                          block_sparse_density=0.3, block_sparse_min_tokens=256)
    runtime = _runtime(config, {"c": (30.0, 100)})
    decisions = [_decision("a"), _decision("b"), _decision("c"), _decision("d", None),
                 _decision("e", reason="decode")]
    ctx = _ctx(decisions, fixed_lens=[0, 200, 300, 0, 500], lens=[300, 50, 10, 400, 1])
    step = block_sparse.plan_step(runtime, ctx)
    rule = ("density", 0.3, "pooled", 128)
    assert step.rules == [rule, None, rule, None, None]
    assert step.asked == [True, True, True, False, False]
    assert runtime.block_sparse_chunks == {}  # the earlier chunks' tally moved to the step
    step.tally(2, torch.tensor(10), 100)
    step.tally(2, torch.tensor(20), 100)
    assert step.entry(2, decisions[2]) == {"block_sparse_density": pytest.approx(60 / 300)}
    assert step.entry(1, decisions[1]) == {"block_sparse_density": 1.0}  # none ran sparse
    assert step.entry(3, decisions[3]) == {}
    # a chunk before its prompt's last hands its tally on
    step.tally(0, torch.tensor(7), 10)
    step.entry(0, _decision("a", final_chunk=False))
    assert runtime.block_sparse_chunks == {"a": (7.0, 10)}
    assert block_sparse.plan_step(runtime, _ctx([_decision("x", None)], [0], [500])) is None


def test_plan_on_a_backend_without_a_path_attends_densely_and_says_why():
    config = build_config(top_p=None, keep_ratio=None, block_size=64, sink_tokens=128,
                          last_queries=128, drop_layers=None, min_prompt_tokens=0)
    runtime = _runtime(config, backend="FlashInferAttnBackend")
    ctx = _ctx([_decision("a")], [0], [5000])
    step = block_sparse.plan_step(runtime, ctx)
    assert step.rules == [None] and step.asked == [True]
    assert "FlashInferAttnBackend has no block-sparse path" in ctx.notes[0]
    assert step.entry(0, _decision("a")) == {"block_sparse_density": 1.0}
    # Multi-head latent attention (DeepSeek), on any backend.
    for backend in block_sparse.SERVED_BY:
        runtime = _runtime(config, backend=backend, latent=True)
        ctx = _ctx([_decision("a")], [0], [5000])
        step = block_sparse.plan_step(runtime, ctx)
        assert step.rules == [None] and "multi-head latent attention" in ctx.notes[0]
    assert block_sparse.unserved_reason("TritonAttnBackend", False) is None


def test_a_failed_block_sparse_forward_is_ours_and_its_dense_rerun_attends_densely():
    """A forward that planned block-sparse attention and raised is UniPrefill's to recover
    (patches/model_runner.py), and the plan it re-runs with has no block-sparse rule left."""
    from uniprefill_sglang.patches.model_runner import _uniprefill_acted

    plan = BatchPlan([_decision("a"), _decision("b", None)])
    ctx = types.SimpleNamespace(acts=False, kv=ForwardKV(), plan=plan)
    assert _uniprefill_acted(ctx)
    dense = plan.all_dense("UniPrefill error, re-prefilled dense: x")
    assert [d.block_sparse for d in dense.decisions] == [None, None]
    assert not _uniprefill_acted(types.SimpleNamespace(acts=False, kv=ForwardKV(), plan=dense))
    assert not block_sparse.plan_step(_runtime(build_config(
        top_p=None, keep_ratio=None, block_size=64, sink_tokens=128, last_queries=128,
        drop_layers=None, min_prompt_tokens=0, block_sparse_density=0.3)),
        _ctx(dense.decisions, [0, 0], [4096, 4096]))


def test_the_server_flags_are_refused_for_multi_head_latent_attention():
    from uniprefill_sglang.schedule import ModelFacts
    from uniprefill_sglang.server_args import UniPrefillServerArgs

    args = types.SimpleNamespace(attention_backend="triton", prefill_attention_backend=None,
                                 kv_cache_dtype="auto")
    UniPrefillServerArgs._check_block_sparse_backend(args)  # served
    llama = ModelFacts(("LlamaForCausalLM",), 4, 64, None, frozenset())
    UniPrefillServerArgs._check_block_sparse_backend(args, llama)
    deepseek = ModelFacts(("DeepseekV2ForCausalLM",), 4, 64, None, frozenset())
    with pytest.raises(UniPrefillConfigError, match="DeepseekV2ForCausalLM's multi-head latent "
                                                    "attention has no block-sparse path"):
        UniPrefillServerArgs._check_block_sparse_backend(args, deepseek)


def test_the_full_attention_prefill_backend_is_found_inside_the_wrappers():
    """A hybrid model's wrapper (linear attention or short convolutions) holds the backend of its
    full-attention layers, itself possibly SGLang's prefill/decode split."""
    from uniprefill_sglang.backends import full_attention_prefill

    class TritonAttnBackend:
        pass

    class HybridAttnBackend:  # SGLang's prefill/decode split, by its class name
        def __init__(self, prefill, decode):
            self.prefill_backend, self.decode_backend = prefill, decode

    class ShortConvHybridAttnBackend:
        def __init__(self, full):
            self.full_attn_backend = full

    triton, other = TritonAttnBackend(), object()
    assert full_attention_prefill(triton) is triton
    assert full_attention_prefill(HybridAttnBackend(triton, other)) is triton
    assert full_attention_prefill(ShortConvHybridAttnBackend(triton)) is triton
    assert full_attention_prefill(
        ShortConvHybridAttnBackend(HybridAttnBackend(triton, other))) is triton
