"""CPU tests of the position-masked attention kernel (Triton path under the interpreter).

Interpreter plumbing: tests/triton_interpreter.py (imported first: it sets TRITON_INTERPRET
when this process can still run the interpreter, else ``test_cpu_suite_in_subprocess`` re-runs
this file in a fresh process).  The public ``positional_attention`` is called with
``path="triton"`` so that it dispatches to the interpreted kernel on CPU tensors.

Oracle: ``positional_attention_reference`` evaluated on float64 copies of the inputs (itself
checked once against a dense masked softmax).  Output buffers are NaN-poisoned.
"""

import functools
import random
import importlib

import pytest
import torch
from triton_interpreter import RUN_IN_PROCESS, SKIP_REASON, subprocess_suite  # before triton

import uniprefill_sglang.kernels as K
from uniprefill_sglang.kernels import positional_attention_reference

# The public API on the Triton path, CPU tensors included (interpreted).
positional_attention = functools.partial(K.positional_attention, path="triton")

# the interpreter converts 1-element arrays with int(): numpy DeprecationWarning noise
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# max |got - ref| / max |ref|.  Rounding the output alone costs up to half an ulp, 2^-8 = 3.9e-3
# of the value in bf16 and 2^-11 = 4.9e-4 in fp16; the interpreter computes in fp32 otherwise.
BOUND = {BF16: 4.5e-3, FP16: 6e-4, FP32: 1e-5}


test_cpu_suite_in_subprocess = subprocess_suite(__file__)


@pytest.fixture(scope="module")
def kernel_module():
    if not RUN_IN_PROCESS:
        pytest.skip(SKIP_REASON)
    from triton.runtime.interpreter import InterpretedFunction

    mod = importlib.import_module(f"{K.__name__}.positional_triton")
    assert isinstance(mod._positional_attention_kernel, InterpretedFunction), "interpreter mode is off"
    assert mod.INTERPRETED
    return mod


@pytest.fixture(autouse=True)
def interpreted(request):
    if request.node.name == "test_cpu_suite_in_subprocess":
        yield None
        return
    yield request.getfixturevalue("kernel_module")


# ---------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------


def make_case(seed, reqs, hq, hkv, d, dv=None, dtype=BF16, idx_dtype=torch.int32, q_scale=1.0,
              extra_slots=41, shuffle_keys=False):
    """reqs: (num_prefix, num_rows) per request.  Each request keeps a random subset of
    num_prefix + num_rows positions of 0..2*(num_prefix + num_rows)+2 (as after a drop); its
    query rows are the last num_rows kept positions, its keys all the kept positions (the
    prefix and the rows themselves).  Keys live at shuffled slots of a larger pool; with
    ``shuffle_keys`` a request lists its keys out of position order."""
    dv = dv or d
    g = torch.Generator().manual_seed(seed)
    q_ind, kv_ind, qpos, kpos = [0], [0], [], []
    for n_prefix, n_rows in reqs:
        n = n_prefix + n_rows
        kept = torch.sort(torch.randperm(2 * n + 3, generator=g)[:n]).values
        qpos.append(kept[n_prefix:])
        kpos.append(kept[torch.randperm(n, generator=g)] if shuffle_keys else kept)
        q_ind.append(q_ind[-1] + n_rows)
        kv_ind.append(kv_ind[-1] + n)
    nq, nk = q_ind[-1], kv_ind[-1]
    slots = nk + extra_slots
    # the pool rows are wider than a head (strided views), v heads differ from k heads
    k_pool = torch.randn(slots, hkv, d + 8, generator=g).to(dtype)[:, :, :d]
    v_pool = torch.randn(slots, hkv, dv, generator=g).to(dtype)
    return dict(
        q=(torch.randn(nq, hq, d, generator=g) * q_scale).to(dtype),
        q_pos=torch.cat(qpos).to(idx_dtype),
        q_indptr=torch.tensor(q_ind, dtype=idx_dtype),
        k_buffer=k_pool,
        v_buffer=v_pool,
        kv_indptr=torch.tensor(kv_ind, dtype=idx_dtype),
        kv_indices=torch.randperm(slots, generator=g)[:nk].to(idx_dtype),
        kv_pos=torch.cat(kpos).to(idx_dtype),
        sm_scale=d ** -0.5,
    )


def max_rows(case):
    return int((case["q_indptr"][1:] - case["q_indptr"][:-1]).max())


def oracle(case, **kw):
    f64 = {k: case[k].double() for k in ("q", "k_buffer", "v_buffer")}
    return positional_attention_reference(**{**case, **f64}, **kw)


def run_kernel(case, **kw):
    q, v = case["q"], case["v_buffer"]
    out = torch.full((q.shape[0], q.shape[1], v.shape[2]), float("nan"), dtype=q.dtype)
    res = positional_attention(**case, max_q_len=kw.pop("max_q_len", max_rows(case)), out=out, **kw)
    assert res.data_ptr() == out.data_ptr()
    assert torch.isfinite(res).all(), "non-finite output"
    return res


def rel_err(got, ref):
    return float((got.double() - ref).abs().max()) / max(float(ref.abs().max()), 1e-30)


def visible_mask(qp, kp, window):
    """[m, n] visibility written as the task states it, one pair at a time."""
    return torch.tensor([[k <= p and (window < 0 or k >= p - window) for k in kp.tolist()]
                         for p in qp.tolist()], dtype=torch.bool)


# ---------------------------------------------------------------------------
# the reference against a dense masked softmax
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("window,cap", [(-1, 0.0), (5, 0.0), (3, 4.0)])
def test_reference_matches_dense_softmax(window, cap):
    case = make_case(1, [(9, 4), (0, 6), (20, 1)], 4, 2, 16, dv=12, dtype=FP32, q_scale=3.0,
                     shuffle_keys=True)
    ref = oracle(case, window=window, logit_cap=cap)
    qi, ki = case["q_indptr"].tolist(), case["kv_indptr"].tolist()
    # one [Nq, Nk] matrix over the whole batch: another request's keys are masked too
    req_q = torch.repeat_interleave(torch.arange(len(qi) - 1), torch.tensor(qi).diff())
    req_k = torch.repeat_interleave(torch.arange(len(ki) - 1), torch.tensor(ki).diff())
    qp, kp = case["q_pos"].long(), case["kv_pos"].long()
    mask = (req_q[:, None] == req_k[None, :]) & (kp[None, :] <= qp[:, None])
    if window >= 0:
        mask &= kp[None, :] >= qp[:, None] - window
    slots = case["kv_indices"].long()
    keys = case["k_buffer"].double()[slots]  # [Nk, Hkv, D]
    values = case["v_buffer"].double()[slots]
    want = torch.empty_like(ref)
    for h in range(4):
        s = case["q"].double()[:, h] @ keys[:, h // 2].T * case["sm_scale"]
        if cap > 0:
            s = cap * torch.tanh(s / cap)
        want[:, h] = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ values[:, h // 2]
    assert mask.any(dim=1).all()  # every row sees itself
    assert torch.allclose(ref, want, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------
# the kernel against the reference
# ---------------------------------------------------------------------------

# decode (1 row), more rows than BLOCK_M (16), no prefix, a long prefix
REQS = [(30, 1), (40, 37), (0, 20), (100, 5)]


@pytest.mark.parametrize(
    "hq,hkv,d,dv,dtype,idx_dtype,window,cap",
    [
        (4, 2, 64, 64, BF16, torch.int32, -1, 0.0),
        (4, 4, 64, 64, BF16, torch.int64, 7, 0.0),
        (4, 2, 80, 80, BF16, torch.int32, 1, 0.0),
        (4, 2, 80, 80, FP16, torch.int64, 1000, 0.0),  # window longer than every sequence
        (4, 2, 64, 40, FP32, torch.int32, 7, 0.0),  # Dv != D
        (4, 4, 80, 80, FP32, torch.int64, -1, 0.0),
        (4, 2, 64, 64, BF16, torch.int64, 7, 3.0),  # logit cap
        (4, 2, 80, 80, FP32, torch.int32, -1, 2.0),
    ],
)
def test_matches_reference(hq, hkv, d, dv, dtype, idx_dtype, window, cap):
    case = make_case(hq * 100 + d + dv + window, REQS, hq, hkv, d, dv, dtype, idx_dtype,
                     q_scale=4.0 if cap else 1.5, shuffle_keys=idx_dtype == torch.int64)
    got = run_kernel(case, window=window, logit_cap=cap)
    ref = oracle(case, window=window, logit_cap=cap)
    err = rel_err(got, ref)
    print(f"max|got-ref|/max|ref| = {err:.2e} ({dtype}, window {window}, cap {cap})")
    assert err < BOUND[dtype], err
    if cap:  # the cap changes the answer: the comparison above would catch a kernel ignoring it
        assert rel_err(oracle(case, window=window), ref) > 10 * BOUND[dtype]
    if idx_dtype == torch.int32:  # keys in position order: the bounded loop, same answer
        sorted_err = rel_err(run_kernel(case, window=window, logit_cap=cap, kv_sorted=True), ref)
        assert sorted_err < BOUND[dtype], sorted_err


@pytest.mark.parametrize("window", [1, 7, 64])
@pytest.mark.parametrize("gaps", [False, True])
def test_window_boundary_brute_force(window, gaps):
    """Uniform logits (q = 0) and one-hot values: out[i] is 1/count on exactly the keys row i
    sees.  With every position present, the key at p - W is seen and the one at p - W - 1 not."""
    g = torch.Generator().manual_seed(window + 100 * gaps)
    n = 40
    pos = torch.sort(torch.randperm(2 * n, generator=g)[:n]).values if gaps else torch.arange(n)
    slots = torch.randperm(n + 9, generator=g)[:n]
    v = torch.zeros(n + 9, 1, n)
    v[slots, 0, torch.arange(n)] = 1.0  # key j (entry j) carries feature j
    case = dict(q=torch.zeros(n, 2, 16), q_pos=pos.clone(), q_indptr=torch.tensor([0, n]),
                k_buffer=torch.randn(n + 9, 1, 16, generator=g), v_buffer=v,
                kv_indptr=torch.tensor([0, n]), kv_indices=slots, kv_pos=pos.clone(), sm_scale=0.125)
    got = run_kernel(case, window=window)
    seen = got[:, 0] > 0  # [row, key]
    want = visible_mask(pos, pos, window)
    assert torch.equal(seen, want)
    assert torch.equal(run_kernel(case, window=window, kv_sorted=True), got)
    assert torch.equal(got[:, 0], got[:, 1])
    assert torch.allclose(got[:, 0].sum(dim=1), torch.ones(n))
    if not gaps:
        for p in range(window + 1, n):
            assert seen[p, p - window] and not seen[p, p - window - 1]
    assert rel_err(got, oracle(case, window=window)) < BOUND[FP32]


@pytest.mark.parametrize("window", [-1, 3])
def test_rows_without_visible_keys_are_zero(window):
    """Request 0's queries come before all its keys; request 2's rows are 10 positions after
    its keys (all outside a window of 3); request 3 has rows but no key at all."""
    case = make_case(5, [(20, 8), (30, 3), (12, 4), (0, 2)], 4, 2, 64, dtype=BF16)
    qi, ki = case["q_indptr"].tolist(), case["kv_indptr"].tolist()
    case["kv_pos"][ki[0]:ki[1]] += 1000
    case["q_pos"][qi[2]:qi[3]] = case["kv_pos"][ki[2]:ki[3]].max() + 10 + torch.arange(4)
    case["kv_indptr"][4] = case["kv_indptr"][3]  # request 3: no keys
    got = run_kernel(case, window=window)
    ref = oracle(case, window=window)
    assert (got[qi[0]:qi[1]] == 0).all()
    assert (got[qi[3]:qi[4]] == 0).all()
    assert (got[qi[2]:qi[3]] == 0).all() == (window >= 0)
    assert rel_err(got, ref) < BOUND[BF16]


def test_tiles_grid_and_empty_requests():
    """Small tiles (many key and row tiles), requests without rows or keys, a grid sized for
    more rows than any request has (as a CUDA graph captured for a larger batch): the same
    answer, and rows no request owns left untouched."""
    mod = importlib.import_module(f"{K.__name__}.positional_triton")
    case = make_case(6, [(50, 40), (10, 0), (0, 0), (3, 17)], 4, 2, 64, dtype=FP32)
    case["q"] = torch.cat([case["q"], torch.randn(3, 4, 64)])  # 3 trailing rows no request owns
    case["q_pos"] = torch.cat([case["q_pos"], torch.zeros(3, dtype=case["q_pos"].dtype)])
    ref = oracle(case, window=9)
    for kw in (dict(block_m=16, block_n=16), dict(block_m=32, block_n=64), dict(),
               dict(block_m=16, block_n=16, kv_sorted=True), dict(kv_sorted=True)):
        out = torch.full((case["q"].shape[0], 4, 64), float("nan"))
        got = mod.positional_attention_triton(**case, window=9, max_q_len=70, out=out, **kw)
        assert torch.isnan(got[-3:]).all()
        assert rel_err(got[:-3], ref[:-3]) < BOUND[FP32], kw
    fresh = mod.positional_attention_triton(**case, window=9, max_q_len=40)
    assert (fresh[-3:] == 0).all() and rel_err(fresh, ref) < BOUND[FP32]


def test_reference_dispatch():
    case = make_case(7, [(5, 3), (0, 4)], 2, 1, 16, dtype=FP32)
    out = torch.full((7, 2, 16), float("nan"))
    got = K.positional_attention(**case, window=2, out=out, path="reference")
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got, positional_attention_reference(**case, window=2))
    assert rel_err(positional_attention(**case, window=2), oracle(case, window=2)) < BOUND[FP32]


@pytest.mark.parametrize("window", [-1, 5, 40])
def test_sorted_keys_bound_the_loop_to_the_window(window):
    """Long requests in small tiles, keys in position order: the loop bounded by the binary
    searches (`kv_sorted`) answers as the full loop, for rows whose window starts before,
    inside and after the prefix; and the bounds are in force: keys listed out of order under
    the promise change the answer."""
    mod = importlib.import_module(f"{K.__name__}.positional_triton")
    case = make_case(11, [(150, 90), (0, 70), (60, 1), (5, 33)], 4, 2, 32, dtype=FP32)
    ref = oracle(case, window=window)
    for kw in (dict(block_m=16, block_n=16), dict(block_m=32, block_n=32)):
        got = mod.positional_attention_triton(**case, window=window, max_q_len=90,
                                              kv_sorted=True, **kw)
        assert torch.isfinite(got).all() and rel_err(got, ref) < BOUND[FP32], kw
    shuffled = make_case(11, [(150, 90), (0, 70), (60, 1), (5, 33)], 4, 2, 32, dtype=FP32,
                         shuffle_keys=True)
    broken = mod.positional_attention_triton(**shuffled, window=window, max_q_len=90,
                                             kv_sorted=True, block_m=16, block_n=16)
    assert rel_err(broken, oracle(shuffled, window=window)) > 100 * BOUND[FP32]


# ---------------------------------------------------------------------------
# attention sinks (gpt-oss): a logit per query head in every row's softmax denominator
# ---------------------------------------------------------------------------


def _fresh_seed() -> int:
    """A seed drawn anew each run (printed, and named in every failure message)."""
    seed = random.SystemRandom().randrange(2**31)
    print(f"seed {seed}")
    return seed


def _sinks(seed, hq, scale):
    return torch.randn(hq, generator=torch.Generator().manual_seed(seed + 1)) * scale


@pytest.mark.parametrize("window", [-1, 4])
def test_reference_sinks_match_softmax_with_a_sink_column(window):
    """The reference with sinks against attention written out with the sink as one more
    logit column per head (softmax over [logits, sink], the sink's column then left out)."""
    seed = _fresh_seed()
    case = make_case(seed, [(9, 4), (0, 6), (20, 1)], 4, 2, 16, dv=12, dtype=FP32, q_scale=3.0,
                     shuffle_keys=True)
    sinks = _sinks(seed, 4, 3.0)
    ref = oracle(case, window=window, sinks=sinks)
    qi, ki = case["q_indptr"].tolist(), case["kv_indptr"].tolist()
    slots = case["kv_indices"].long()
    want = torch.empty_like(ref)
    for b in range(len(qi) - 1):
        qp = case["q_pos"][qi[b]:qi[b + 1]].long()
        kp = case["kv_pos"][ki[b]:ki[b + 1]].long()
        mask = visible_mask(qp, kp, window)
        keys = case["k_buffer"].double()[slots[ki[b]:ki[b + 1]]]
        values = case["v_buffer"].double()[slots[ki[b]:ki[b + 1]]]
        for h in range(4):
            s = case["q"].double()[qi[b]:qi[b + 1], h] @ keys[:, h // 2].T * case["sm_scale"]
            s = s.masked_fill(~mask, float("-inf"))
            with_sink = torch.cat([s, sinks[h].double().expand(s.shape[0], 1)], dim=1)
            want[qi[b]:qi[b + 1], h] = torch.softmax(with_sink, dim=1)[:, :-1] @ values[:, h // 2]
    assert torch.allclose(ref, want, rtol=1e-12, atol=1e-12), seed
    # the sinks take mass: without them the answer differs
    assert rel_err(oracle(case, window=window), ref) > 1e-3, seed


@pytest.mark.parametrize("dtype,window,sink_scale", [
    (BF16, -1, 2.0), (BF16, 7, 2.0), (FP32, 7, 20.0),  # sinks far above every logit
    (FP32, -1, 2.0), (FP16, 1000, 2.0)])
def test_sinks_match_reference(dtype, window, sink_scale):
    """The kernel with sinks, on fresh random inputs, against the float64 reference; keys in
    any order and in position order (the bounded loop)."""
    seed = _fresh_seed()
    case = make_case(seed, REQS, 4, 2, 64, dtype=dtype, q_scale=1.5)
    sinks = _sinks(seed, 4, sink_scale).to(dtype)
    ref = oracle(case, window=window, sinks=sinks)
    for sorted_keys in (False, True):
        err = rel_err(run_kernel(case, window=window, sinks=sinks, kv_sorted=sorted_keys), ref)
        assert err < BOUND[dtype], (seed, sorted_keys, err)
    # a kernel that left the sinks out would fail the comparison above
    assert rel_err(oracle(case, window=window), ref) > 10 * BOUND[dtype], seed


def test_rows_without_visible_keys_stay_zero_with_sinks():
    case = make_case(8, [(20, 8), (0, 2)], 4, 2, 64, dtype=FP32)
    qi, ki = case["q_indptr"].tolist(), case["kv_indptr"].tolist()
    case["kv_pos"][ki[0]:ki[1]] += 1000  # request 0's rows come before all its keys
    case["kv_indptr"][2] = case["kv_indptr"][1]  # request 1: no keys
    sinks = torch.tensor([3.0, -3.0, 0.0, 30.0])
    got = run_kernel(case, sinks=sinks)
    assert (got == 0).all()
    assert (oracle(case, sinks=sinks) == 0).all()
