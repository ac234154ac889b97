"""Hook: `sglang.srt.layers.radix_attention.padded_extend_real_tokens` (AROUND), SGLang 0.5.23.

Why: from 0.5.23 `RadixAttention.forward` narrows an extend's rows to the batch's real token
count (`forward_batch.global_num_token_non_padded_cpu`) when the queries hold more rows, taking
the extra ones for padding. After chunked prefill's rejoin (uniprefill_sglang/parking.py) a
layer holds more rows than the step's own tokens: the parked rows of earlier chunks, not
padding. Where UniPrefill has changed the rows of the forward they are its own, none padded.
"""

from uniprefill_sglang.patches.hook_table import Hook


def _no_padding_after_a_drop(original, q, forward_batch, *args, **kwargs):
    from uniprefill_sglang.context import drop_context

    ctx = drop_context(forward_batch)
    if ctx is not None and ctx.survivors.compacted:
        return None
    return original(q, forward_batch, *args, **kwargs)


HOOKS = (
    Hook("sglang.srt.layers.radix_attention.padded_extend_real_tokens", "around",
         _no_padding_after_a_drop, "rejoined rows of earlier chunks are not padding to narrow "
         "away", sglang=">=0.5.23"),
)
