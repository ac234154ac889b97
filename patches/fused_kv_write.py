"""Hook: `enable_fused_set_kv_buffer` as the MoE models that call it see it (AROUND).

Why: on CUDA, SGLang's Qwen3-MoE (and gpt-oss) writes a layer's K and V into the KV pool inside its rotary
kernel (`create_fused_set_kv_buffer_arg`: the pool's buffers at `forward_batch.out_cache_loc`)
and then tells the attention backend not to save them. After a drop the layer holds the
survivors' rows (and, at a rejoin, the parked rows of earlier chunks), whose slots are the drop
context's, not the batch's: the kernel refuses the mismatch (measured on an H200, SGLang 0.5.17:
`Size mismatch for shape#0('num_tokens')`). Where UniPrefill has changed the forward's rows the
fused write is off, so the attention backend writes the K and V at the survivors' slots as it
does for every other model; before the first drop it stays on.
"""

from uniprefill_sglang.patches.hook_table import Hook

# The model modules whose attention reads the switch by this name (each module's own binding).
MODEL_MODULES = ("sglang.srt.models.qwen3_moe", "sglang.srt.models.gpt_oss")


def _not_after_a_drop(original, forward_batch, *args, **kwargs):
    from uniprefill_sglang.context import drop_context

    ctx = drop_context(forward_batch)
    if ctx is not None and ctx.survivors.compacted:
        return False
    return original(forward_batch, *args, **kwargs)


HOOKS = tuple(
    Hook(f"{module}.enable_fused_set_kv_buffer", "around", _not_after_a_drop,
         "after a drop the rows' KV slots are the drop context's: the attention backend writes "
         "them, not the rotary kernel")
    for module in MODEL_MODULES
)
