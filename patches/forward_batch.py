"""Hook: `ForwardBatch.init_new` (AFTER).

Why: the per-request decisions (UniPrefill on/off, p / keep ratio, chunking, fallbacks) depend
on the scheduler's `Req` objects, which only `init_new` sees; the plan rides on the ForwardBatch
to the model runner.
"""

from sglang.srt.plugins.hook_registry import HookRegistry, HookType


def _attach_plan(forward_batch, cls, batch, *args, **kwargs):
    from uniprefill_sglang.request_plan import is_prefill_mode, plan_batch
    from uniprefill_sglang.runtime import get_runtime

    runtime = get_runtime()
    forward_batch.uniprefill_plan = None
    if runtime is None:
        return forward_batch
    # Host copy of the request rows: decode (per-request sparsity) and each drop (the rows of
    # req_to_token) read them without a device sync.
    forward_batch.uniprefill_req_rows = [req.req_pool_idx for req in batch.reqs]
    if not is_prefill_mode(batch.forward_mode):
        return forward_batch
    forward_batch.uniprefill_plan = plan_batch(batch, runtime.config, runtime.has_schedule)
    return forward_batch


def register() -> None:
    HookRegistry.register(
        "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new",
        _attach_plan, HookType.AFTER,
    )
