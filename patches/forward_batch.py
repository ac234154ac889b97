"""Hook: `ForwardBatch.init_new` (AFTER).

Why: the per-request decisions (UniPrefill on/off, p / keep ratio, chunking, fallbacks) depend
on the scheduler's `Req` objects, which only `init_new` sees; the plan rides on the ForwardBatch
to the model runner.
"""

from uniprefill_sglang.patches.hook_table import Hook


def _attach_plan(forward_batch, cls, batch, *args, **kwargs):
    from uniprefill_sglang.patches.radix_cache import hooked_tree_classes
    from uniprefill_sglang.request_plan import ForwardInputs, is_prefill_mode, plan_batch
    from uniprefill_sglang.runtime import get_runtime
    from uniprefill_sglang.versions import req_pool_idx

    runtime = get_runtime()
    if runtime is None:
        return forward_batch
    inputs = ForwardInputs([req_pool_idx(req) for req in batch.reqs])
    if is_prefill_mode(batch.forward_mode):
        inputs.plan = plan_batch(batch, runtime.config, runtime.no_schedule_reason,
                                 hooked_tree_classes())
    forward_batch.uniprefill_inputs = inputs
    return forward_batch


HOOKS = (
    Hook("sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new", "after",
         _attach_plan, "the per-request decisions, made from the scheduler's requests, ride "
         "on the ForwardBatch to the model runner"),
)
