"""Adapters that teach SGLang attention backends the per-stage (sparse) KV views, and the
linear-attention and short-convolution backends to run on the survivors: one
`common.StageViewAdapter` per backend."""

from typing import List, Optional, Tuple


def adapters() -> Tuple:
    from uniprefill_sglang.backends import (fa3, flashinfer, linear_attention, short_conv,
                                            torch_native, triton)

    return (flashinfer.ADAPTER, fa3.ADAPTER, triton.ADAPTER, torch_native.ADAPTER,
            linear_attention.ADAPTER, short_conv.ADAPTER)


def serving_backends(backend) -> List:
    """The backends that run a server's attention: SGLang's prefill/decode split
    (`HybridAttnBackend`, e.g. FA3 prefill with FlashInfer decode) is its two halves."""
    if type(backend).__name__ == "HybridAttnBackend":
        return [backend.prefill_backend, backend.decode_backend]
    return [backend]


def full_attention_prefill(backend):
    """The backend that runs a server's full-attention layers in prefill: the prefill half of
    SGLang's prefill/decode split, inside the wrapper of a model with linear-attention or
    short-convolution layers (Qwen3-Next, LFM2) its full-attention backend."""
    inner = getattr(backend, "full_attn_backend", None)
    if inner is not None:
        return full_attention_prefill(inner)
    return serving_backends(backend)[0]


def _adapter_of(backend):
    for adapter in adapters():
        if adapter.class_name == type(backend).__name__:
            return adapter
    return None


def prepare_views(backend, runtime) -> None:
    """At start-up: the adapter of each serving backend's class, if it serves that instance,
    allocates its views' buffers (`StageViewAdapter.prepare`)."""
    for b in serving_backends(backend):
        adapter = _adapter_of(b)
        if adapter is not None and adapter.supported(b):
            adapter.prepare(b, runtime)


def correct_upstream(backend) -> Optional[str]:
    """At start-up: what the adapters of the serving backends set right in upstream's backends
    for this model (`StageViewAdapter.correct_upstream`), or None."""
    said = [adapter.correct_upstream(b) for b in serving_backends(backend)
            for adapter in [_adapter_of(b)] if adapter is not None]
    return "; ".join(s for s in said if s) or None


def staged_layout_unsupported(backend) -> Optional[str]:
    """Why these attention backends cannot run on the staged KV layout (every layer after the
    first drop reads through an adapter's per-stage views), or None."""
    for b in serving_backends(backend):
        adapter = _adapter_of(b)
        if adapter is None:
            return f"attention backend {type(b).__name__} has no UniPrefill adapter"
        why = adapter.unsupported_reason(b)
        if why:
            return why
    return None
