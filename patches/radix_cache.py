"""Hooks on `sglang.srt.mem_cache.radix_cache.RadixCache`: the radix tree shares KV slots by
token content, while under UniPrefill a slot's KV may exist in the early layers only.

* `cache_unfinished_req` (AROUND). SGLang inserts a request's tokens into the tree after every
  prefill step (and after each chunk of a chunked prefill). Two consequences need care:
  - A chunk parked at the first drop layer (uniprefill_sglang/parking.py) holds KV for stage 0
    only until its final chunk writes the later layers. In the tree, another request could match
    it and read KV that changes under it. So a parked chunk is not inserted: the request keeps
    its slots to itself, as SGLang's `ChunkCache` keeps them (`req.prefix_indices` is all the
    next chunk needs), and its whole prompt is inserted after the final chunk.
  - Where another request inserted the same leading tokens first, `insert` frees this request's
    slots for them and points the request at the tree's, whose per-stage KV follows the other
    request's selection. The host mirror of the request's KV gaps is then stale: it is re-read
    from the device before the request's next decode (one sync, only when slots were swapped).
* `insert` (AFTER): records how much of the key the tree already held, for the hook above.
* `kv_cache_builder.build_kv_cache` (AFTER): these hooks only hold where the scheduler's prefix
  cache is a `RadixCache` (or no tree at all, `ChunkCache`). SGLang 0.5.17 builds another tree
  under `SGLANG_ENABLE_UNIFIED_RADIX_TREE` or `SGLANG_EXPERIMENTAL_CPP_RADIX_TREE` (and 0.5.23
  for every model): there parked chunks and dropped KV would be shared unchecked, so a server
  that drops refuses to start, naming the cache it got.
* `cache_finished_req` (AFTER): a request that re-selected over its cached prefix held private
  KV slots for the prefix's positions (uniprefill_sglang/prefix_reuse.py). SGLang inserts the
  request's slots into the tree, where the prefix's positions are already held (the tree keeps
  its own), and frees only the slots past the protected prefix; the private ones are freed here
  once the request leaves (finished, aborted or retracted).
"""

import torch
from uniprefill_sglang.patches.hook_table import Hook, resolve_target

_TARGET = "sglang.srt.mem_cache.radix_cache.RadixCache"


def _record_insert(result, cache, *args, **kwargs):
    # The cache's `uniprefill` attribute: how much of the last inserted key it already held.
    cache.uniprefill = getattr(result, "prefix_len", None)
    return result


def _cache_unfinished_req(original, cache, req, chunked=False, **kwargs):
    from uniprefill_sglang.runtime import get_runtime

    runtime = get_runtime()
    if runtime is None or not runtime.has_schedule or cache.disable:
        return original(cache, req, chunked=chunked, **kwargs)
    if chunked and runtime.parking.is_parked(req.rid):
        req.prefix_indices = cache.req_to_token_pool.req_to_token[
            req.req_pool_idx, : req.extend_range.end
        ].to(dtype=torch.int64, copy=True)
        return None
    protected = req.cache_protected_len
    cache.uniprefill = None
    result = original(cache, req, chunked=chunked, **kwargs)
    shared = cache.uniprefill
    if shared is None or shared > protected:  # this request now reads other requests' slots
        runtime.kv_gaps.invalidate(req.req_pool_idx)
    return result


def _release_private_prefix(result, cache, req, *args, **kwargs):
    from uniprefill_sglang.runtime import get_runtime

    runtime = get_runtime()
    if runtime is not None:
        runtime.prefix_reuse.release(req.rid)
    return result


def _check_tree_cache(result, *args, **kwargs):
    from uniprefill_sglang.patches import versions
    from uniprefill_sglang.runtime import get_runtime

    runtime = get_runtime()
    cache = getattr(result, "tree_cache", None)
    if runtime is None or not runtime.has_schedule or cache is None or cache.disable:
        return result  # no tree (SGLang 0.5.17's ChunkCache) or a disabled one: nothing shared
    hooked = [h for h in HOOKS if h.target.startswith(f"{_TARGET}.") and h.applies()]
    if hooked and isinstance(cache, resolve_target(_TARGET)):
        return result
    where = "RadixCache (patches/radix_cache.py)" if hooked else "no prefix cache of this release"
    raise RuntimeError(
        f"UniPrefill: SGLang {versions.installed()} built a {type(cache).__name__} prefix "
        f"cache, while UniPrefill's prefix-cache hooks are on {where}: parked chunks and "
        "dropped KV would be shared unchecked. Start with --disable-radix-cache, or without "
        "SGLANG_ENABLE_UNIFIED_RADIX_TREE / SGLANG_EXPERIMENTAL_CPP_RADIX_TREE")


HOOKS = (
    Hook("sglang.srt.mem_cache.kv_cache_builder.build_kv_cache", "after", _check_tree_cache,
         "the prefix cache built must be the one these hooks patch, else refuse to start"),
    # SGLang 0.5.23 caches through `checkpoint` / `on_release` of a UnifiedRadixCache.
    Hook(f"{_TARGET}.insert", "after", _record_insert,
         "how much of the key the tree already held (read by cache_unfinished_req)",
         sglang="<0.5.18"),
    Hook(f"{_TARGET}.cache_unfinished_req", "around", _cache_unfinished_req,
         "a chunk parked at the first drop is not shared; swapped slots mark stale KV gaps",
         sglang="<0.5.18"),
    Hook(f"{_TARGET}.cache_finished_req", "after", _release_private_prefix,
         "free the private prefix slots of a request that re-selected over its prefix",
         sglang="<0.5.18"),
)
