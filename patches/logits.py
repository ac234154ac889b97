"""Hook: `sglang.srt.layers.logits_processor.LogitsProcessor.forward` (AROUND).

Why: after a drop the hidden states hold only the survivors, while the processor finds each
request's last token from the ForwardBatch's original extend lengths. The last token always
survives, so pointing it at the compacted lengths gives the same logits. A dense request whose
earlier rows rejoined whole (runtime.py) passes on its own rows only, as a dense step would (its
input logprobs, if asked for, cover its own tokens). The per-stage kept
counts are returned through `customized_info`, which SGLang copies into `meta_info` (under
UNIPREFILL_CHECK_KV_LENS also `kv_missing`: per later stage, the request's tokens whose KV the
device slot map says that stage lacks).
"""

from uniprefill_sglang.patches.hook_table import Hook

META_KEY = "uniprefill"


def _logits_forward(original, processor, input_ids, hidden_states, lm_head, logits_metadata,
                    *args, **kwargs):
    from sglang.srt.layers.logits_processor import LogitsMetadata
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    from uniprefill_sglang.context import drop_context
    from uniprefill_sglang.device import to_device

    ctx = drop_context(logits_metadata)  # the model passes its ForwardBatch
    if ctx is None or not ctx.is_extend or ctx.plan is None:
        return original(processor, input_ids, hidden_states, lm_head, logits_metadata,
                        *args, **kwargs)
    if ctx.survivors.compacted:
        if isinstance(logits_metadata, ForwardBatch):
            logits_metadata = LogitsMetadata.from_forward_batch(logits_metadata)
        survivors, rejoined_whole = ctx.survivors, ctx.parking.rejoined_whole
        own = survivors.own_rows(rejoined_whole)
        if own is not None:  # rows that rejoined whole are not this step's tokens
            hidden_states = hidden_states.index_select(0, own)
        logits_metadata.extend_seq_lens = to_device(survivors.own_lens(rejoined_whole),
                                                    logits_metadata.extend_seq_lens.dtype,
                                                    hidden_states.device)
    output = original(processor, input_ids, hidden_states, lm_head, logits_metadata,
                      *args, **kwargs)
    from uniprefill_sglang.backends import block_sparse
    from uniprefill_sglang.runtime import get_runtime

    runtime = get_runtime()
    missing = None
    if runtime is not None and runtime.check_kv_lens and runtime.has_schedule:
        missing = runtime.missing_kv(ctx.forward_batch)
    if runtime is not None:  # block-sparse attention's step, where no layer planned it
        block_sparse.step_of(ctx, runtime)
    info = []
    for b, decision in enumerate(ctx.plan.decisions):
        entry = ctx.report.entry(b, decision)
        if missing is not None:  # UNIPREFILL_CHECK_KV_LENS=1: the device slot map
            entry["kv_missing"] = missing[b]
        info.append(entry)
    if output.customized_info is None:
        output.customized_info = {}
    output.customized_info[META_KEY] = info
    return output


HOOKS = (
    Hook("sglang.srt.layers.logits_processor.LogitsProcessor.forward", "around",
         _logits_forward, "after a drop the last tokens sit at compacted rows; report the "
         "per-request outcome in meta_info"),
)
