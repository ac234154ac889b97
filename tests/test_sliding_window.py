"""The torch_native views' sliding-window mask over survivors (backends/torch_native.py).

A sliding-window layer after a drop attends to the surviving keys within its window measured
in original positions: the mask over the survivors must be upstream's whole-sequence mask
(`TorchNativeAttnBackend._make_sliding_window_mask`) restricted to the surviving query and key
positions, on fresh random survivor sets, windows and prefix offsets. Upstream's window
(RadixAttention's `sliding_window_size`) is one less than Hugging Face's `sliding_window` for
Gemma 3 (SGLang's `gemma3_causal.get_attention_sliding_window_size`); read so, the mask is
transformers' own, and the float64 Gemma 3 reference's (`tests/gemma3_reference.py`,
on Hugging Face's window).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from uniprefill_sglang.backends.common import sliding_window
from uniprefill_sglang.backends.torch_native import _visible


def _upstream_mask(seq_len: int, window):
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    if window is None:
        return torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    return TorchNativeAttnBackend._make_sliding_window_mask(
        q_len=seq_len, kv_len=seq_len, sliding_window_size=window, device="cpu")


def test_survivor_mask_is_the_whole_sequence_mask_restricted_to_survivors():
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    for _ in range(200):
        seq_len = int(torch.randint(1, 700, (1,), generator=gen))
        window = [None, 0, 1, 7, 63, 511][int(torch.randint(0, 6, (1,), generator=gen))]
        keys = torch.nonzero(torch.rand(seq_len, generator=gen) < 0.4).flatten()
        if keys.numel() == 0:
            keys = torch.tensor([seq_len - 1])
        # Queries: the new rows of an extend that survived, after a cached prefix.
        prefix = int(torch.randint(0, seq_len, (1,), generator=gen))
        queries = keys[keys >= prefix]
        expected = _upstream_mask(seq_len, window)[queries][:, keys]
        assert torch.equal(_visible(keys, queries, window), expected), (seq_len, window, prefix)


class _Layer:
    def __init__(self, sliding_window_size):
        self.sliding_window_size = sliding_window_size


def test_window_read_as_upstream_reads_it():
    assert sliding_window(_Layer(-1)) is None  # RadixAttention's "no window"
    assert sliding_window(_Layer(None)) is None
    assert sliding_window(_Layer(511)) == 511
    assert sliding_window(object()) is None


def test_survivor_mask_is_transformers_gemma3_mask_on_original_positions():
    from transformers.masking_utils import sliding_window_causal_mask_function

    from sglang.srt.models.gemma3_causal import get_attention_sliding_window_size
    from gemma3_reference import visible

    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    for _ in range(100):
        seq_len = int(torch.randint(1, 400, (1,), generator=gen))
        hf_window = int(torch.randint(1, 80, (1,), generator=gen))
        upstream = get_attention_sliding_window_size(_Config(hf_window))
        keys = torch.nonzero(torch.rand(seq_len, generator=gen) < 0.5).flatten()
        if keys.numel() == 0:
            keys = torch.tensor([seq_len - 1])
        queries = keys[keys >= int(torch.randint(0, seq_len, (1,), generator=gen))]
        hf = sliding_window_causal_mask_function(hf_window)(0, 0, queries[:, None], keys[None, :])
        assert torch.equal(_visible(keys, queries, upstream), hf), (seq_len, hf_window)
        assert torch.equal(visible(queries, keys, hf_window), hf), (seq_len, hf_window)


class _Config:
    def __init__(self, sliding_window):
        self.sliding_window = sliding_window


def _flashinfer_backend(window, **flags):
    """What `flashinfer.window_in_prefill` reads of a FlashInferAttnBackend (CUDA-only here):
    the wrapper dispatch, the decode updater's window and the flags that choose the prefill."""
    from sglang.srt.layers.attention.flashinfer_backend import WrapperDispatch

    return SimpleNamespace(
        dispatch_reason=WrapperDispatch.SLIDING_WINDOW if window is not None else None,
        indices_updater_decode=SimpleNamespace(sliding_window_size=window),
        use_paged=False, enable_deterministic=False, is_multimodal=False, enable_mis=False,
        **flags)


def test_flashinfer_sliding_window_prefills_take_the_paged_path():
    """Upstream's ragged prefill leaves the window out (backends/flashinfer.py): a
    sliding-window model is moved to the paged prefill, which plans it; nothing else is."""
    from uniprefill_sglang.backends import correct_upstream
    from uniprefill_sglang.backends.flashinfer import window_in_prefill

    gemma = _flashinfer_backend(127)
    assert "paged" in window_in_prefill(gemma) and gemma.use_paged
    full = _flashinfer_backend(None)
    assert window_in_prefill(full) is None and not full.use_paged
    paged = _flashinfer_backend(127)
    paged.use_paged = True  # SGLANG_FLASHINFER_USE_PAGED=1: already right
    assert window_in_prefill(paged) is None
    assert correct_upstream(SimpleNamespace()) is None  # a backend without an adapter
