"""Hook: `sglang.srt.managers.scheduler.Scheduler.get_internal_state` (AFTER).

Why: observability. `Engine.get_server_info()["internal_states"][0]["uniprefill"]` reports the
KV pool's accounting (free, evictable and protected slots, the request pool) and how many slots
currently hold sparse KV, so a test or an operator can check that dropping leaks no KV slot.
"""

from sglang.srt.plugins.hook_registry import HookRegistry, HookType


def _add_pool_state(result, scheduler, *args, **kwargs):
    from uniprefill_sglang.runtime import get_runtime

    runtime = get_runtime()
    if runtime is None or not isinstance(result, dict):
        return result
    tree = scheduler.tree_cache
    result["uniprefill"] = {
        "max_total_num_tokens": int(scheduler.max_total_num_tokens),
        "available_kv_tokens": int(scheduler.token_to_kv_pool_allocator.available_size()),
        "evictable_kv_tokens": int(tree.evictable_size()),
        "protected_kv_tokens": int(tree.protected_size()),
        "free_req_slots": len(scheduler.req_to_token_pool.free_slots),
        "req_slots": int(scheduler.req_to_token_pool.size),
        "drop_layers": list(runtime.stages.drop_layers),
        "idle": bool(scheduler.is_fully_idle()),
    }
    return result


def register() -> None:
    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.get_internal_state",
                          _add_pool_state, HookType.AFTER)
