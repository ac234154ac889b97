"""CPU tests of the UniPrefill selection kernels (Triton path under the interpreter).

Interpreter plumbing: tests/triton_interpreter.py (imported first: it sets TRITON_INTERPRET
when this process can still run the interpreter, else ``test_cpu_suite_in_subprocess`` re-runs
this file in a fresh interpreter-mode python process).

The public API is called with ``path="triton"`` so that it dispatches to the (interpreted)
Triton kernels on CPU tensors; the oracle is the torch reference evaluated in float64.  Outputs and scratch buffers are NaN-poisoned.
"""

import functools
import importlib
import math
from fractions import Fraction

import pytest
import torch

from triton_interpreter import RUN_IN_PROCESS, SKIP_REASON, subprocess_suite  # before triton

import uniprefill_sglang.kernels as K  # noqa: E402
from uniprefill_sglang.kernels import score_tokens_reference, select_tokens_reference  # noqa: E402

# The public API on the Triton path, CPU tensors included (interpreted).
score_tokens = functools.partial(K.score_tokens, path="triton")
select_tokens = functools.partial(K.select_tokens, path="triton")

# the interpreter converts 1-element arrays with int(): numpy DeprecationWarning noise
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# ---------------------------------------------------------------------------
# interpreter plumbing
# ---------------------------------------------------------------------------


test_cpu_suite_in_subprocess = subprocess_suite(__file__)


@pytest.fixture(scope="module")
def interp_modules():
    if not RUN_IN_PROCESS:
        pytest.skip(SKIP_REASON)
    from triton.runtime.interpreter import InterpretedFunction

    st = importlib.import_module(f"{K.__name__}.score_triton")
    sl = importlib.import_module(f"{K.__name__}.select_triton")
    for kern in (st._score_stats_kernel, st._score_combine_kernel, st._score_accum_kernel, sl._select_kernel):
        assert isinstance(kern, InterpretedFunction), "Triton interpreter mode is not active"
    assert st.INTERPRETED
    return st, sl


@pytest.fixture(autouse=True)
def interpreted(request, monkeypatch):
    if request.node.name == "test_cpu_suite_in_subprocess":
        yield None
        return
    st, sl = request.getfixturevalue("interp_modules")
    # internal scratch buffers are NaN-filled: an unwritten element poisons the output
    monkeypatch.setattr(st, "POISON_SCRATCH", True)
    yield st, sl


# ---------------------------------------------------------------------------
# input generation
# ---------------------------------------------------------------------------


def make_batch(seed, segs, hq, hkv, d, dtype=torch.bfloat16, noncontig=True, q_scale=1.0, extra_slots=23):
    """segs: list of (num_queries, num_keys).  Keys of a segment have increasing positions
    (a random subset of 0..2*nk when ``noncontig``: an earlier drop happened); the queries are
    the segment's last keys (their positions), or random positions when there are more queries
    than keys.  Key rows live at random slots of a larger cache."""
    g = torch.Generator().manual_seed(seed)
    q_ind, k_ind, qpos, kpos = [0], [0], [], []
    for nq, nk in segs:
        if noncontig and nk > 0:
            kp = torch.sort(torch.randperm(2 * nk + 3, generator=g)[:nk]).values
        else:
            kp = torch.arange(nk)
        if nq <= nk:
            qp = kp[nk - nq:] if nq > 0 else kp[:0]
        else:
            qp = torch.randint(0, 2 * nk + 3, (nq,), generator=g)
        kpos.append(kp)
        qpos.append(qp)
        q_ind.append(q_ind[-1] + nq)
        k_ind.append(k_ind[-1] + nk)
    nq_tot, nk_tot = q_ind[-1], k_ind[-1]
    s = nk_tot + extra_slots
    q = (torch.randn(nq_tot, hq, d, generator=g) * q_scale).to(dtype)
    k_cache = torch.randn(s, hkv, d, generator=g).to(dtype)
    k_slots = torch.randperm(s, generator=g)[:nk_tot]
    return dict(
        q=q,
        q_pos=torch.cat(qpos).to(torch.int64),
        q_indptr=torch.tensor(q_ind, dtype=torch.int32),
        k_cache=k_cache,
        k_slots=k_slots,
        k_pos=torch.cat(kpos).to(torch.int32),
        k_indptr=torch.tensor(k_ind, dtype=torch.int32),
        sm_scale=d ** -0.5,
    )


def oracle_scores(b):
    return score_tokens_reference(**b, compute_dtype=torch.float64)


def run_scores(b, **kw):
    out = torch.full((b["k_slots"].numel(),), float("nan"), dtype=torch.float32)
    res = score_tokens(**b, out=out, **kw)
    assert res.data_ptr() == out.data_ptr()
    return res


def assert_scores_close(got, ref, rtol=2e-4, atol=2e-6):
    assert got.dtype == torch.float32
    assert torch.isfinite(got).all(), "non-finite scores"
    ref = ref.to(torch.float64)
    err = (got.to(torch.float64) - ref).abs()
    bound = atol * max(1.0, float(ref.abs().max())) + rtol * ref.abs()
    bad = err > bound
    assert not bad.any(), (
        f"{int(bad.sum())} mismatches; worst err {float(err.max()):.3e} at {int(err.argmax())}, "
        f"ref {float(ref[err.argmax()]):.6e} got {float(got[err.argmax()]):.6e}"
    )


def assert_row_mass(got, b):
    """Each query row with >= 1 visible key distributes exactly mass 1 per head."""
    hq = b["q"].shape[1]
    qi, ki = b["q_indptr"].tolist(), b["k_indptr"].tolist()
    for s in range(len(qi) - 1):
        qp = b["q_pos"][qi[s]:qi[s + 1]]
        kp = b["k_pos"][ki[s]:ki[s + 1]].to(torch.int64)
        rows = int((kp.view(1, -1) <= qp.view(-1, 1)).any(dim=1).sum()) if kp.numel() else 0
        mass = float(got[ki[s]:ki[s + 1]].double().sum())
        assert abs(mass - rows * hq) <= 1e-4 * max(1, rows * hq), (s, mass, rows * hq)


# ---------------------------------------------------------------------------
# score_tokens
# ---------------------------------------------------------------------------

MIXED_SEGS = [(7, 300), (0, 50), (16, 129), (1, 1), (3, 0), (24, 64), (0, 0), (5, 17)]


@pytest.mark.parametrize(
    "d,hq,hkv,dtype",
    [
        (64, 4, 4, torch.bfloat16),  # G = 1
        (128, 8, 2, torch.bfloat16),  # G = 4
        (64, 8, 1, torch.float16),  # G = 8
        (128, 8, 1, torch.bfloat16),  # G = 8, D = 128
        (64, 6, 2, torch.float32),  # G = 3 (non power of two), fp32 inputs
    ],
)
def test_score_matches_reference(d, hq, hkv, dtype):
    b = make_batch(1000 + d + hq * 7 + hkv, MIXED_SEGS, hq, hkv, d, dtype, q_scale=1.5)
    got = run_scores(b)
    assert_scores_close(got, oracle_scores(b))
    assert_row_mass(got, b)


@pytest.mark.parametrize(
    "d,hq,hkv,dtype",
    [
        (576, 16, 1, torch.bfloat16),  # DeepSeek MLA (kv_lora_rank 512 + rope 64): 9 chunks of 64
        (192, 8, 2, torch.float16),  # 3 chunks of 64
        (80, 4, 2, torch.bfloat16),  # 5 chunks of 16
        (48, 6, 2, torch.float32),  # 3 chunks of 16, G = 3, fp32 inputs
        (200, 4, 1, torch.bfloat16),  # 2 chunks of 128, the last one half masked
        (20, 4, 2, torch.float16),  # one chunk of 32, columns >= 20 masked
        (8, 2, 1, torch.float32),  # below tl.dot's minimum K: one chunk of 16, half masked
    ],
)
def test_score_any_head_dim(d, hq, hkv, dtype):
    """Head dims that are not a power of two >= 16: the head dim is split into chunks."""
    segs = [(5, 90), (0, 20), (9, 40), (1, 1), (3, 0)]
    b = make_batch(2000 + d + hq * 7 + hkv, segs, hq, hkv, d, dtype, q_scale=1.5)
    got = run_scores(b)
    assert_scores_close(got, oracle_scores(b))
    assert_row_mass(got, b)


def test_score_head_dim_chunks(interp_modules):
    """Chunk width DC: the whole head dim for a power of two 16..128 (one chunk, today's path)."""
    st, _ = interp_modules
    want = {16: (16, 1), 64: (64, 1), 128: (128, 1), 256: (128, 2), 576: (64, 9), 192: (64, 3),
            80: (16, 5), 48: (16, 3), 96: (32, 3), 200: (128, 2), 20: (32, 1), 8: (16, 1), 1: (16, 1)}
    got = {d: (st._head_dim_chunk(d), -(-d // st._head_dim_chunk(d))) for d in want}
    assert got == want


def test_score_mla_small_tiles_and_splits(interp_modules):
    """Head dim 576 with several key tiles, pass-1 splits and row tiles."""
    st, _ = interp_modules
    b = make_batch(8, [(4, 70), (0, 9), (2, 33)], 16, 1, 576, torch.bfloat16, q_scale=2.0)
    ref = oracle_scores(b)
    for splits in (1, 3):
        out = torch.full((b["k_slots"].numel(),), float("nan"))
        got = st.score_tokens_triton(**b, out=out, rows=16, block_n=16, rows2=32, block_n2=32, n_splits=splits)
        assert_scores_close(got, ref)


def test_score_small_tiles_and_splits(interp_modules):
    """Many key tiles, several pass-1 splits, several row tiles per kv head."""
    st, _ = interp_modules
    b = make_batch(7, [(20, 150), (0, 40), (9, 97), (33, 33)], 8, 2, 64, torch.bfloat16, q_scale=2.0)
    ref = oracle_scores(b)
    for splits in (1, 3, 7):
        out = torch.full((b["k_slots"].numel(),), float("nan"))
        got = st.score_tokens_triton(**b, out=out, rows=16, block_n=16, rows2=16, block_n2=32, n_splits=splits)
        assert_scores_close(got, ref)


def test_score_long_segment_contiguous():
    b = make_batch(11, [(40, 700), (2, 5)], 4, 1, 64, torch.bfloat16, noncontig=False, q_scale=2.0)
    got = run_scores(b)
    assert_scores_close(got, oracle_scores(b))
    assert_row_mass(got, b)


def test_score_explicit_max_lengths_and_int32_slots():
    b = make_batch(12, [(6, 90), (0, 10), (10, 31)], 8, 2, 64, torch.float16)
    b["k_slots"] = b["k_slots"].to(torch.int32)
    b["q_pos"] = b["q_pos"].to(torch.int32)
    b["q_indptr"] = b["q_indptr"].to(torch.int64)
    got = run_scores(b, max_q=16, max_k=128)  # upper bounds, larger than the actual maxima
    assert_scores_close(got, oracle_scores(b))


def test_score_uniform_attention():
    """q = 0: every query spreads mass 1 per head uniformly over its visible keys."""
    segs = [(4, 37), (0, 9), (8, 100)]
    b = make_batch(13, segs, 8, 2, 64, torch.bfloat16)
    b["q"].zero_()
    got = run_scores(b)
    exp = torch.zeros(b["k_slots"].numel(), dtype=torch.float64)
    qi, ki = b["q_indptr"].tolist(), b["k_indptr"].tolist()
    for s in range(len(segs)):
        kp = b["k_pos"][ki[s]:ki[s + 1]].to(torch.int64)
        for p in b["q_pos"][qi[s]:qi[s + 1]].tolist():
            vis = kp <= p
            if vis.any():
                exp[ki[s]:ki[s + 1]] += vis.double() * 8 / float(vis.sum())
    assert_scores_close(got, exp)
    assert_scores_close(got, oracle_scores(b))


def test_score_one_hot_attention():
    """One key dominates: every query row puts (almost) all its mass on it."""
    segs = [(6, 80), (3, 20)]
    hq, hkv, d = 8, 2, 64
    b = make_batch(14, segs, hq, hkv, d, torch.float32, noncontig=False)
    ki = b["k_indptr"].tolist()
    qi = b["q_indptr"].tolist()
    hot = [ki[0] + 5, ki[1] + 2]
    for s in range(2):
        kvec = b["k_cache"][b["k_slots"][hot[s]]]  # [Hkv, D]
        kvec = kvec / kvec.norm(dim=-1, keepdim=True)
        b["k_cache"][b["k_slots"][hot[s]]] = kvec * 16.0
        b["q"][qi[s]:qi[s + 1]] = kvec.repeat_interleave(hq // hkv, dim=0).unsqueeze(0) * 16.0
    got = run_scores(b)
    ref = oracle_scores(b)
    assert_scores_close(got, ref)
    assert float(got[hot[0]]) > 0.99 * 6 * hq and float(got[hot[1]]) > 0.99 * 3 * hq


def test_score_all_keys_masked():
    """Queries positioned before all keys see nothing: zero scores, no NaN."""
    b = make_batch(15, [(5, 40), (4, 30), (0, 7)], 4, 2, 64, torch.bfloat16, noncontig=False)
    qi, ki = b["q_indptr"].tolist(), b["k_indptr"].tolist()
    # segment 0: keys at positions 100.., queries 0..4 -> every row masked
    b["k_pos"][ki[0]:ki[1]] += 100
    b["q_pos"][qi[0]:qi[1]] = torch.arange(5)
    # segment 1: half of the rows masked (positions -1)
    b["q_pos"][qi[1]:qi[1] + 2] = -1
    got = run_scores(b)
    assert torch.isfinite(got).all()
    assert (got[ki[0]:ki[1]] == 0).all()
    assert_scores_close(got, oracle_scores(b))
    assert_row_mass(got, b)


def test_score_degenerate_batches():
    hq, hkv, d = 4, 2, 64
    # no keys at all
    b = make_batch(16, [(3, 0), (0, 0)], hq, hkv, d)
    assert score_tokens(**b).numel() == 0
    # no queries at all: zeros
    b = make_batch(17, [(0, 12), (0, 5)], hq, hkv, d)
    got = run_scores(b)
    assert (got == 0).all()


def test_score_deterministic():
    b = make_batch(18, [(9, 120), (4, 33)], 8, 2, 64, torch.bfloat16)
    a1, a2 = run_scores(b), run_scores(b)
    assert torch.equal(a1, a2)


def test_score_reference_dispatch():
    b = make_batch(19, [(3, 20)], 4, 2, 64, torch.float32)
    got = K.score_tokens(**b, path="reference")
    assert_scores_close(got, oracle_scores(b))
    assert not K.use_triton(b["k_cache"].device)  # CPU tensors: the reference by default
    with pytest.raises(ValueError, match="kernel path 'cuda'"):
        K.score_tokens(**b, path="cuda")


# ---------------------------------------------------------------------------
# select_tokens
# ---------------------------------------------------------------------------


def brute_block_keep(block_scores, top_p, ratio):
    """float64 brute force over python floats: indices of kept blocks."""
    nb = len(block_scores)
    if nb == 0:
        return set()
    order = sorted(range(nb), key=lambda i: (-block_scores[i], i))
    if ratio is not None:
        k = math.ceil(Fraction(ratio) * nb)
        k = max(1, min(nb, k))
    else:
        total = math.fsum(block_scores)
        if top_p >= 1.0 or total <= 0.0:
            k = nb
        else:
            k, acc = 0, 0.0
            while k < nb and acc < top_p * total:
                acc += block_scores[order[k]]
                k += 1
            k = max(1, k)
    return set(order[:k])


def brute_select(scores, k_pos, k_indptr, cand_start, bs, top_p, ratios, sink, window):
    """Expected (keep_idx, counts); ``ratios`` holds decimal strings or None (top-p)."""
    ki = k_indptr.tolist()
    keep, counts, row0 = [], [], 0
    for b in range(len(ki) - 1):
        c0, c1 = ki[b] + cand_start[b], ki[b + 1]
        nc = max(0, c1 - c0)
        sc = scores[c0:c0 + nc].tolist()
        blocks = [math.fsum(sc[i:i + bs]) for i in range(0, nc, bs)]
        kept_blocks = brute_block_keep(blocks, top_p[b], ratios[b])
        cnt = 0
        for i in range(nc):
            if (i // bs) in kept_blocks or int(k_pos[c0 + i]) < sink or i >= nc - window:
                keep.append(row0 + i)
                cnt += 1
        counts.append(cnt)
        row0 += nc
    return torch.tensor(keep, dtype=torch.int64), torch.tensor(counts)


def top_p_margin(block_scores, p):
    """Distance of p from the nearest cumulative mass boundary of the sorted blocks."""
    total = math.fsum(block_scores)
    if total <= 0:
        return 1.0
    acc, best = 0.0, 1.0
    for v in sorted(block_scores, reverse=True):
        acc += v
        best = min(best, abs(acc / total - p))
    return best


def make_select_case(seed, seg_lens, cand_starts, bs):
    g = torch.Generator().manual_seed(seed)
    nk = sum(seg_lens)
    scores = (torch.rand(nk, generator=g) ** 4) * torch.rand(1, generator=g) * 10  # skewed
    k_indptr = torch.tensor([0] + list(torch.cumsum(torch.tensor(seg_lens), 0).tolist()), dtype=torch.int32)
    k_pos = torch.cat([torch.sort(torch.randperm(2 * n + 2, generator=g)[:n]).values for n in seg_lens])
    return scores.float(), k_pos.to(torch.int64), k_indptr, list(cand_starts)


def pick_p(g, scores, k_indptr, cand_start, bs, lo=0.05, hi=0.98):
    """Random top-p values kept >= 1e-4 away from every cumulative boundary."""
    ki = k_indptr.tolist()
    ps = []
    for b in range(len(ki) - 1):
        c0, c1 = ki[b] + cand_start[b], ki[b + 1]
        sc = scores[c0:c1].double().tolist()
        blocks = [math.fsum(sc[i:i + bs]) for i in range(0, len(sc), bs)]
        for _ in range(100):
            p = lo + (hi - lo) * float(torch.rand(1, generator=g))
            if top_p_margin(blocks, p) > 1e-4:
                break
        ps.append(p)
    return ps


def check_select(scores, k_pos, k_indptr, cand_start, bs, top_p, ratios, sink, window, impl=None):
    b = len(cand_start)
    kr = torch.tensor([float(r) if r is not None else 0.0 for r in ratios], dtype=torch.float32)
    tp = torch.tensor(top_p, dtype=torch.float32)
    cs = torch.tensor(cand_start, dtype=torch.int32)
    exp_idx, exp_cnt = brute_select(scores, k_pos, k_indptr, cand_start, bs, tp.double().tolist(), ratios, sink, window)
    fns = [select_tokens, select_tokens_reference] if impl is None else [impl]
    results = []
    for fn in fns:
        idx, cnt = fn(scores, k_pos, k_indptr, cs, bs, tp, kr, sink, window)
        assert idx.dtype == torch.int64 and cnt.shape == (b,)
        assert torch.equal(idx, exp_idx), (fn, idx.tolist(), exp_idx.tolist())
        assert cnt.tolist() == exp_cnt.tolist(), (fn, cnt.tolist(), exp_cnt.tolist())
        assert int(cnt.sum()) == idx.numel()
        results.append((idx, cnt))
    return results


@pytest.mark.parametrize("bs", [1, 4, 16])
def test_select_top_p_brute_force(bs):
    g = torch.Generator().manual_seed(100 + bs)
    seg_lens = [300, 1, 0, 77, 160, 33, 5]
    cand = [0, 0, 0, 10, 64, 0, 5]  # cached prefixes; last segment has no candidates
    scores, k_pos, k_indptr, cand = make_select_case(100 + bs, seg_lens, cand, bs)
    ps = pick_p(g, scores, k_indptr, cand, bs)
    check_select(scores, k_pos, k_indptr, cand, bs, ps, [None] * len(seg_lens), sink=0, window=0)
    check_select(scores, k_pos, k_indptr, cand, bs, ps, [None] * len(seg_lens), sink=3, window=7)


def test_select_multi_tile(interp_modules):
    """Small kernel tiles: block sums, threshold search and token pass all span several tiles."""
    _, sl = interp_modules
    g = torch.Generator().manual_seed(5)
    seg_lens = [400, 90, 257]
    cand = [0, 30, 1]
    for bs in (1, 3, 8):
        scores, k_pos, k_indptr, cand = make_select_case(200 + bs, seg_lens, cand, bs)
        ps = pick_p(g, scores, k_indptr, cand, bs)
        impl = lambda *a: sl.select_tokens_triton(*a, block_a=16, block_s=16, block_t=32, nt=4)  # noqa: E731
        check_select(scores, k_pos, k_indptr, cand, bs, ps, [None, "0.3", None], sink=2, window=5, impl=impl)


def test_select_p_one_keeps_all():
    seg_lens = [50, 64, 7]
    scores, k_pos, k_indptr, cand = make_select_case(3, seg_lens, [0, 0, 0], 8)
    scores[50:60] = 0.0  # zero-score blocks must be kept too
    for p in (1.0, 1.5):
        for fn in (select_tokens, select_tokens_reference):
            idx, cnt = fn(scores, k_pos, k_indptr, torch.zeros(3, dtype=torch.int64), 8,
                          torch.full((3,), p), torch.zeros(3), 0, 0)
            assert torch.equal(idx, torch.arange(sum(seg_lens)))
            assert cnt.tolist() == seg_lens


def test_select_zero_mass_segment_keeps_all():
    scores = torch.zeros(40)
    scores[30:] = torch.rand(10)
    k_indptr = torch.tensor([0, 30, 40], dtype=torch.int32)
    k_pos = torch.arange(40)
    for fn in (select_tokens, select_tokens_reference):
        idx, cnt = fn(scores, k_pos, k_indptr, torch.zeros(2, dtype=torch.int64), 4,
                      torch.full((2,), 0.5), torch.zeros(2), 0, 0)
        assert cnt[0] == 30 and idx[:30].tolist() == list(range(30))


def test_select_keep_ratio_counts_exact():
    cases = [("0.3", 10), ("0.25", 8), ("0.5", 5), ("0.1", 7), ("0.999", 100), ("1.0", 13), ("0.01", 3),
             ("0.7", 1000), ("0.333", 3000)]
    for bs in (1, 16):
        seg_lens = [n * bs for _, n in cases]
        scores, k_pos, k_indptr, cand = make_select_case(7 + bs, seg_lens, [0] * len(cases), bs)
        ratios = [r for r, _ in cases]
        if bs == 1:  # brute-force check of the exact set, on the smaller blocks
            check_select(scores, k_pos, k_indptr, cand, bs, [0.9] * len(cases), ratios, sink=0, window=0)
        for fn in (select_tokens, select_tokens_reference):
            idx, cnt = fn(scores, k_pos, k_indptr, torch.zeros(len(cases), dtype=torch.int64), bs,
                          torch.full((len(cases),), 0.9),
                          torch.tensor([float(r) for r in ratios], dtype=torch.float32), 0, 0)
            want = [max(1, min(n, math.ceil(Fraction(r) * n))) * bs for r, n in cases]
            assert cnt.tolist() == want, (fn, bs)


def test_select_mixed_modes_and_partial_blocks():
    g = torch.Generator().manual_seed(9)
    seg_lens = [103, 58, 200, 9]
    cand = [3, 0, 17, 0]
    bs = 8
    scores, k_pos, k_indptr, cand = make_select_case(9, seg_lens, cand, bs)
    ps = pick_p(g, scores, k_indptr, cand, bs)
    ratios = ["0.4", None, "0.05", None]
    check_select(scores, k_pos, k_indptr, cand, bs, ps, ratios, sink=4, window=3)


def test_select_sinks_and_window_always_kept():
    seg_lens = [120, 80]
    bs = 8
    scores, k_pos, k_indptr, cand = make_select_case(21, seg_lens, [16, 0], bs)
    k_pos = torch.cat([torch.arange(120), torch.arange(80)])
    # make the sinks and window the lowest-scored tokens so only the always-keep rules keep them
    scores[:] = 1.0
    scores[16:16 + 8] = 0.0  # candidates with pos 16..23 of segment 0
    scores[110:120] = 0.0
    scores[120:128] = 0.0
    scores[190:200] = 0.0
    sink, window = 20, 10
    for fn in (select_tokens, select_tokens_reference):
        idx, cnt = fn(scores, k_pos, k_indptr, torch.tensor([16, 0]), bs, torch.full((2,), 0.01),
                      torch.zeros(2), sink, window)
        idx = set(idx.tolist())
        # segment 0 candidates are rows 0..103 (pos 16..119); sinks: pos 16..19 -> rows 0..3
        assert {0, 1, 2, 3} <= idx
        assert set(range(104 - window, 104)) <= idx
        # segment 1 rows 104..183: sinks pos 0..19, window last 10
        assert set(range(104, 124)) <= idx
        assert set(range(184 - window, 184)) <= idx
        # only the top block (first by index among ties) survives beside them
        assert set(range(8, 16)) <= idx  # block 1 of segment 0 (block 0 has zero score)
    check_select(scores, k_pos, k_indptr, [16, 0], bs, [0.01, 0.01], [None, None], sink, window)


def test_select_ties_lower_block_first():
    bs = 4
    nb = 16
    # segment 0: all blocks equal; segment 1: blocks 3, 7, 11 tie for the top
    s0 = torch.full((nb * bs,), 0.25)
    s1 = torch.full((nb * bs,), 0.125)
    for blk in (3, 7, 11):
        s1[blk * bs:(blk + 1) * bs] = 1.0
    scores = torch.cat([s0, s1])
    k_indptr = torch.tensor([0, nb * bs, 2 * nb * bs], dtype=torch.int32)
    k_pos = torch.cat([torch.arange(nb * bs)] * 2)
    cs = torch.zeros(2, dtype=torch.int64)
    for fn in (select_tokens, select_tokens_reference):
        # p = 0.5 of 16 equal blocks: exactly blocks 0..7 (the 8th crosses/reaches 0.5)
        idx, cnt = fn(scores, k_pos, k_indptr, cs, bs, torch.tensor([0.5, 0.3]), torch.zeros(2), 0, 0)
        kept0 = sorted({i // bs for i in idx.tolist() if i < nb * bs})
        assert kept0 == list(range(8)), (fn, kept0)
        kept1 = sorted({(i - nb * bs) // bs for i in idx.tolist() if i >= nb * bs})
        # segment 1 total = 3*4 + 13*0.5 = 18.5; p*total = 5.55 -> two of the three tied top blocks
        assert kept1 == [3, 7], (fn, kept1)
        # keep ratio: 3 of 16 equal blocks -> blocks 0, 1, 2; and one tie of three -> block 3
        idx, cnt = fn(scores, k_pos, k_indptr, cs, bs, torch.zeros(2), torch.tensor([3 / 16, 1 / 16]), 0, 0)
        assert sorted({i // bs for i in idx.tolist() if i < nb * bs}) == [0, 1, 2]
        assert sorted({(i - nb * bs) // bs for i in idx.tolist() if i >= nb * bs}) == [3]


def test_select_exact_cumulative_boundary():
    """Cumulative mass hitting p exactly: the block that reaches p is the last one kept."""
    bs = 2
    blocks = [1.0, 4.0, 1.0, 2.0]  # sorted: 4, 2, 1, 1 -> cum 0.5, 0.75, 0.875, 1
    scores = torch.tensor([v / 2 for v in blocks for _ in range(bs)], dtype=torch.float32)
    k_indptr = torch.tensor([0, scores.numel()], dtype=torch.int32)
    k_pos = torch.arange(scores.numel())
    for p, want in ((0.75, [1, 3]), (0.5, [1]), (0.76, [0, 1, 3]), (0.875, [0, 1, 3])):
        for fn in (select_tokens, select_tokens_reference):
            idx, _ = fn(scores, k_pos, k_indptr, torch.zeros(1, dtype=torch.int64), bs, torch.tensor([p]),
                        torch.zeros(1), 0, 0)
            assert sorted({i // bs for i in idx.tolist()}) == want, (fn, p)


def test_select_p_zero_keeps_top_block_and_determinism():
    seg_lens = [64, 64]
    scores, k_pos, k_indptr, cand = make_select_case(31, seg_lens, [0, 0], 8)
    outs = []
    for _ in range(2):
        idx, cnt = select_tokens(scores, k_pos, k_indptr, torch.zeros(2, dtype=torch.int64), 8,
                                 torch.zeros(2), torch.zeros(2), 0, 0)
        assert cnt.tolist() == [8, 8]
        outs.append((idx, cnt))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    check_select(scores, k_pos, k_indptr, [0, 0], 8, [0.0, 0.0], [None, None], 0, 0)


def test_select_scalar_args():
    seg_lens = [40, 24]
    scores, k_pos, k_indptr, cand = make_select_case(41, seg_lens, [0, 0], 4)
    a = select_tokens(scores, k_pos, k_indptr, 0, 4, 0.6, 0.0, 1, 2)
    b = select_tokens_reference(scores, k_pos, k_indptr, 0, 4, 0.6, 0.0, 1, 2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_score_then_select_end_to_end():
    """Pipeline on Triton vs reference: identical selections when no p boundary is near."""
    b = make_batch(51, [(8, 200), (0, 30), (12, 150)], 8, 2, 64, torch.bfloat16, q_scale=2.0)
    scores = run_scores(b)
    ref = oracle_scores(b)
    assert_scores_close(scores, ref)
    cand = [20, 0, 0]
    g = torch.Generator().manual_seed(52)
    ps = pick_p(g, ref.float(), b["k_indptr"], cand, 8)
    ps[1] = 0.5  # no-query segment: zero mass -> keep all
    args = (b["k_pos"], b["k_indptr"], torch.tensor(cand), 8, torch.tensor(ps), torch.zeros(3), 4, 16)
    i1, c1 = select_tokens(scores, *args)
    i2, c2 = select_tokens_reference(ref.float(), *args)
    assert torch.equal(i1, i2) and torch.equal(c1, c2)
    assert c1[1] == 30

