"""CPU tests of block-sparse prefill attention: the estimate's mask, the float64 reference and the
Triton kernel (under the interpreter: tests/triton_interpreter.py, imported first, decides
whether this process runs it or ``test_cpu_suite_in_subprocess`` re-runs the file).

Inputs are fresh random tensors of several seeds; the dense oracle is torch's
scaled_dot_product_attention in float64 with an explicit bottom-right causal mask.
"""

import importlib
import math

import pytest
import torch

from triton_interpreter import RUN_IN_PROCESS, SKIP_REASON, subprocess_suite  # before triton

import uniprefill_sglang.kernels as K  # noqa: E402
from uniprefill_sglang.kernels.block_sparse_reference import (  # noqa: E402
    block_density,
    block_grid,
    block_lists_from_mask,
    block_mask_reference,
    block_mass_estimate,
    block_rows_from_mask,
    block_sparse_attention_gathered,
    block_sparse_attention_reference,
    causal_block_pairs,
    forced_blocks,
    last_query_block_mass,
    select_blocks,
)
from uniprefill_sglang.kernels.reference import num_blocks_for_ratio  # noqa: E402

# the interpreter converts 1-element arrays with int(): numpy DeprecationWarning noise
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# (n_q, n_k, Hq, Hkv, q_offset): GQA and MHA, a chunk after a prefix (n_q < n_k) and a whole
# prompt (n_q == n_k), lengths off the block size, a chunk starting mid-block, queries that are
# not the last keys
SHAPES = [
    (37, 70, 4, 2, None),
    (50, 50, 2, 2, None),
    (21, 90, 6, 2, 40),
    (33, 33, 4, 1, None),
    (16, 80, 2, 1, 48),
]
SEEDS = [0, 1, 2]


test_cpu_suite_in_subprocess = subprocess_suite(__file__)


@pytest.fixture(scope="module")
def bst():
    """The Triton module, imported in interpreter mode."""
    if not RUN_IN_PROCESS:
        pytest.skip(SKIP_REASON)
    mod = importlib.import_module(f"{K.__name__}.block_sparse_triton")
    assert mod.INTERPRETED, "Triton interpreter mode is not active"
    return mod


def make_qkv(seed, n_q, n_k, hq, hkv, d=32, dv=None, dtype=torch.float32, q_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv
    q = (torch.randn(n_q, hq, d, generator=g) * q_scale).to(dtype)
    k = torch.randn(n_k, hkv, d, generator=g).to(dtype)
    v = torch.randn(n_k, hkv, dv, generator=g).to(dtype)
    return q, k, v


def dense_causal(q, k, v, sm_scale, q_offset=None):
    """Dense causal attention in float64 (torch's SDPA), queries bottom-right aligned."""
    n_q, hq, _ = q.shape
    n_k, hkv, _ = k.shape
    q_offset = n_k - n_q if q_offset is None else q_offset
    g = hq // hkv
    qq = q.double().transpose(0, 1)
    kk = k.double().repeat_interleave(g, 1).transpose(0, 1)
    vv = v.double().repeat_interleave(g, 1).transpose(0, 1)
    allowed = torch.arange(n_k)[None, :] <= (q_offset + torch.arange(n_q))[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=allowed, scale=sm_scale)
    return out.transpose(0, 1)


def assert_close(got, ref, rtol, atol_rel):
    assert torch.isfinite(got).all(), "non-finite output"
    got, ref = got.double(), ref.double()
    err = (got - ref).abs()
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    bound = atol_rel * max(1.0, scale) + rtol * ref.abs()
    bad = err > bound
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} off; worst {float(err.max()):.3e}"


TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1e-2, 1e-2)}


def random_mask(seed, heads, n_q, n_k, block_size, q_offset, p=0.4, keep_diagonal=True):
    a0, nr, nc = block_grid(n_q, n_k, block_size, q_offset)
    g = torch.Generator().manual_seed(seed + 7919)
    mask = torch.rand(heads, nr, nc, generator=g) < p
    if keep_diagonal:
        mask[:, torch.arange(nr), a0 + torch.arange(nr)] = True
    return mask


# ---------------------------------------------------------------------------
# (a) every block kept = dense causal attention
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block_size", [16, 5, 1])
def test_reference_all_blocks_is_dense(seed, shape, block_size):
    n_q, n_k, hq, hkv, off = shape
    q, k, v = make_qkv(seed, n_q, n_k, hq, hkv, q_scale=2.0)
    _, nr, nc = block_grid(n_q, n_k, block_size, off)
    ref = dense_causal(q, k, v, 0.2, off)
    for mask in (torch.ones(hkv, nr, nc, dtype=torch.bool),  # future blocks too: the token mask
                 causal_block_pairs(n_q, n_k, block_size, off)[None]):  # shared, causal blocks only
        got = block_sparse_attention_reference(q, k, v, mask, block_size, 0.2, q_offset=off, row_chunk=7)
        assert_close(got, ref, 1e-12, 1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_all_blocks_is_dense(bst, shape, dtype):
    n_q, n_k, hq, hkv, off = shape
    q, k, v = make_qkv(11, n_q, n_k, hq, hkv, dtype=dtype)
    _, nr, nc = block_grid(n_q, n_k, 16, off)
    mask = torch.ones(hkv, nr, nc, dtype=torch.bool)
    got = bst.block_sparse_attention_triton(q, k, v, mask, 16, 32 ** -0.5, q_offset=off)
    assert got.dtype == dtype
    assert_close(got, dense_causal(q, k, v, 32 ** -0.5, off), *TOL[dtype])


# ---------------------------------------------------------------------------
# (b) the Triton kernel matches the reference
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_random_masks(bst, shape, dtype):
    n_q, n_k, hq, hkv, off = shape
    for seed, shared in ((3, False), (4, True)):
        q, k, v = make_qkv(seed, n_q, n_k, hq, hkv, dtype=dtype, q_scale=1.5)
        mask = random_mask(seed, 1 if shared else hkv, n_q, n_k, 16, off)
        out = torch.full((n_q, hq, 32), float("nan"), dtype=dtype)  # every row must be written
        got = bst.block_sparse_attention_triton(q, k, v, mask, 16, 32 ** -0.5, q_offset=off, out=out)
        assert got.data_ptr() == out.data_ptr()
        ref = block_sparse_attention_reference(q, k, v, mask, 16, 32 ** -0.5, q_offset=off)
        assert_close(got, ref, *TOL[dtype])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("select", [dict(top_p=0.6), dict(density=0.3), dict(top_p=0.9, per_kv_head=False)])
def test_triton_estimate_masks(bst, shape, select):
    n_q, n_k, hq, hkv, off = shape
    q, k, v = make_qkv(5, n_q, n_k, hq, hkv, dtype=torch.bfloat16, q_scale=3.0)
    mask = block_mask_reference(q, k, 16, q_offset=off, sink_blocks=1, local_blocks=2, **select)
    got = bst.block_sparse_attention_triton(q, k, v, mask, 16, 32 ** -0.5, q_offset=off)
    ref = block_sparse_attention_reference(q, k, v, mask, 16, 32 ** -0.5, q_offset=off)
    assert_close(got, ref, *TOL[torch.bfloat16])


@pytest.mark.parametrize("heads_per_tile", [1, 2, 4])
def test_triton_heads_per_tile_same_answer(bst, heads_per_tile):
    """Query heads of one KV head stacked in one tile: the answer of one head per program."""
    q, k, v = make_qkv(23, 45, 120, 8, 2, dtype=torch.bfloat16, q_scale=2.0)
    for shared in (False, True):
        mask = random_mask(23, 1 if shared else 2, 45, 120, 16, None)
        got = bst.block_sparse_attention_triton(q, k, v, mask, 16, 32 ** -0.5) if heads_per_tile == 4 \
            else bst.block_sparse_attention_from_lists(q, k, v, *block_lists_from_mask(mask), mask.shape[0],
                                                       16, 32 ** -0.5, heads_per_tile=heads_per_tile)
        ref = block_sparse_attention_reference(q, k, v, mask, 16, 32 ** -0.5)
        assert_close(got, ref, *TOL[torch.bfloat16])
    with pytest.raises(ValueError, match="heads_per_tile"):
        bst.block_sparse_attention_from_lists(q, k, v, *block_lists_from_mask(mask), 1, 16, 0.1,
                                              heads_per_tile=3)


def test_triton_strided_inputs_block_32_and_non_causal(bst):
    """q, k, v as column slices of one fused projection; a 32 block; causal off (mask as is);
    a value head dim unlike the key's."""
    g = torch.Generator().manual_seed(9)
    n_q, n_k, hq, hkv, d, dv = 40, 100, 4, 2, 32, 16
    qkv = torch.randn(n_k, hq * d + hkv * d + hkv * dv, generator=g, dtype=torch.float16)
    q = qkv[n_k - n_q:, :hq * d].view(n_q, hq, d)
    k = qkv[:, hq * d:hq * d + hkv * d].view(n_k, hkv, d)
    v = qkv[:, hq * d + hkv * d:].view(n_k, hkv, dv)
    assert not q.is_contiguous()
    for causal in (True, False):
        mask = random_mask(9, hkv, n_q, n_k, 32, None, p=0.5)
        got = bst.block_sparse_attention_triton(q, k, v, mask, 32, 0.3, causal=causal)
        ref = block_sparse_attention_reference(q, k, v, mask, 32, 0.3, causal=causal)
        assert_close(got, ref, *TOL[torch.float16])


def test_triton_block_64_longer_chunk(bst):
    """The GPU's block size: a 64-row query tile, D = 64, a chunk after a 100-key prefix."""
    q, k, v = make_qkv(17, 150, 250, 4, 1, d=64, dtype=torch.bfloat16, q_scale=2.0)
    for select in (dict(density=0.5), dict(top_p=0.8)):
        mask = block_mask_reference(q, k, 64, sink_blocks=1, local_blocks=1, **select)
        got = bst.block_sparse_attention_triton(q, k, v, mask, 64, 0.125)
        assert_close(got, block_sparse_attention_reference(q, k, v, mask, 64, 0.125), *TOL[torch.bfloat16])


@pytest.mark.parametrize("n_q,n_k", [(0, 0), (0, 5), (1, 1), (3, 3), (2, 40)])
def test_tiny_and_empty_chunks(bst, n_q, n_k):
    q, k, v = make_qkv(19, n_q, n_k, 2, 1, d=16)
    for select in (dict(top_p=0.5), dict(density=0.5)):
        mask = block_mask_reference(q, k, 16, **select)
        a0, nr, nc = block_grid(n_q, n_k, 16)
        assert mask.shape == (1, nr, nc)
        assert 0.0 < block_density(mask, n_q, n_k, 16) <= 1.0
        ref = block_sparse_attention_reference(q, k, v, mask, 16, 0.25)
        got = bst.block_sparse_attention_triton(q, k, v, mask, 16, 0.25)
        assert ref.shape == got.shape == (n_q, 2, 16)
        assert_close(got, ref, *TOL[torch.float32])
        if n_k <= 16:  # a single causal block, always kept: dense
            assert_close(ref, dense_causal(q, k, v, 0.25), 1e-12, 1e-12)


def test_public_dispatch(bst):
    q, k, v = make_qkv(13, 37, 70, 4, 2, dtype=torch.float16)
    mask = block_mask_reference(q, k, 16, top_p=0.8)
    tri = K.block_sparse_attention(q, k, v, mask, 16, 0.2, path="triton")
    ref = K.block_sparse_attention(q, k, v, mask, 16, 0.2, path="reference")
    assert tri.dtype == ref.dtype == torch.float16
    assert_close(tri, block_sparse_attention_reference(q, k, v, mask, 16, 0.2), *TOL[torch.float16])
    assert_close(ref, block_sparse_attention_reference(q, k, v, mask, 16, 0.2), 1e-3, 1e-3)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block_size", [16, 5, 1])
def test_gathered_torch_path_matches_the_reference(seed, shape, block_size):
    """The CPU path (kept key blocks gathered per query block) computes the oracle's answer:
    per-KV-head and shared masks, random ones with empty rows (zeros), the estimate's, causal or
    not, in float32 and from half-precision inputs."""
    n_q, n_k, hq, hkv, off = shape
    q, k, v = make_qkv(seed, n_q, n_k, hq, hkv, dv=24)
    masks = [random_mask(seed, heads, n_q, n_k, block_size, off, p=0.3, keep_diagonal=False)
             for heads in (hkv, 1)]
    masks.append(block_mask_reference(q, k, block_size, top_p=0.7, q_offset=off))
    for mask in masks:
        for causal in (True, False):
            ref = block_sparse_attention_reference(q, k, v, mask, block_size, 0.2, causal=causal,
                                                   q_offset=off)
            got = block_sparse_attention_gathered(q, k, v, mask, block_size, 0.2, causal=causal,
                                                  q_offset=off)
            assert got.dtype == torch.float32 and got.shape == ref.shape
            assert_close(got, ref, *TOL[torch.float32])
            assert ((ref == 0).all(-1) == (got == 0).all(-1)).all()  # the same rows read nothing
    half = [t.to(torch.float16) for t in (q, k, v)]
    got = K.block_sparse_attention(*half, masks[-1], block_size, 0.2, q_offset=off)
    assert got.dtype == torch.float16
    assert_close(got, block_sparse_attention_reference(*half, masks[-1], block_size, 0.2, q_offset=off),
                 *TOL[torch.float16])


@pytest.mark.parametrize("n_q,n_k", [(0, 0), (0, 5), (1, 1), (3, 3), (2, 40)])
def test_gathered_torch_path_tiny_and_empty_chunks(n_q, n_k):
    q, k, v = make_qkv(19, n_q, n_k, 2, 1, d=16)
    mask = block_mask_reference(q, k, 16, top_p=0.5)
    got = block_sparse_attention_gathered(q, k, v, mask, 16, 0.25)
    assert got.shape == (n_q, 2, 16)
    assert_close(got, block_sparse_attention_reference(q, k, v, mask, 16, 0.25), *TOL[torch.float32])


# ---------------------------------------------------------------------------
# (c) the estimate and the mask's invariants
# ---------------------------------------------------------------------------


def exact_probs(q, k, sm_scale, q_offset=None):
    """[Hq, n_q, n_k] causal attention probabilities in float64."""
    n_q, hq, _ = q.shape
    n_k, hkv, _ = k.shape
    q_offset = n_k - n_q if q_offset is None else q_offset
    logits = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(hq // hkv, 1)) * sm_scale
    allowed = torch.arange(n_k)[None, :] <= (q_offset + torch.arange(n_q))[:, None]
    return torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_estimate_with_unit_blocks_is_exact_attention(seed, shape):
    """Pooling one token is the token: the estimate is the attention, averaged over the group."""
    n_q, n_k, hq, hkv, off = shape
    q, k, _ = make_qkv(seed, n_q, n_k, hq, hkv, q_scale=2.0)
    probs = exact_probs(q, k, 0.25, off)
    est = block_mass_estimate(q, k, 1, sm_scale=0.25, q_offset=off)
    want = probs.reshape(hkv, hq // hkv, n_q, n_k).mean(1)
    assert torch.allclose(est, want, rtol=1e-12, atol=1e-14)
    shared = block_mass_estimate(q, k, 1, sm_scale=0.25, q_offset=off, per_kv_head=False)
    assert torch.allclose(shared[0], probs.mean(0), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block_size", [16, 7])
def test_estimate_rows_are_distributions(seed, shape, block_size):
    n_q, n_k, hq, hkv, off = shape
    q, k, _ = make_qkv(seed, n_q, n_k, hq, hkv, q_scale=3.0)
    est = block_mass_estimate(q, k, block_size, q_offset=off)
    causal = causal_block_pairs(n_q, n_k, block_size, off)
    assert est.dtype == torch.float64 and torch.isfinite(est).all()
    assert (est[:, ~causal] == 0).all()
    assert torch.allclose(est.sum(-1), torch.ones_like(est.sum(-1)), atol=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n,first_pos,block_size", [(64, 0, 16), (70, 0, 16), (5, 0, 16),
                                                     (70, 32, 16), (70, 40, 16), (33, 3, 7)])
def test_block_pooling_is_each_blocks_mean(seed, n, first_pos, block_size):
    """Pooled rows (the aligned view path and the scattered path) against a loop of means."""
    from uniprefill_sglang.kernels.block_sparse_reference import _pool_rows

    x = torch.randn(n, 3, 8, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    first_block = first_pos // block_size
    n_blocks = (first_pos + n - 1) // block_size - first_block + 1
    got = _pool_rows(x, first_pos, block_size, n_blocks, first_block)
    assert got.dtype == torch.float64 and got.shape == (3, n_blocks, 8)
    for b in range(n_blocks):
        lo = max(0, (first_block + b) * block_size - first_pos)
        hi = min(n, (first_block + b + 1) * block_size - first_pos)
        assert torch.allclose(got[:, b], x[lo:hi].double().mean(0), rtol=1e-12, atol=1e-14)


SELECTIONS = [dict(top_p=0.3), dict(top_p=0.9), dict(density=0.1), dict(density=0.5), dict(density=1.0)]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("select", SELECTIONS)
@pytest.mark.parametrize("sink,local,last", [(0, 1, 0), (1, 2, 0), (2, 3, 1)])
def test_mask_invariants(seed, shape, select, sink, local, last):
    n_q, n_k, hq, hkv, off = shape
    bs = 8
    q, k, _ = make_qkv(seed, n_q, n_k, hq, hkv, q_scale=2.0)
    mask = block_mask_reference(q, k, bs, sink_blocks=sink, local_blocks=local, last_blocks=last,
                                q_offset=off, **select)
    a0, nr, nc = block_grid(n_q, n_k, bs, off)
    assert mask.dtype == torch.bool and mask.shape == (hkv, nr, nc)
    causal = causal_block_pairs(n_q, n_k, bs, off)
    assert not (mask & ~causal).any(), "a block entirely in the future is kept"
    for r in range(nr):
        diag = a0 + r
        assert mask[:, r, max(0, diag - local + 1):diag + 1].all(), "a local block is dropped"
        assert mask[:, r, :min(sink, diag + 1)].all(), "a sink block is dropped"
        if r >= nr - last:
            assert mask[:, r, :diag + 1].all(), "a last query block is not dense"
    if "density" in select:
        forced = forced_blocks(n_q, n_k, bs, sink, local, last, off)
        n_causal = causal.sum(-1)
        for r in range(nr):
            want = max(int(forced[r].sum()), num_blocks_for_ratio(select["density"], int(n_causal[r])))
            assert (mask[:, r].sum(-1) == want).all(), (r, mask[:, r].sum(-1), want)
        assert block_density(mask, n_q, n_k, bs, off) >= select["density"] - 1e-12
    else:
        est = block_mass_estimate(q, k, bs, q_offset=off)
        kept_mass = (est * mask).sum(-1)
        assert (kept_mass >= select["top_p"] - 1e-12).all()
        # smallest: without its lightest estimate-chosen block, a row falls short of top_p
        forced = forced_blocks(n_q, n_k, bs, sink, local, last, off).expand_as(mask)
        chosen = mask & ~forced
        for h, r in zip(*torch.nonzero(chosen.any(-1), as_tuple=True)):
            lightest = est[h, r][chosen[h, r]].min()
            assert kept_mass[h, r] - lightest < select["top_p"]


def test_density_rounding():
    """ceil(density * causal blocks), at least one, with a slack for a density given in fp32."""
    n_k = 160  # 10 blocks of 16; the last query block has 10 causal blocks
    q, k, _ = make_qkv(0, 16, n_k, 2, 2)
    d32 = float(torch.tensor(0.3, dtype=torch.float32))  # 0.30000001192...
    for density, want in ((0.3, 3), (d32, 3), (0.31, 4), (0.01, 1), (1.0, 10)):
        mask = block_mask_reference(q, k, 16, density=density, sink_blocks=0, local_blocks=1)
        assert (mask.sum(-1) == want).all(), (density, mask.sum(-1))
        assert block_density(mask, 16, n_k, 16) == pytest.approx(want / 10)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_top_p_one_keeps_every_causal_block_and_grows_with_top_p(seed, shape):
    n_q, n_k, hq, hkv, off = shape
    q, k, _ = make_qkv(seed, n_q, n_k, hq, hkv, q_scale=3.0)
    causal = causal_block_pairs(n_q, n_k, 8, off)
    full = block_mask_reference(q, k, 8, top_p=1.0, sink_blocks=0, q_offset=off)
    assert torch.equal(full, causal.expand_as(full))
    assert block_density(full, n_q, n_k, 8, off) == 1.0
    prev = None
    for p in (0.1, 0.4, 0.7, 0.95, 1.0):
        m = block_mask_reference(q, k, 8, top_p=p, sink_blocks=0, q_offset=off)
        if prev is not None:
            assert not (prev & ~m).any(), "a larger top_p dropped a block"
        prev = m


@pytest.mark.parametrize("seed", SEEDS)
def test_peaked_input_keeps_few_blocks(seed):
    """Every query points at one key block: from it on, top_p < 1 keeps it and the forced blocks
    only (the rows before it see near-uniform blocks and keep them all)."""
    g = torch.Generator().manual_seed(seed)
    n, hq, hkv, d, bs = 128, 4, 2, 32, 16
    u = torch.randn(d, generator=g)
    u = u / u.norm()
    q = 0.1 * torch.randn(n, hq, d, generator=g) + 6.0 * u
    k = 0.1 * torch.randn(n, hkv, d, generator=g)
    hot = 3
    k[hot * bs:(hot + 1) * bs] += 6.0 * u
    mask = block_mask_reference(q, k, bs, top_p=0.9, sink_blocks=1, local_blocks=1)
    causal = causal_block_pairs(n, n, bs)
    forced = forced_blocks(n, n, bs, 1, 1)
    assert mask[:, hot:, hot].all(), "the hot block is dropped"
    want = forced.clone()
    want[hot:, hot] = True
    want[:hot] = causal[:hot]
    assert torch.equal(mask, want.expand_as(mask))
    assert int(mask.sum()) < int(causal.sum()) * hkv
    assert block_density(mask, n, n, bs) < 0.6


@pytest.mark.parametrize("seed", SEEDS)
def test_estimate_finds_planted_blocks(seed):
    """Each query block of each KV group attends to one far key block picked at random: the
    top_p mask keeps most of the exact attention mass at a low density, and the hot blocks."""
    g = torch.Generator().manual_seed(100 + seed)
    n_q, n_k, hq, hkv, d, bs = 96, 256, 4, 2, 32, 16
    off = n_k - n_q
    a0, nr, nc = block_grid(n_q, n_k, bs)
    dirs = torch.nn.functional.normalize(torch.randn(hkv, nc, d, generator=g), dim=-1)
    k = 0.3 * torch.randn(n_k, hkv, d, generator=g) + 8.0 * dirs.repeat_interleave(bs, 1).transpose(0, 1)
    hot = torch.stack([torch.randint(0, a0 + r, (hkv,), generator=g) for r in range(nr)], 1)  # [Hkv, R]
    q = 0.3 * torch.randn(n_q, hq, d, generator=g)
    rows = (off + torch.arange(n_q)) // bs - a0
    for h in range(hq):
        q[:, h] += 8.0 * dirs[h // (hq // hkv), hot[h // (hq // hkv), rows]]
    mask = block_mask_reference(q, k, bs, top_p=0.9, sink_blocks=1, local_blocks=1)
    assert mask[torch.arange(hkv)[:, None], torch.arange(nr)[None, :], hot].all(), "a planted block is dropped"
    assert block_density(mask, n_q, n_k, bs) < 0.3
    probs = exact_probs(q, k, d ** -0.5)  # [Hq, n_q, n_k]
    token_mask = mask[:, rows][:, :, torch.arange(n_k) // bs].repeat_interleave(hq // hkv, 0)
    kept = (probs * token_mask).sum(-1)
    assert float(kept.mean()) > 0.98 and float(kept.min()) > 0.9, (float(kept.mean()), float(kept.min()))


def last_query_mass_loop(q, k, block_size, last_queries, sm_scale, q_offset=None, shared=False):
    """``last_query_block_mass`` written out: one query, one head, one key at a time."""
    n_q, hq, _ = q.shape
    n_k, hkv, _ = k.shape
    off = n_k - n_q if q_offset is None else q_offset
    a0, nr, nc = block_grid(n_q, n_k, block_size, off)
    group, m = hq // hkv, min(last_queries, n_q)
    col = torch.zeros(hkv, nc, dtype=torch.float64)
    for h in range(hq):
        for i in range(n_q - m, n_q):
            seen = off + i + 1
            logits = [float(q[i, h].double() @ k[t, h // group].double()) * sm_scale for t in range(seen)]
            top = max(logits)
            weights = [math.exp(x - top) for x in logits]
            for t, w in enumerate(weights):
                col[h // group, t // block_size] += w / sum(weights) / (m * group)
    if shared:  # every head's mean (the groups have one size)
        col = col.mean(0, keepdim=True)
    out = torch.zeros(col.shape[0], nr, nc, dtype=torch.float64)
    for g in range(col.shape[0]):
        for r in range(nr):
            visible = col[g, :a0 + r + 1]
            out[g, r, :a0 + r + 1] = visible / visible.sum()
    return out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block_size, last_queries", [(16, 8), (7, 100), (16, 1)])
def test_last_query_mass_is_the_loop_and_rows_are_causal_distributions(seed, shape, block_size,
                                                                        last_queries):
    n_q, n_k, hq, hkv, off = shape
    q, k, _ = make_qkv(seed, n_q, n_k, hq, hkv, d=8, q_scale=3.0)
    mass = last_query_block_mass(q, k, block_size, last_queries, sm_scale=0.4, q_offset=off)
    causal = causal_block_pairs(n_q, n_k, block_size, off)
    assert mass.dtype == torch.float64 and mass.shape == (hkv, *causal.shape)
    assert torch.isfinite(mass).all() and (mass >= 0).all() and (mass[:, ~causal] == 0).all()
    assert torch.allclose(mass.sum(-1), torch.ones_like(mass.sum(-1)), atol=1e-12)
    want = last_query_mass_loop(q, k, block_size, last_queries, 0.4, off)
    assert torch.allclose(mass, want, rtol=1e-10, atol=1e-12)
    # one mask for every head: the mean over all heads, renormalised per row the same way
    shared = last_query_block_mass(q, k, block_size, last_queries, sm_scale=0.4, q_offset=off,
                                   per_kv_head=False)
    want = last_query_mass_loop(q, k, block_size, last_queries, 0.4, off, shared=True)
    assert shared.shape == want.shape == (1, *causal.shape)
    assert torch.allclose(shared, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_last_query_mass_in_float32_is_close_to_float64(seed, shape):
    """The accelerator's dtype: the same estimate within float32's rounding."""
    n_q, n_k, hq, hkv, off = shape
    q, k, _ = make_qkv(seed, n_q, n_k, hq, hkv, d=16, q_scale=3.0)
    want = last_query_block_mass(q, k, 16, 8, sm_scale=0.4, q_offset=off)
    got = last_query_block_mass(q, k, 16, 8, sm_scale=0.4, q_offset=off, dtype=torch.float32)
    assert got.dtype == torch.float64 and torch.isfinite(got).all()
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-6), float((got - want).abs().max())


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_pooled_estimate_in_float32_is_close_to_float64(seed, shape):
    """The pooled estimate in the accelerator's dtype: within float32's rounding, zero off the
    causal blocks, and a mask that keeps the float64 one's forced blocks and count per row."""
    n_q, n_k, hq, hkv, off = shape
    q, k, _ = make_qkv(seed, n_q, n_k, hq, hkv, d=16, q_scale=3.0)
    want = block_mass_estimate(q, k, 16, sm_scale=0.4, q_offset=off)
    got = block_mass_estimate(q, k, 16, sm_scale=0.4, q_offset=off, dtype=torch.float32)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-6), float((got.double() - want).abs().max())
    kw = dict(q_offset=off, sink_blocks=1, local_blocks=2, density=0.4, sm_scale=0.4)
    mask32 = block_mask_reference(q, k, 16, estimate_dtype=torch.float32, **kw)
    mask64 = block_mask_reference(q, k, 16, **kw)
    forced = forced_blocks(n_q, n_k, 16, 1, 2, q_offset=off)
    assert torch.equal(mask32.sum(-1), mask64.sum(-1))
    assert (mask32 >= forced).all() and (mask32 <= causal_block_pairs(n_q, n_k, 16, off)).all()


def test_last_query_mass_with_no_queries_and_a_row_without_mass():
    q, k, _ = make_qkv(3, 0, 40, 2, 1)
    assert last_query_block_mass(q, k, 16, 8).shape == (1, 0, 3)
    # the last query reads only the last block: earlier rows' causal blocks got no mass (exp
    # underflows) and are uniform instead of NaN
    q, k, _ = make_qkv(4, 48, 48, 1, 1, d=4)
    k[:32] = 0.0
    k[32:] = 1.0
    q[:] = 1000.0
    mass = last_query_block_mass(q, k, 16, 1)
    assert torch.equal(mass[0, 0], torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    assert torch.equal(mass[0, 1], torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64))
    assert torch.equal(mass[0, 2], torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64))


@pytest.mark.parametrize("seed", SEEDS)
def test_last_queries_keep_a_needle_block_for_every_row(seed):
    """One needle key, which the chunk's last queries attend to, in a random far block: at top-p
    0.5 the last-query estimate keeps its block for every query block that sees it, at a low
    density; the pooled estimate averages the needle with its block's 15 random keys."""
    g = torch.Generator().manual_seed(200 + seed)
    n_q, n_k, hq, hkv, d, bs, last = 256, 256, 4, 2, 32, 16, 16
    q = torch.randn(n_q, hq, d, generator=g)
    k = torch.randn(n_k, hkv, d, generator=g)
    needle = int(torch.randint(bs, n_k - 4 * bs, (1,), generator=g))
    u = torch.nn.functional.normalize(torch.randn(d, generator=g), dim=0)
    k[needle] = 6.0 * u
    q[-last:] += 6.0 * u  # logit 36 / sqrt(32) ~ 6.4 above the others
    c = needle // bs
    rows = torch.arange(c, n_k // bs)  # the query blocks that see the needle's block
    for estimate in ("last_queries", "both"):
        mask = block_mask_reference(q, k, bs, top_p=0.5, estimate=estimate, last_queries=last)
        assert mask[:, rows, c].all(), (estimate, needle)
    lq = block_mask_reference(q, k, bs, top_p=0.5, estimate="last_queries", last_queries=last)
    assert block_density(lq, n_q, n_k, bs) < 0.4
    pooled = block_mask_reference(q, k, bs, top_p=0.5)
    assert not pooled[:, rows, c].all()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("select", [dict(top_p=0.7), dict(density=0.4)])
def test_estimate_argument_selects_each_estimate_and_their_union(seed, shape, select):
    n_q, n_k, hq, hkv, off = shape
    q, k, _ = make_qkv(seed, n_q, n_k, hq, hkv, q_scale=3.0)
    kw = dict(sink_blocks=1, local_blocks=1, q_offset=off, **select)
    forced = forced_blocks(n_q, n_k, 16, 1, 1, 0, off)
    causal = causal_block_pairs(n_q, n_k, 16, off)
    pooled = block_mask_reference(q, k, 16, **kw)
    assert torch.equal(block_mask_reference(q, k, 16, estimate="pooled", **kw), pooled)
    last = block_mask_reference(q, k, 16, estimate="last_queries", last_queries=8, **kw)
    want = select_blocks(last_query_block_mass(q, k, 16, 8, q_offset=off), forced, causal, **select)
    assert torch.equal(last, want)
    both = block_mask_reference(q, k, 16, estimate="both", last_queries=8, **kw)
    assert torch.equal(both, pooled | last)
    with pytest.raises(ValueError, match="estimate must be one of"):
        block_mask_reference(q, k, 16, estimate="mean", **kw)


def test_block_lists_round_trip():
    mask = random_mask(1, 3, 50, 120, 16, None, p=0.3, keep_diagonal=False)
    indptr, indices = block_lists_from_mask(mask)
    assert indptr.dtype == indices.dtype == torch.int32
    assert indptr[0] == 0 and indptr[-1] == mask.sum() == indices.numel()
    rebuilt = torch.zeros_like(mask).reshape(-1, mask.shape[2])
    for row in range(rebuilt.shape[0]):
        cols = indices[indptr[row]:indptr[row + 1]].long()
        assert (cols[1:] > cols[:-1]).all()
        rebuilt[row, cols] = True
    assert torch.equal(rebuilt.reshape(mask.shape), mask)


def test_block_rows_hold_the_csr_lists():
    """The padded lists (no host sync): each row's slice is the CSR row, ascending."""
    for seed in (2, 3):
        mask = random_mask(seed, 3, 50, 120, 16, None, p=0.3, keep_diagonal=False)
        mask[0, 1] = False  # a row that keeps nothing
        indptr, indices = block_lists_from_mask(mask)
        starts, ends, padded = block_rows_from_mask(mask)
        assert starts.dtype == ends.dtype == padded.dtype == torch.int32
        assert padded.numel() == mask.numel()
        assert torch.equal(ends - starts, indptr[1:] - indptr[:-1])
        for row in range(starts.numel()):
            assert torch.equal(padded[starts[row]:ends[row]], indices[indptr[row]:indptr[row + 1]])


# ---------------------------------------------------------------------------
# (d) NaN never passes
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_large_logits_and_empty_rows_stay_finite(bst, dtype):
    n_q, n_k, hq, hkv, off = 37, 70, 4, 2, None
    q, k, v = make_qkv(21, n_q, n_k, hq, hkv, dtype=dtype, q_scale=40.0)  # logits in the hundreds
    mask = block_mask_reference(q, k, 16, top_p=0.5)
    got = bst.block_sparse_attention_triton(q, k, v, mask, 16, 32 ** -0.5)
    ref = block_sparse_attention_reference(q, k, v, mask, 16, 32 ** -0.5)
    assert torch.isfinite(ref).all()
    assert_close(got, ref, *TOL[dtype])
    # a hand-made mask with an empty row (the estimate never makes one): zeros, not NaN
    empty = random_mask(2, hkv, n_q, n_k, 16, off)
    empty[0, 1] = False
    got = bst.block_sparse_attention_triton(q, k, v, empty, 16, 32 ** -0.5)
    ref = block_sparse_attention_reference(q, k, v, empty, 16, 32 ** -0.5)
    a0 = (n_k - n_q) // 16
    rows = ((n_k - n_q + torch.arange(n_q)) // 16 - a0) == 1
    assert (ref[rows, :hq // hkv] == 0).all() and (got[rows, :hq // hkv] == 0).all()
    assert_close(got, ref, *TOL[dtype])


def test_estimate_never_masks_a_row():
    for seed in SEEDS:
        for n_q, n_k, hq, hkv, off in SHAPES:
            q, k, v = make_qkv(seed, n_q, n_k, hq, hkv, q_scale=50.0)
            mask = block_mask_reference(q, k, 16, density=0.01, sink_blocks=0, q_offset=off)
            out = block_sparse_attention_reference(q, k, v, mask, 16, 32 ** -0.5, q_offset=off)
            assert torch.isfinite(out).all()
            assert (out.abs().sum(-1) > 0).all(), "a query row read no key"


# ---------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------


def test_bad_input_is_refused(bst):
    q, k, v = make_qkv(0, 37, 70, 4, 2)
    mask = block_mask_reference(q, k, 16, top_p=0.9)
    bad = [
        lambda: block_mask_reference(q, k, 16),  # neither top_p nor density
        lambda: block_mask_reference(q, k, 16, top_p=0.9, density=0.5),
        lambda: block_mask_reference(q, k, 16, density=0.0),
        lambda: block_mask_reference(q, k, 16, density=1.5),
        lambda: block_mask_reference(q, k, 16, top_p=0.0),
        lambda: block_mask_reference(q, k, 16, top_p=0.9, local_blocks=0),
        lambda: block_mask_reference(q, k, 16, top_p=0.9, sink_blocks=-1),
        lambda: block_mask_reference(q, k, 0, top_p=0.9),
        lambda: block_mask_reference(q, k, 16, top_p=0.9, q_offset=40),  # 40 + 37 > 70
        lambda: block_mask_reference(k, q, 16, top_p=0.9),  # more queries than keys
        lambda: block_mask_reference(q[:, :3], k, 16, top_p=0.9),  # 3 heads over 2 kv heads
        lambda: block_sparse_attention_reference(q, k, v, mask[:, 1:], 16, 0.2),
        lambda: block_sparse_attention_reference(q, k, v, mask.int(), 16, 0.2),
        lambda: block_sparse_attention_reference(q, k, v, torch.cat([mask, mask[:1]]), 16, 0.2),
        lambda: bst.block_sparse_attention_triton(q, k, v, block_mask_reference(q, k, 8, top_p=0.9), 8, 0.2),
        lambda: bst.block_sparse_attention_triton(q, k.half(), v, mask, 16, 0.2),
        lambda: bst.block_sparse_attention_triton(q, k, v[:, :1], mask, 16, 0.2),
    ]
    for i, call in enumerate(bad):
        with pytest.raises(ValueError):
            call()
            pytest.fail(f"bad input {i} accepted")
