"""Adapters that teach SGLang attention backends the per-stage (sparse) KV views, and the
linear-attention and short-convolution backends to run on the survivors: one
`common.StageViewAdapter` per backend."""

from typing import Optional, Tuple


def adapters() -> Tuple:
    from uniprefill_sglang.backends import (flashinfer, linear_attention, short_conv,
                                            torch_native, triton)

    return (flashinfer.ADAPTER, triton.ADAPTER, torch_native.ADAPTER, linear_attention.ADAPTER,
            short_conv.ADAPTER)


def prepare_views(backend, runtime) -> None:
    """At start-up: the adapter of `backend`'s class, if it serves this instance, allocates its
    views' buffers (`StageViewAdapter.prepare`)."""
    for adapter in adapters():
        if adapter.class_name == type(backend).__name__ and adapter.supported(backend):
            adapter.prepare(backend, runtime)


def correct_upstream(backend) -> Optional[str]:
    """At start-up: what the adapter of `backend`'s class sets right in upstream's backend for
    this model (`StageViewAdapter.correct_upstream`), or None."""
    for adapter in adapters():
        if adapter.class_name == type(backend).__name__:
            return adapter.correct_upstream(backend)
    return None


def staged_layout_unsupported(backend) -> Optional[str]:
    """Why this attention backend cannot run on the staged KV layout (every layer after the
    first drop reads through an adapter's per-stage views), or None."""
    name = type(backend).__name__
    for adapter in adapters():
        if adapter.class_name == name:
            return adapter.unsupported_reason(backend)
    return f"attention backend {name} has no UniPrefill adapter"
