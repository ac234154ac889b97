"""The FlashInfer template that the eager paged prefill wrappers run on.

SGLang 0.5.17 to 0.5.23 builds FlashInfer's ragged prefill wrapper with `backend="auto"`, which
FlashInfer resolves at each plan to its FA3 template on Hopper where the plan's features allow
it (dtypes, head dim, no custom mask), and its paged prefill wrappers with `"fa2"`. A chunked
prompt's attention to its earlier chunks goes through the paged wrappers, and so does every
attention of a later stage's view after a drop (`flashinfer.py`'s "paged" and "prefix" kinds).
With `--enable-uniprefill` the server moves to FlashInfer (SGLang would pick fa3 on Hopper), and
`UNIPREFILL_FLASHINFER_PAGED_TEMPLATE=auto` plans those paged wrappers with `"auto"` too:
FlashInfer then picks FA3 where it can and FA2 elsewhere, the rule it applies to the ragged
wrapper. The prefill and decode CUDA graphs keep upstream's wrappers as they are.

Off by default. On one H100 (2026-12-06, benchmarks/README.md#the-defaults---enable-uniprefill-alone)
it cut a 131K prompt under `--enable-uniprefill` from 15.5 s to 11.6 s (stock fa3: 10.3 s), but
with it `tests/gpu/test_backends_gpu.py` found FlashInfer's greedy tokens no longer equal in a
mixed batch and alone, nor equal to Triton's, on its small random model (38 of 43 passed; 43
with FA2). Whether that is the templates' rounding on a chaotic model or a wrong plan is not
settled, so upstream's FA2 stays the default until it is.

Only on the Llama pattern (one wrapper set: no sliding-window layers, whose windows the FA2 path
is tested with).
"""

from __future__ import annotations

from uniprefill_sglang import environ

FASTEST = "auto"  # FlashInfer's own choice per plan: FA3 on Hopper where the plan allows it


def paged_template(backend) -> str:
    """The template the plugin's and upstream's eager paged prefill wrappers are built with."""
    if environ.FLASHINFER_PAGED_TEMPLATE.get() != "auto" or backend.num_wrappers != 1:
        return backend.prefill_backend
    return FASTEST


def use_paged_template(backend) -> None:
    """Rebuild upstream's eager paged prefill wrappers on `paged_template` (at start-up, before
    anything planned them; a wrapper holds no state but its plan)."""
    from flashinfer import BatchPrefillWithPagedKVCacheWrapper

    template = paged_template(backend)
    wrappers = getattr(backend, "prefill_wrappers_paged", None)
    if not wrappers or template == backend.prefill_backend:
        return
    backend.prefill_wrappers_paged = [
        BatchPrefillWithPagedKVCacheWrapper(backend.workspace_buffer, "NHD", backend=template)
        for _ in wrappers]
