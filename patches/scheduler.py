"""Hooks on `sglang.srt.managers.scheduler.Scheduler`.

* `get_internal_state` (AFTER): observability. `Engine.get_server_info()["internal_states"][0]
  ["uniprefill"]` reports the KV pool's accounting (free, evictable and protected slots, the
  request pool, and per stage pool its size, free slots and bytes per slot), so a test or an
  operator can check that dropping leaks no KV slot; when idle under the staged layout, also
  the stage pools' invariant check (`kv_pool_problems`, empty when sound), how often
  admission was retried because drops gave stage memory back (`admission_retries`), and how
  many attention-view buffers were made in a request's path after start-up made the others
  (`views_allocated_late`: each is an allocation a request waited for), decode steps that ran
  eagerly because their per-stage lists outgrew the decode graph's (`eager_decode_overflows`,
  patches/cuda_graphs.py), and torch's CUDA allocator retries (`device_alloc_retries`: a step
  that met one waited for its cache release) and its calls to the device allocator
  (`device_allocs`: a step that runs eagerly after SGLang's `flush_cache` emptied torch's cache
  allocates its activations anew).
* `process_pending_chunked_abort` (AROUND): free the parked state of an aborted chunked request.
* `SchedulerBatchResultProcessor.process_batch_result_prefill` (BEFORE): a request UniPrefill
  could not recompute after a failure in its own code (patches/model_runner.py) finishes with
  that error instead of an answer from incomplete KV.
* `SchedulerInvariantChecker._get_total_uncached_sizes` (AFTER): SGLang's busy-time KV check
  (`SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY`) counts each running request's slots past its
  cached prefix; a request that re-selected over its prefix also holds private slots for the
  prefix's positions (uniprefill_sglang/prefix_reuse.py): count them, or the check reports a
  leak that is not one.
"""

import dataclasses

from uniprefill_sglang.patches.hook_table import Hook


def _add_pool_state(result, scheduler, *args, **kwargs):
    from uniprefill_sglang.patches.kv_allocator import admission_retries
    from uniprefill_sglang.runtime import get_runtime

    runtime = get_runtime()
    state = getattr(result, "internal_state", None)
    if runtime is None or not isinstance(state, dict):
        return result
    tree = scheduler.tree_cache
    state["uniprefill"] = {
        "max_total_num_tokens": int(scheduler.max_total_num_tokens),
        "available_kv_tokens": int(scheduler.token_to_kv_pool_allocator.available_size()),
        "evictable_kv_tokens": int(tree.evictable_size()),
        "protected_kv_tokens": int(tree.protected_size()),
        "free_req_slots": len(scheduler.req_to_token_pool.free_slots),
        "req_slots": int(scheduler.req_to_token_pool.size),
        "drop_layers": list(runtime.stages.drop_layers),
        "selection": _selection(runtime.config),
        "idle": bool(scheduler.is_fully_idle()),
        "parked_requests": len(runtime.parking),
        # Device memory one rejoining row takes (parking.RejoinCost; None: parking unbounded).
        "rejoin_row_bytes": (runtime.parking.cost.rejoin_row_bytes
                             if runtime.parking.cost is not None else None),
        **dataclasses.asdict(runtime.stats),
        "private_prefix_slots": runtime.prefix_reuse.private.held,
        "kv_layout": "staged" if runtime.slots.staged else "shared",
        "kv_pools": runtime.kv_pool_report(scheduler.token_to_kv_pool_allocator),
        "admission_retries": admission_retries(scheduler),
        "device_alloc_retries": _allocator_count("num_alloc_retries"),
        "device_allocs": _allocator_count("num_device_alloc"),
    }
    if state["uniprefill"]["idle"] and runtime.slots.staged:
        state["uniprefill"]["kv_pool_problems"] = runtime.slots.pools.check(
            _free_full_slots(scheduler.token_to_kv_pool_allocator))
    return result


def _selection(config) -> dict:
    """The selection knobs in force (each flag's, else the profile's, else the default): the
    server args SGLang reports leave unset what a profile supplied."""
    from uniprefill_sglang.config import one_or_list

    return {"top_p": None if config.keep_ratio else one_or_list(config.top_p),
            "keep_ratio": list(config.keep_ratio) if config.keep_ratio else None,
            "block_size": config.block_size, "sink_tokens": config.sink_tokens,
            "last_queries": config.last_queries, "neighbor_blocks": config.neighbor_blocks,
            "prefix_policy": config.prefix_policy,
            "max_dropped_mass": config.max_dropped_mass, "profile": config.profile}


def _allocator_count(name: str):
    """A count of torch's CUDA caching allocator: `num_alloc_retries` (it found no free block,
    released its cache and retried, milliseconds in the step that met it) or `num_device_alloc`
    (blocks it took from the device); None off CUDA."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.memory_stats().get(name, 0))


def _free_full_slots(allocator):
    import torch

    return torch.cat([allocator.free_pages, allocator.release_pages])


def _forget_aborted_chunk(original, scheduler, *args, **kwargs):
    """Hook: `Scheduler.process_pending_chunked_abort` (AROUND).

    Why: an aborted chunked request never reaches its final chunk; free its parked hidden state.
    """
    from uniprefill_sglang.runtime import get_runtime

    req = getattr(scheduler, "_pending_chunked_abort_req", None)
    result = original(scheduler, *args, **kwargs)
    runtime = get_runtime()
    if req is not None and runtime is not None and scheduler.chunked_req is not req:
        runtime.parking.forget(req.rid)
    return result


def _fail_unrecoverable(scheduler, batch, *args, **kwargs):
    from http import HTTPStatus

    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    from uniprefill_sglang.runtime import get_runtime

    runtime = get_runtime()
    if runtime is None or not runtime.failed_requests:
        return
    for req in getattr(batch, "reqs", None) or []:
        why = runtime.failed_requests.pop(req.rid, None)
        if why is not None:
            req.to_finish = FINISH_ABORT(why, HTTPStatus.INTERNAL_SERVER_ERROR,
                                         "InternalServerError")


def _count_private_prefixes(result, checker, *args, **kwargs):
    from uniprefill_sglang.runtime import get_runtime

    runtime = get_runtime()
    if runtime is None or not isinstance(result, tuple):
        return result
    full, swa = result
    return full + runtime.prefix_reuse.private.held, swa


_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
HOOKS = (
    Hook(f"{_SCHEDULER}.get_internal_state", "after", _add_pool_state,
         "report the KV pools' accounting, to check that dropping leaks no slot"),
    Hook(f"{_SCHEDULER}.process_pending_chunked_abort", "around", _forget_aborted_chunk,
         "free the parked rows of an aborted chunked request"),
    Hook("sglang.srt.managers.scheduler_components.batch_result_processor."
         "SchedulerBatchResultProcessor.process_batch_result_prefill", "before",
         _fail_unrecoverable, "a request UniPrefill could not recompute fails, never answered "
         "from incomplete KV"),
    Hook("sglang.srt.managers.scheduler_components.invariant_checker."
         "SchedulerInvariantChecker._get_total_uncached_sizes", "after",
         _count_private_prefixes, "the busy-time KV check counts private prefix slots"),
)
