"""Hooks on SGLang attention backends: per-stage KV views.

* `TorchNativeAttnBackend.forward_extend` / `.forward_decode` (AROUND): after a drop, a layer
  writes KV only for the survivors and attends only to the KV its stage holds
  (uniprefill_sglang/backends/torch_native.py). Batches with nothing sparse run upstream code.
"""

from sglang.srt.plugins.hook_registry import HookRegistry, HookType


def register() -> None:
    from uniprefill_sglang.backends import torch_native

    target = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"
    HookRegistry.register(f"{target}.forward_extend", torch_native.forward_extend, HookType.AROUND)
    HookRegistry.register(f"{target}.forward_decode", torch_native.forward_decode, HookType.AROUND)
