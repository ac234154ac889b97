"""Hooks on the prefix cache the scheduler builds: SGLang 0.5.17's `RadixCache`, 0.5.23's
`UnifiedRadixCache` (built for every model there, also when the cache is disabled), whose
`checkpoint` and `on_release` take the place of `cache_unfinished_req` and `cache_finished_req`
below, with the same rules. The radix tree shares KV slots by token content, while under
UniPrefill a slot's KV may exist in the early layers only.

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
  cache is a class they patch (`hooked_tree_classes`), or shares nothing (disabled). SGLang
  0.5.17 builds another tree under `SGLANG_ENABLE_UNIFIED_RADIX_TREE` or
  `SGLANG_EXPERIMENTAL_CPP_RADIX_TREE`: there parked chunks and dropped KV would be shared
  unchecked, so a server that drops refuses to start, naming the cache it got.
* `cache_finished_req` (AFTER): a request that re-selected over its cached prefix held private
  KV slots for the prefix's positions (uniprefill_sglang/prefix_reuse.py). SGLang inserts the
  request's slots into the tree, where the prefix's positions are already held (the tree keeps
  its own), and frees only the slots past the protected prefix; the private ones are freed here
  once the request leaves (finished, aborted or retracted).
"""

import functools

import torch
from uniprefill_sglang.patches.hook_table import Hook, resolve_target

_TARGET = "sglang.srt.mem_cache.radix_cache.RadixCache"
_UNIFIED = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"


def _record_insert(result, cache, *args, **kwargs):
    # How much of the last inserted key the tree already held.
    cache.uniprefill_matched_prefix_len = getattr(result, "prefix_len", None)
    return result


def _record_first_insert(result, cache, *args, **kwargs):
    # A 0.5.23 checkpoint may insert twice (the whole key, then the prompt's own leaf): the
    # first says how much of the key the tree held.
    if getattr(cache, "uniprefill_matched_prefix_len", None) is None:
        cache.uniprefill_matched_prefix_len = getattr(result, "prefix_len", None)
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
    return _insert_marking_shared(runtime, original, cache, req, chunked=chunked, **kwargs)


def _checkpoint(original, cache, req, *args, **kwargs):
    """SGLang 0.5.23's `cache_unfinished_req`: a parked chunk stays out of the tree (SGLang
    moves the request's prefix on past it, on the request's own slots)."""
    from uniprefill_sglang.runtime import get_runtime

    runtime = get_runtime()
    if runtime is None or not runtime.has_schedule or cache.disable:
        return original(cache, req, *args, **kwargs)
    if runtime.parking.is_parked(req.rid) and not req.finished():
        return None
    return _insert_marking_shared(runtime, original, cache, req, *args, **kwargs)


def _insert_marking_shared(runtime, insert, cache, req, *args, **kwargs):
    """Insert the request's tokens; where the tree already held more than the request's
    protected prefix, the request now reads other requests' slots: its KV gaps are stale."""
    from uniprefill_sglang.versions import cache_protected_len, req_pool_idx

    protected = cache_protected_len(req)
    cache.uniprefill_matched_prefix_len = None
    result = insert(cache, req, *args, **kwargs)
    shared = cache.uniprefill_matched_prefix_len
    if shared is None or shared > protected:
        runtime.kv_gaps.invalidate(req_pool_idx(req))
    return result


def _release_private_prefix(result, cache, req, *args, **kwargs):
    from uniprefill_sglang.runtime import get_runtime

    runtime = get_runtime()
    if runtime is not None:
        runtime.prefix_reuse.release(req.rid)
    return result


def _check_tree_cache(result, *args, **kwargs):
    from uniprefill_sglang import versions
    from uniprefill_sglang.runtime import get_runtime

    runtime = get_runtime()
    cache = getattr(result, "tree_cache", None)
    if runtime is None or not runtime.has_schedule or cache is None or cache.disable:
        return result  # no tree (SGLang 0.5.17's ChunkCache) or a disabled one: nothing shared
    hooked = hooked_tree_classes()
    if type(cache) in hooked and _serves(cache, hooked):
        return result
    raise RuntimeError(
        f"UniPrefill: SGLang {versions.installed()} built a {type(cache).__name__} prefix "
        f"cache, while UniPrefill's prefix-cache hooks are on "
        f"{', '.join(c.__name__ for c in hooked)} "
        "(patches/radix_cache.py): parked chunks and "
        "dropped KV would be shared unchecked. Start with --disable-radix-cache, or without "
        "SGLANG_ENABLE_UNIFIED_RADIX_TREE / SGLANG_EXPERIMENTAL_CPP_RADIX_TREE")


def _serves(cache, hooked: tuple) -> bool:
    """Where SGLang 0.5.17 builds its unified tree (hooked beside RadixCache there), only a
    model with a recurrent state under UNIPREFILL_HYBRID_PREFIX_CACHE is served by it: for
    other models it is built only on request, and has not been tested under the hooks."""
    from uniprefill_sglang import environ

    if type(cache).__name__ != "UnifiedRadixCache" or len(hooked) == 1:
        return True
    return environ.HYBRID_PREFIX_CACHE.get() and cache.supports_mamba()


@functools.lru_cache(maxsize=None)
def hooked_tree_classes() -> tuple:
    """The prefix cache classes these hooks patch on the installed SGLang (resolved once: every
    prefill batch's plan asks, patches/forward_batch.py)."""
    trees = sorted({h.target.rsplit(".", 1)[0] for h in HOOKS
                    if h.target != _BUILD and h.applies()})
    return tuple(resolve_target(tree) for tree in trees)


_BUILD = "sglang.srt.mem_cache.kv_cache_builder.build_kv_cache"
HOOKS = (
    Hook(_BUILD, "after", _check_tree_cache,
         "the prefix cache built must be the one these hooks patch, else refuse to start"),
    Hook(f"{_TARGET}.insert", "after", _record_insert,
         "how much of the key the tree already held (read by cache_unfinished_req)",
         sglang="<0.5.18"),
    Hook(f"{_TARGET}.cache_unfinished_req", "around", _cache_unfinished_req,
         "a chunk parked at the first drop is not shared; swapped slots mark stale KV gaps",
         sglang="<0.5.18"),
    Hook(f"{_TARGET}.cache_finished_req", "after", _release_private_prefix,
         "free the private prefix slots of a request that re-selected over its prefix",
         sglang="<0.5.18"),
    # SGLang 0.5.17 builds a UnifiedRadixCache (with a recurrent-state component) for models
    # with a recurrent state; served only under UNIPREFILL_HYBRID_PREFIX_CACHE
    # (`_check_tree_cache`). Its API there is RadixCache's: the same rules.
    Hook(f"{_UNIFIED}.insert", "after", _record_insert,
         "how much of the key the tree already held (read by cache_unfinished_req)",
         sglang="<0.5.18"),
    Hook(f"{_UNIFIED}.cache_unfinished_req", "around", _cache_unfinished_req,
         "a chunk parked at the first drop is not shared (nor its recurrent state, whose later "
         "layers have not seen it); swapped slots mark stale KV gaps", sglang="<0.5.18"),
    Hook(f"{_UNIFIED}.cache_finished_req", "after", _release_private_prefix,
         "free the private prefix slots of a request that re-selected over its prefix",
         sglang="<0.5.18"),
    # SGLang 0.5.23 builds a UnifiedRadixCache for every model; the same rules on its API.
    Hook(f"{_UNIFIED}.insert", "after", _record_first_insert,
         "how much of the key the tree already held (read by checkpoint)", sglang=">=0.5.23"),
    Hook(f"{_UNIFIED}.checkpoint", "around", _checkpoint,
         "a chunk parked at the first drop is not shared; swapped slots mark stale KV gaps",
         sglang=">=0.5.23"),
    Hook(f"{_UNIFIED}.on_release", "after", _release_private_prefix,
         "free the private prefix slots of a request that re-selected over its prefix",
         sglang=">=0.5.23"),
)
