"""CUDA tests of the UniPrefill selection kernels (skipped without CUDA).

Run in a pytest process of its own, or at least one where ``TRITON_INTERPRET`` is
not set (tests/test_kernels.py never sets it when a GPU is visible):

    pytest tests/gpu/test_kernels_gpu.py -q

Oracle: the torch reference in float64 (on the GPU, one KV head at a time).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA not available", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET", "0") == "1":
    pytest.skip("TRITON_INTERPRET=1 in this process: run the GPU tests in a separate pytest process",
                allow_module_level=True)

import triton  # noqa: E402,F401  (imported before anything could set TRITON_INTERPRET)

from uniprefill_sglang.kernels import (  # noqa: E402
    block_scores_reference,
    positional_attention,
    positional_attention_reference,
    score_tokens,
    score_tokens_reference,
    select_tokens,
    select_tokens_reference,
)
from uniprefill_sglang.kernels import score_triton  # noqa: E402  (eager: pins compiled-mode kernels)
from uniprefill_sglang.kernels import positional_triton as pa_triton  # noqa: E402

if pa_triton.INTERPRETED or type(score_triton._score_accum_kernel).__name__ == "InterpretedFunction":
    pytest.skip("kernels were imported in interpreter mode", allow_module_level=True)

DEV = torch.device("cuda")


@pytest.fixture(autouse=True)
def _no_forcing(monkeypatch):
    monkeypatch.delenv("UNIPREFILL_FORCE_REFERENCE", raising=False)
    monkeypatch.delenv("UNIPREFILL_FORCE_TRITON", raising=False)


def make_batch(seed, segs, hq, hkv, d, dtype=torch.bfloat16, noncontig=True, q_scale=1.0, extra_slots=1000):
    """segs: list of (num_queries, num_keys); see tests/test_kernels.py::make_batch."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    q_ind, k_ind, qpos, kpos = [0], [0], [], []
    for nq, nk in segs:
        if noncontig and nk > 0:
            kp = torch.sort(torch.randperm(2 * nk + 3, generator=g, device=DEV)[:nk]).values
        else:
            kp = torch.arange(nk, device=DEV)
        if nq <= nk:
            qp = kp[nk - nq:] if nq > 0 else kp[:0]
        else:
            qp = torch.randint(0, 2 * nk + 3, (nq,), generator=g, device=DEV)
        kpos.append(kp)
        qpos.append(qp)
        q_ind.append(q_ind[-1] + nq)
        k_ind.append(k_ind[-1] + nk)
    nq_tot, nk_tot = q_ind[-1], k_ind[-1]
    s = nk_tot + extra_slots
    q = (torch.randn(nq_tot, hq, d, generator=g, device=DEV) * q_scale).to(dtype)
    k_cache = torch.randn(s, hkv, d, generator=g, device=DEV).to(dtype)
    k_slots = torch.randperm(s, generator=g, device=DEV)[:nk_tot]
    return dict(
        q=q,
        q_pos=torch.cat(qpos).to(torch.int64),
        q_indptr=torch.tensor(q_ind, dtype=torch.int32, device=DEV),
        k_cache=k_cache,
        k_slots=k_slots,
        k_pos=torch.cat(kpos).to(torch.int32),
        k_indptr=torch.tensor(k_ind, dtype=torch.int32, device=DEV),
        sm_scale=d ** -0.5,
    ), max(n for n, _ in segs), max(n for _, n in segs)


def oracle(b):
    return score_tokens_reference(**b, compute_dtype=torch.float64, kv_head_chunk=1)


def run_scores(b, **kw):
    out = torch.full((b["k_slots"].numel(),), float("nan"), dtype=torch.float32, device=DEV)
    res = score_tokens(**b, out=out, **kw)
    torch.cuda.synchronize()
    return res


def assert_scores_close(got, ref, rtol=1e-3, atol=1e-5):
    assert torch.isfinite(got).all(), "non-finite scores"
    ref = ref.double()
    err = (got.double() - ref).abs()
    bound = atol * max(1.0, float(ref.abs().max())) + rtol * ref.abs()
    bad = err > bound
    assert not bad.any(), (
        f"{int(bad.sum())} mismatches; worst err {float(err.max()):.3e} at {int(err.argmax())}, "
        f"ref {float(ref[err.argmax()]):.6e} got {float(got[err.argmax()]):.6e}"
    )


def assert_row_mass(got, b):
    hq = b["q"].shape[1]
    qi, ki = b["q_indptr"].tolist(), b["k_indptr"].tolist()
    for s in range(len(qi) - 1):
        qp = b["q_pos"][qi[s]:qi[s + 1]]
        kp = b["k_pos"][ki[s]:ki[s + 1]].to(torch.int64)
        rows = int((kp.view(1, -1) <= qp.view(-1, 1)).any(dim=1).sum()) if kp.numel() else 0
        mass = float(got[ki[s]:ki[s + 1]].double().sum())
        assert abs(mass - rows * hq) <= 1e-3 * max(1, rows * hq), (s, mass, rows * hq)


MIXED = [(128, 4096), (0, 1000), (300, 2500), (1, 1), (128, 9000), (7, 0), (64, 64), (17, 333)]


@pytest.mark.parametrize(
    "d,hq,hkv,dtype",
    [
        (128, 32, 8, torch.bfloat16),  # Llama-3.1-8B, G = 4
        (128, 32, 32, torch.bfloat16),  # G = 1
        (64, 32, 4, torch.float16),  # G = 8, D = 64
        (128, 28, 4, torch.bfloat16),  # G = 7 (Qwen2-7B)
        (128, 16, 2, torch.float32),  # fp32 inputs (ieee dot)
        (576, 16, 1, torch.bfloat16),  # DeepSeek-V2 MLA (kv_lora_rank 512 + rope 64): 9 head-dim chunks of 64
        (192, 16, 4, torch.float16),  # not a power of two: 3 head-dim chunks of 64
    ],
)
def test_score_matches_reference(d, hq, hkv, dtype):
    b, max_q, max_k = make_batch(d + hq + hkv, MIXED, hq, hkv, d, dtype, q_scale=2.0)
    got = run_scores(b, max_q=max_q, max_k=max_k)
    assert_scores_close(got, oracle(b))
    assert_row_mass(got, b)
    got2 = run_scores(b)  # max lengths computed internally
    assert torch.equal(got, got2)


@pytest.mark.parametrize("segs", [[(128, 65536)], [(128, 65536), (0, 777), (128, 32768), (100, 40000)]])
def test_score_long_segments(segs):
    b, max_q, max_k = make_batch(5, segs, 32, 8, 128, torch.bfloat16, noncontig=False, q_scale=2.0)
    got = run_scores(b, max_q=max_q, max_k=max_k)
    assert_scores_close(got, oracle(b))
    assert_row_mass(got, b)


def test_score_all_masked_and_empty():
    b, max_q, max_k = make_batch(6, [(16, 500), (0, 300), (8, 200)], 32, 8, 128)
    ki = b["k_indptr"].tolist()
    b["k_pos"][ki[0]:ki[1]] += 10_000
    got = run_scores(b, max_q=max_q, max_k=max_k)
    assert (got[ki[0]:ki[2]] == 0).all()
    assert_scores_close(got, oracle(b))


def test_score_peak_memory_64k():
    """No [n x L x H] materialisation: extra memory beyond the output is tiny."""
    n, L = 128, 65536
    b, max_q, max_k = make_batch(7, [(n, L)], 32, 8, 128, noncontig=False)
    out = torch.empty(L, dtype=torch.float32, device=DEV)
    score_tokens(**b, max_q=max_q, max_k=max_k, out=out)  # warm up / compile
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    score_tokens(**b, max_q=max_q, max_k=max_k, out=out)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    materialised = n * L * 32 * 4  # one fp32 [n, L, Hq] score matrix
    print(f"score_tokens extra peak at 64K: {extra / 2**20:.2f} MiB (one fp32 score matrix: {materialised / 2**20:.0f} MiB)")
    assert extra < 16 * 2**20, extra


def test_score_is_sync_free_with_max_lengths():
    b, max_q, max_k = make_batch(8, [(128, 5000), (0, 10), (64, 3000)], 32, 8, 128)
    score_tokens(**b, max_q=max_q, max_k=max_k)  # compile outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        score_tokens(**b, max_q=max_q, max_k=max_k)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_score_deterministic():
    b, max_q, max_k = make_batch(9, [(128, 20000), (32, 7000)], 32, 8, 128)
    a1 = run_scores(b, max_q=max_q, max_k=max_k)
    a2 = run_scores(b, max_q=max_q, max_k=max_k)
    assert torch.equal(a1, a2)


# ---------------------------------------------------------------------------
# select_tokens
# ---------------------------------------------------------------------------


def pick_p(g, scores, k_indptr, cand_start, bs, margin=2e-5, lo=0.05, hi=0.98):
    """Random top-p per segment, kept `margin` away from every cumulative mass boundary."""
    ki = k_indptr.tolist()
    ps = []
    for b in range(len(ki) - 1):
        c0, c1 = ki[b] + cand_start[b], ki[b + 1]
        blocks = block_scores_reference(scores[c0:c1].double().cpu(), bs)
        cum = torch.cumsum(torch.sort(blocks, descending=True).values, 0)
        cum = cum / cum[-1] if cum.numel() and cum[-1] > 0 else cum
        for _ in range(1000):
            p = lo + (hi - lo) * float(torch.rand(1, generator=g))
            if cum.numel() == 0 or float((cum - p).abs().min()) > margin:
                break
        else:
            raise AssertionError("no top-p value away from the cumulative boundaries")
        ps.append(p)
    return ps


def compare_select(scores, k_pos, k_indptr, cand, bs, tp, kr, sink, window):
    args = (k_indptr, torch.tensor(cand), bs, torch.tensor(tp, dtype=torch.float32),
            torch.tensor(kr, dtype=torch.float32), sink, window)
    idx, cnt = select_tokens(scores, k_pos, *[a.to(DEV) if torch.is_tensor(a) else a for a in args])
    ridx, rcnt = select_tokens_reference(scores.cpu(), k_pos.cpu(), *[a.cpu() if torch.is_tensor(a) else a
                                                                      for a in args])
    assert idx.device.type == "cuda" and cnt.device.type == "cuda"
    assert torch.equal(cnt.cpu().long(), rcnt.long()), (cnt.tolist(), rcnt.tolist())
    assert torch.equal(idx.cpu(), ridx)
    return idx, cnt


@pytest.mark.parametrize("bs", [16, 64])
def test_select_matches_reference_large(bs):
    g = torch.Generator().manual_seed(bs)
    lens = [65536, 1, 0, 30000, 4097, 131072]
    cand = [0, 0, 0, 1234, 4000, 64]
    scores = torch.cat([torch.rand(n, generator=g) ** 6 for n in lens]).to(DEV)
    k_pos = torch.cat([torch.arange(n) for n in lens]).to(DEV)
    k_indptr = torch.tensor([0] + torch.cumsum(torch.tensor(lens), 0).tolist(), dtype=torch.int32, device=DEV)
    tp = pick_p(g, scores, k_indptr, cand, bs)
    compare_select(scores, k_pos, k_indptr, cand, bs, tp, [0.0] * len(lens), 4, 128)
    kr = [0.25, 0.0, 0.5, 0.1, 0.0, 0.3]
    compare_select(scores, k_pos, k_indptr, cand, bs, tp, kr, 0, 0)


def test_select_keep_all_and_ties():
    lens = [8192, 8192, 4096]
    scores = torch.cat([torch.full((8192,), 0.5), torch.rand(8192), torch.zeros(4096)]).to(DEV)
    k_pos = torch.cat([torch.arange(n) for n in lens]).to(DEV)
    k_indptr = torch.tensor([0, 8192, 16384, 20480], dtype=torch.int32, device=DEV)
    cs = torch.zeros(3, dtype=torch.int64, device=DEV)
    idx, cnt = select_tokens(scores, k_pos, k_indptr, cs, 64, torch.ones(3, device=DEV), torch.zeros(3, device=DEV), 0, 0)
    assert cnt.tolist() == lens and torch.equal(idx.cpu(), torch.arange(sum(lens)))
    # equal blocks, p = 0.25 of 128 blocks -> blocks 0..31 (the first by index)
    idx, cnt = select_tokens(scores, k_pos, k_indptr, cs, 64, torch.full((3,), 0.25, device=DEV),
                             torch.zeros(3, device=DEV), 0, 0)
    assert torch.equal(idx[idx < 8192].cpu(), torch.arange(32 * 64))
    assert cnt[2] == 4096  # zero-mass segment keeps everything


def test_pipeline_end_to_end():
    """score -> select on a Llama-like batch; compare with the reference pipeline."""
    b, max_q, max_k = make_batch(11, [(128, 16384), (128, 8192)], 32, 8, 128, noncontig=False, q_scale=3.0)
    scores = score_tokens(**b, max_q=max_q, max_k=max_k)
    ref = oracle(b).float()
    cand = [1024, 0]
    g = torch.Generator().manual_seed(0)
    tp = pick_p(g, ref, b["k_indptr"], cand, 64, margin=1e-4)
    idx, cnt = compare_select(ref, b["k_pos"], b["k_indptr"], cand, 64, tp, [0.0, 0.0], 4, 128)
    idx2, cnt2 = select_tokens(scores, b["k_pos"], b["k_indptr"], torch.tensor(cand, device=DEV), 64,
                               torch.tensor(tp, device=DEV), torch.zeros(2, device=DEV), 4, 128)
    assert torch.equal(idx, idx2) and torch.equal(cnt, cnt2)
    assert idx.numel() == int(cnt.sum()) and bool((idx[1:] > idx[:-1]).all())


def test_selection_dropped_mass_matches_reference_and_is_sync_free():
    """selection.select_survivors on the GPU (Triton select): the mass each segment lets go
    against the float64 reference, and computed without a host sync."""
    from uniprefill_sglang.selection import (DropCandidates, SelectionRule, _dropped_mass,
                                             _indptr, select_survivors,
                                             select_survivors_reference)

    g = torch.Generator(device=DEV).manual_seed(12)
    hq, hkv, d, slots = 32, 8, 128, 40000
    keys = torch.randn(slots, hkv, d, generator=g, device=DEV).to(torch.bfloat16)
    perm = torch.randperm(slots, generator=g, device=DEV)
    segs = [(0, 8192, 0.0, 0.9), (1000, 6000, 0.0, 0.99), (0, 4000, 0.5, 1.0), (300, 2000, 0.0, 1.0)]
    c = DropCandidates(None, None, [], None, None, [], [], [], [])
    queries, qpos, kslots, kpos, start = [], [], [], [], 0
    for prefix, new, ratio, top_p in segs:
        n = prefix + new
        kslots.append(perm[start:start + n])
        kpos.append(torch.arange(n, device=DEV))
        queries.append(torch.randn(128, hq, d, generator=g, device=DEV).to(torch.bfloat16) * 3)
        qpos.append(torch.arange(n - 128, n, device=DEV))
        start += n
        c.query_counts.append(128), c.key_counts.append(n), c.prefix_counts.append(prefix)
        c.keep_ratio.append(ratio), c.top_p.append(top_p)
    c.queries, c.query_pos = torch.cat(queries), torch.cat(qpos)
    c.key_slots, c.key_pos = torch.cat(kslots), torch.cat(kpos)
    rule = SelectionRule(block_size=64, sink_tokens=128, last_window=128)
    sel = select_survivors(c, keys, d ** -0.5, rule)
    want = select_survivors_reference(c, keys, d ** -0.5, rule).dropped_mass
    got = sel.dropped_mass.cpu()
    assert not torch.isnan(got).any() and ((0 <= got) & (got <= 1)).all(), got
    assert (got - want.cpu()).abs().max() <= 1e-3 * float(want.max()) + 1e-9, (got, want)
    assert float(got[0]) > 0 and float(got[0]) <= 0.1 + 1e-4  # top-p 0.9 lets some go
    assert float(got[3]) == 0.0  # top-p 1 keeps every block
    # The mass itself from the selection's outputs: no host sync.
    indptr = [torch.tensor(_indptr(n), device=DEV, dtype=torch.int32)
              for n in (c.query_counts, c.key_counts)]
    scores = score_tokens(c.queries, c.query_pos, indptr[0], keys, c.key_slots, c.key_pos,
                          indptr[1], d ** -0.5, max_q=128, max_k=max(c.key_counts))
    _dropped_mass(c, scores, sel.keep_mask)  # first call outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _dropped_mass(c, scores, sel.keep_mask)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_top_neighbors_on_the_gpu_match_the_reference_without_a_host_sync():
    """selection.keep_top_neighbors on CUDA tensors (128K candidates over four requests, fresh
    random scores and keep masks): equal to the plain per-request reference, and no host sync."""
    import random

    from uniprefill_sglang.selection import (DropCandidates, SelectionRule, keep_top_neighbors,
                                             keep_top_neighbors_reference)

    g = torch.Generator(device=DEV).manual_seed(21)
    rng = random.Random(21)
    c = DropCandidates(None, None, [], None, None, [], [], [], [])
    positions = []
    for prefix, new in ((0, 65536), (512, 32768), (0, 20000), (64, 9999)):
        c.key_counts.append(prefix + new), c.prefix_counts.append(prefix)
        gap = rng.randint(0, 300)  # a prefix whose later tokens were dropped
        positions.append(torch.cat([torch.arange(prefix, device=DEV),
                                    torch.arange(prefix + gap, prefix + gap + new, device=DEV)]))
    c.key_pos = torch.cat(positions)
    scores = torch.rand(c.key_pos.shape[0], generator=g, device=DEV, dtype=torch.float64) ** 8
    keep = torch.rand(sum(k - p for k, p in zip(c.key_counts, c.prefix_counts)), generator=g,
                      device=DEV) < 0.3
    rule = SelectionRule(block_size=64, sink_tokens=128, last_window=128, neighbor_blocks=4)
    got, counts = keep_top_neighbors(c, scores, keep, rule)  # first call outside the check
    want = keep_top_neighbors_reference(c, scores, keep, rule)
    assert got.tolist() == want
    assert int(counts.sum()) == sum(want) and int(got.sum()) > int(keep.sum())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        keep_top_neighbors(c, scores, keep, rule)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_the_first_drop_bound_holds_rows_without_a_host_sync():
    """drop._hold_over_bound: the segments over their bound keep every candidate row, on the
    device, with no host sync (the drop's one read comes after, with the counts)."""
    from types import SimpleNamespace

    from uniprefill_sglang.context import Survivors
    from uniprefill_sglang.drop import _hold_over_bound

    lens = [300, 500, 200]
    rows = [torch.arange(s, s + n, device=DEV) for s, n in zip((0, 300, 800), lens)]
    step = SimpleNamespace(selecting=[(b, r, 0) for b, r in enumerate(rows)])
    survivors = Survivors(lens=lens)
    candidate_rows = torch.cat(rows)
    keep = torch.zeros(1000, dtype=torch.bool, device=DEV)
    keep[::3] = True
    counts = torch.tensor([100, 167, 67], dtype=torch.int32, device=DEV)
    mass = torch.tensor([0.2, 0.01, 0.5], dtype=torch.float64, device=DEV)
    args = (survivors, step, keep.clone(), candidate_rows, counts, mass, [0.1, 0.1, None])
    _hold_over_bound(*args)  # first call outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        held = _hold_over_bound(survivors, step, keep, candidate_rows, counts, mass,
                                [0.1, 0.1, None])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert held.tolist() == [300, 167, 67]
    assert bool(keep[:300].all())  # over its bound: every row
    assert keep[300:].tolist() == [(i % 3 == 0) for i in range(300, 1000)]


# ---------------------------------------------------------------------------
# positional_attention
# ---------------------------------------------------------------------------


def make_attention_case(seed, reqs, hq, hkv, d, dtype=torch.bfloat16, pool=20000):
    """reqs: (num_keys, num_rows) per request: num_keys kept positions of 0..1.5*num_keys (a drop
    left gaps), the rows being the last num_rows of them; keys at shuffled slots of a pool of
    ``pool`` slots."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    q_ind, kv_ind, qpos, kpos = [0], [0], [], []
    for nk, nq in reqs:
        kept = torch.sort(torch.randperm(nk * 3 // 2, generator=g, device=DEV)[:nk]).values
        qpos.append(kept[nk - nq:])
        kpos.append(kept)
        q_ind.append(q_ind[-1] + nq)
        kv_ind.append(kv_ind[-1] + nk)
    slots = pool
    assert kv_ind[-1] <= slots
    return dict(
        q=(torch.randn(q_ind[-1], hq, d, generator=g, device=DEV) * 2).to(dtype),
        q_pos=torch.cat(qpos).to(torch.int32),
        q_indptr=torch.tensor(q_ind, dtype=torch.int32, device=DEV),
        k_buffer=torch.randn(slots, hkv, d, generator=g, device=DEV).to(dtype),
        v_buffer=torch.randn(slots, hkv, d, generator=g, device=DEV).to(dtype),
        kv_indptr=torch.tensor(kv_ind, dtype=torch.int32, device=DEV),
        kv_indices=torch.randperm(slots, generator=g, device=DEV)[:kv_ind[-1]].to(torch.int64),
        kv_pos=torch.cat(kpos).to(torch.int64),
        sm_scale=d ** -0.5,
    ), max(n for _, n in reqs)


def attention_oracle(case, **kw):
    f64 = {k: case[k].double() for k in ("q", "k_buffer", "v_buffer")}
    return positional_attention_reference(**{**case, **f64}, **kw)


def attention_rel_err(got, ref):
    assert torch.isfinite(got).all(), "non-finite output"
    return float((got.double() - ref).abs().max()) / float(ref.abs().max())


# bf16: the output is rounded (half an ulp: 2^-8 of the value), so are the softmax weights
# before they multiply the values
ATTN_BOUND_BF16 = 1e-2
ATTN_REQS = [(2048, 256), (5000, 1024), (8192, 512)]


@pytest.mark.parametrize(
    "hq,hkv,d,window,cap",
    [
        (8, 4, 128, -1, 0.0),
        (8, 4, 128, 512, 0.0),
        (4, 1, 256, 511, 0.0),  # Gemma 3 270M's head shape, HF sliding_window 512
        (8, 4, 128, 512, 30.0),
    ],
)
def test_positional_attention_matches_reference(hq, hkv, d, window, cap):
    case, max_q = make_attention_case(20 + d + window, ATTN_REQS, hq, hkv, d)
    out = torch.full((case["q"].shape[0], hq, d), float("nan"), dtype=torch.bfloat16, device=DEV)
    got = positional_attention(**case, window=window, logit_cap=cap, max_q_len=max_q, out=out)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    err = attention_rel_err(got, attention_oracle(case, window=window, logit_cap=cap))
    print(f"positional_attention bf16 max|got-ref|/max|ref| = {err:.2e} (window {window}, cap {cap})")
    assert err < ATTN_BOUND_BF16, err


def test_positional_attention_is_sync_free_and_replays_in_a_cuda_graph():
    """Captured once; the index tensors' contents (request split, slots, positions) and the
    inputs change in place, the replay gives the reference of the new contents."""
    window, max_q = 512, 1024
    case, _ = make_attention_case(31, ATTN_REQS, 8, 4, 128)
    out = torch.full((case["q"].shape[0], 8, 128), float("nan"), dtype=torch.bfloat16, device=DEV)

    def call():
        positional_attention(**case, window=window, max_q_len=max_q, out=out)

    call()  # compile outside the checked regions
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert attention_rel_err(out, attention_oracle(case, window=window)) < ATTN_BOUND_BF16

    # same shapes, new contents: other row and key counts per request (fewer keys in all than
    # kv_indices holds), other slots and positions, new q / k / v
    new, _ = make_attention_case(32, [(6000, 1024), (3000, 712), (4000, 56)], 8, 4, 128)
    assert new["q"].shape == case["q"].shape and new["kv_indices"].numel() <= case["kv_indices"].numel()
    n = new["kv_indices"].numel()
    for name in ("q", "q_pos", "q_indptr", "k_buffer", "v_buffer", "kv_indptr"):
        case[name].copy_(new[name])
    case["kv_indices"][:n].copy_(new["kv_indices"])
    case["kv_pos"][:n].copy_(new["kv_pos"])
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert attention_rel_err(out, attention_oracle(new, window=window)) < ATTN_BOUND_BF16
