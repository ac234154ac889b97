"""Hooks on SGLang attention backends: per-stage KV views.

Every hook calls the upstream code unchanged unless UniPrefill is on with a drop schedule and
the layer reads a per-stage view (`backends.common.needs_view`: after a drop, while a request
lacks KV in a later stage, or in every later stage under the staged KV layout). Each backend's
hooks are listed by its adapter (`StageViewAdapter.hooks()`) and registered here alike.

* `TorchNativeAttnBackend.forward_extend` / `.forward_decode` (AROUND): after a drop, a layer
  writes KV only for the survivors and attends only to the KV its stage holds
  (uniprefill_sglang/backends/torch_native.py).
* `FlashInferAttnBackend` (uniprefill_sglang/backends/flashinfer.py):
  - `forward_extend` (AROUND): layers of a stage with a sparse view write KV for the survivors
    and run wrappers planned once per stage per forward: ragged among the survivors plus paged
    over the stage's valid prefix, merged (or, where upstream runs no ragged wrapper, one paged
    wrapper over the whole compacted view).
  - `init_forward_metadata` (AROUND): a decode batch that needs views plans one decode
    wrapper per stage (and, for a sliding-window model, builds each later stage's window
    lists); `_get_wrapper_idx` (AROUND) returns the layer's stage wrapper under such metadata;
    `forward_decode` (AROUND) runs a sliding-window layer after a drop over its stage's window
    list (`kernels.positional_attention`).
  - `init_cuda_graph_state` / `_create_decode_wrappers` (AFTER) and
    `init_forward_metadata_out_graph` (AROUND): decode CUDA graphs capture one wrapper per
    stage over per-stage static buffers, refilled and re-planned outside the graph on replay.
* `TritonAttnBackend` (uniprefill_sglang/backends/triton.py): `forward_extend`,
  `forward_decode`, `init_forward_metadata`, `init_forward_metadata_out_graph` (AROUND) and
  `init_cuda_graph_state` (AFTER): the same views, built on the device without host syncs.
* `GDNAttnBackend.forward_extend` (AROUND): after a drop, a Gated DeltaNet layer runs its
  convolution and recurrence over the survivors (uniprefill_sglang/backends/linear_attention.py).
* `ShortConvAttnBackend.conv_state_metadata` (AROUND): after a drop, a short-convolution layer
  (LFM2) gets the handle describing the survivors (uniprefill_sglang/backends/short_conv.py).
"""

from uniprefill_sglang.patches.hook_table import Hook


def adapter_hooks() -> tuple:
    """The attention adapters' rows of the hook table, each needed only where its backend
    serves the model."""
    from uniprefill_sglang.backends import adapters

    rows = []
    for adapter in adapters():
        module = __import__(type(adapter).__module__, fromlist=["_"])
        why = " ".join((module.__doc__ or "").strip().split("\n\n")[0].split())
        for method, hook, kind in adapter.hooks():
            rows.append(Hook(f"{adapter.target}.{method}", kind, hook, why,
                             backend=adapter.class_name))
    return tuple(rows)
