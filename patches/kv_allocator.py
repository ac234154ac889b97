"""Hooks that keep the staged KV layout's stage pools (uniprefill_sglang/stage_pools.py) in step
with SGLang's allocator and scheduler. Each is inert unless the allocator carries stage pools
(`allocator.uniprefill_stage_pools`, set when the runtime is built on a staged pool).

* `sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator.alloc` (AROUND): full slots are
  handed out only when every stage pool can give each of them a slot too (a new token may
  survive every drop), and get those slots at once.
* `...TokenToKVPoolAllocator.free` (AROUND): a freed full slot (request finished, aborted or
  retracted, radix-cache eviction, a duplicate the tree already holds) frees its stage slots.
* `...TokenToKVPoolAllocator.clear` (AFTER): `flush_cache` empties the stage pools too.
* `sglang.srt.mem_cache.common.evict_from_tree_cache` (AROUND): SGLang evicts until the full
  pool has room; evicted tokens that had been dropped free no stage slot, so keep evicting while
  some stage pool lacks room and the tree has something to give.
* `sglang.srt.managers.schedule_batch.ScheduleBatch.check_decode_mem` (AROUND): the next decode
  step needs a slot per request in every stage pool; when one is short SGLang retracts, as it
  does when the full pool is.
* `sglang.srt.managers.schedule_policy.PrefillAdder.__init__` (AFTER): admission budgets with
  the full pool's free plus evictable slots; take off what the tightest stage pool cannot match
  (`StagePools.shortfall`), so a request admitted always finds its slots: it waits instead.
* `sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill` (BEFORE): when the waiting
  requests do not fit a stage pool, evict from the radix cache first (admission alone would
  only wait, and cached tokens would never make room). And SGLang stops trying to admit once an
  admission failed for memory (`batch_is_full`) until a request leaves; under the staged layout
  a prefill's drops also give memory back, so when the stage pools' room has grown since the
  last admission was decided, admission tries again.
* `...Scheduler.get_new_batch_prefill` (AFTER): note that room, measured once the admitted
  batch has its slots and before its forward drops anything (measured at the next call it
  would already include the drops of the batch whose admission failed, and never grow).
"""

from uniprefill_sglang.patches.hook_table import Hook

_ALLOCATOR = "sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator"


def _pools(allocator):
    return getattr(allocator, "uniprefill_stage_pools", None)


def _alloc(original, allocator, need_size, *args, **kwargs):
    pools = _pools(allocator)
    if pools is None:
        return original(allocator, need_size, *args, **kwargs)
    if pools.available() < need_size:
        return None
    slots = original(allocator, need_size, *args, **kwargs)
    if slots is not None:
        pools.assign(slots)
    return slots


def _free(original, allocator, free_index, *args, **kwargs):
    pools = _pools(allocator)
    if pools is not None and free_index is not None:
        pools.release(free_index)
    return original(allocator, free_index, *args, **kwargs)


def _clear(result, allocator, *args, **kwargs):
    pools = _pools(allocator)
    if pools is not None:
        pools.clear()
    return result


def _evict_for_stages(original, tree_cache, num_tokens, *args, **kwargs):
    from uniprefill_sglang.versions import holds_no_prefixes

    result = original(tree_cache, num_tokens, *args, **kwargs)
    if tree_cache is None or holds_no_prefixes(tree_cache):
        return result
    pools = _pools(tree_cache.token_to_kv_pool_allocator)
    if pools is None:
        return result
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    while pools.available() < num_tokens:
        before = tree_cache.evictable_size()
        if before == 0:
            break
        tree_cache.evict(EvictParams(num_tokens=num_tokens - pools.available()))
        if tree_cache.evictable_size() >= before:
            break
    return result


def _check_decode_mem(original, batch, selected_indices=None, *args, **kwargs):
    fits = original(batch, selected_indices, *args, **kwargs)
    pools = _pools(batch.token_to_kv_pool_allocator)
    if not fits or pools is None:
        return fits
    return pools.available() >= batch.new_tokens_required_next_decode(selected_indices)


def _budget_for_stages(result, adder, *args, **kwargs):
    from uniprefill_sglang.versions import charge_prefill_budget

    allocator = adder.token_to_kv_pool_allocator
    pools = _pools(allocator)
    if pools is None or adder.tree_cache is None:
        return result
    available = allocator.available_size()
    shortfall = pools.shortfall(available, allocator.size - available,
                                adder.tree_cache.evictable_size())
    charge_prefill_budget(adder, shortfall)
    return result


def _before_admission(scheduler, running_batch=None, *args, **kwargs):
    from uniprefill_sglang.versions import holds_no_prefixes

    pools = _pools(scheduler.token_to_kv_pool_allocator)
    if pools is None:
        return
    if running_batch is not None:
        _retry_after_drops(scheduler, running_batch, pools.available())
    if not scheduler.waiting_queue or holds_no_prefixes(scheduler.tree_cache):
        return
    need = min(max(_new_tokens(req) for req in scheduler.waiting_queue[:8]), min(pools.sizes))
    if pools.available() < need:
        from sglang.srt.mem_cache.common import evict_from_tree_cache

        evict_from_tree_cache(scheduler.tree_cache, need)


def _after_admission(result, scheduler, *args, **kwargs):
    pools = _pools(scheduler.token_to_kv_pool_allocator)
    if pools is not None:
        _admission(scheduler).room_after = pools.available()
    return result


def _new_tokens(req) -> int:
    """Tokens a waiting request still has to prefill: its prompt less the cached prefix it
    matched when last scheduled (evicting that prefix to make room would defeat the cache)."""
    from uniprefill_sglang.versions import prefix_len

    return max(1, len(req.origin_input_ids) - prefix_len(req))


def _retry_after_drops(scheduler, running_batch, available: int) -> None:
    """Lift SGLang's `batch_is_full` latch when drops gave stage memory back since the last
    admission (decode steps only take room; a finished request lifts the latch in SGLang)."""
    admission = _admission(scheduler)
    room = admission.room_after
    if running_batch.batch_is_full and room is not None and available > room:
        running_batch.batch_is_full = False
        admission.retries += 1


class _Admission:
    """The scheduler's `uniprefill_admission`: the stage pools' room once the last admitted
    batch had its slots, and how often admission was retried since drops gave memory back."""

    def __init__(self):
        self.room_after = None
        self.retries = 0


def _admission(scheduler) -> _Admission:
    if getattr(scheduler, "uniprefill_admission", None) is None:
        scheduler.uniprefill_admission = _Admission()
    return scheduler.uniprefill_admission


def admission_retries(scheduler) -> int:
    """How often admission was retried because drops gave stage memory back."""
    return _admission(scheduler).retries


_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
HOOKS = (
    Hook(f"{_ALLOCATOR}.alloc", "around", _alloc,
         "staged layout: a full slot is handed out only with a slot in every stage pool"),
    Hook(f"{_ALLOCATOR}.free", "around", _free, "a freed full slot frees its stage slots"),
    Hook(f"{_ALLOCATOR}.clear", "after", _clear, "flush_cache empties the stage pools too"),
    Hook("sglang.srt.mem_cache.common.evict_from_tree_cache", "around", _evict_for_stages,
         "evict from the radix cache until every stage pool has room, not the full pool alone"),
    Hook("sglang.srt.managers.schedule_batch.ScheduleBatch.check_decode_mem", "around",
         _check_decode_mem, "a decode step needs a slot per request in every stage pool"),
    Hook("sglang.srt.managers.schedule_policy.PrefillAdder.__init__", "after",
         _budget_for_stages, "admission budgets with the tightest stage pool's room"),
    Hook(f"{_SCHEDULER}.get_new_batch_prefill", "before", _before_admission,
         "evict for the stage pools, and retry admission when drops gave memory back"),
    Hook(f"{_SCHEDULER}.get_new_batch_prefill", "after", _after_admission,
         "note the stage pools' room once the admitted batch has its slots"),
)
