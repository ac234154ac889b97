"""Adapters that teach SGLang attention backends the per-stage (sparse) KV views."""

from typing import Optional


def staged_layout_unsupported(backend) -> Optional[str]:
    """Why this attention backend cannot run on the staged KV layout (every layer after the
    first drop reads through an adapter's per-stage views), or None."""
    name = type(backend).__name__
    if name == "TorchNativeAttnBackend":
        return None
    if name == "FlashInferAttnBackend":
        from uniprefill_sglang.backends import flashinfer

        return None if flashinfer._supported(backend) else "FlashInfer with a wrapper pair"
    if name == "TritonAttnBackend":
        from uniprefill_sglang.backends import triton

        return None if triton._supported(backend) else (
            "Triton under deterministic inference, sliding windows or split KV")
    return f"attention backend {name}"
