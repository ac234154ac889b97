"""CUDA tests of the block-sparse attention kernel (skipped without CUDA).

Run in a pytest process of its own (no ``TRITON_INTERPRET``):

    pytest tests/gpu/test_block_sparse_gpu.py -q

Fresh random inputs at the serving shapes (GQA 32/8, head dim 128, block 64 and 128, a chunk
after a prefix); oracle: ``block_sparse_attention_reference`` in float64 on the GPU, and with
every causal block kept, dense causal attention (torch SDPA in float64).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA not available", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET", "0") == "1":
    pytest.skip("TRITON_INTERPRET=1 in this process: run the GPU tests in a separate pytest process",
                allow_module_level=True)

from uniprefill_sglang.kernels import block_sparse_triton as bst  # noqa: E402
from uniprefill_sglang.kernels.block_sparse_reference import (  # noqa: E402
    block_sparse_attention_reference,
    block_mask_reference,
    causal_block_pairs,
)

if bst.INTERPRETED:
    pytest.skip("the kernel was imported in interpreter mode", allow_module_level=True)

DEV = torch.device("cuda")
# (n_q, n_k, Hq, Hkv, D): a whole prompt, a chunk after a prefix off the block size, MHA
SHAPES = [(1024, 1024, 32, 8, 128), (777, 3000, 32, 8, 128), (512, 2100, 8, 8, 64)]


def qkv(seed, n_q, n_k, hq, hkv, d, dtype=torch.bfloat16, q_scale=1.5):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = (torch.randn(n_q, hq, d, generator=g, device=DEV) * q_scale).to(dtype)
    k = torch.randn(n_k, hkv, d, generator=g, device=DEV).to(dtype)
    v = torch.randn(n_k, hkv, d, generator=g, device=DEV).to(dtype)
    return q, k, v


def assert_close(got, ref, rel):
    assert torch.isfinite(got).all(), "non-finite output"
    err = (got.double() - ref.double()).abs()
    bound = rel * max(1.0, float(ref.abs().max())) + rel * ref.double().abs()
    assert not (err > bound).any(), f"{int((err > bound).sum())} off; worst {float(err.max()):.3e}"


def dense_causal(q, k, v, sm_scale):
    n_q, hq, _ = q.shape
    n_k, hkv, _ = k.shape
    g = hq // hkv
    allowed = torch.arange(n_k, device=DEV)[None, :] <= (n_k - n_q + torch.arange(n_q, device=DEV))[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.double().transpose(0, 1), k.double().repeat_interleave(g, 1).transpose(0, 1),
        v.double().repeat_interleave(g, 1).transpose(0, 1), attn_mask=allowed, scale=sm_scale)
    return out.transpose(0, 1)


@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize("shape", SHAPES)
def test_every_causal_block_is_dense(shape, block_size):
    n_q, n_k, hq, hkv, d = shape
    q, k, v = qkv(1, n_q, n_k, hq, hkv, d)
    mask = causal_block_pairs(n_q, n_k, block_size)[None]
    got = bst.block_sparse_attention_triton(q, k, v, mask, block_size, d ** -0.5)
    assert_close(got, dense_causal(q, k, v, d ** -0.5), 2e-2)


@pytest.mark.parametrize("select", [dict(density=0.1), dict(density=0.3), dict(top_p=0.7),
                                    dict(top_p=0.9, estimate="both")])
@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize("shape", SHAPES)
def test_estimated_masks_match_reference(shape, block_size, select):
    n_q, n_k, hq, hkv, d = shape
    for seed in (2, 3):
        q, k, v = qkv(seed, n_q, n_k, hq, hkv, d, q_scale=3.0)
        mask = block_mask_reference(q, k, block_size, sink_blocks=1, local_blocks=1, **select)
        out = torch.full((n_q, hq, d), float("nan"), dtype=q.dtype, device=DEV)  # every row written
        got = bst.block_sparse_attention_triton(q, k, v, mask, block_size, d ** -0.5, out=out)
        ref = block_sparse_attention_reference(q, k, v, mask, block_size, d ** -0.5,
                                               compute_dtype=torch.float64)
        assert_close(got, ref, 2e-2)
