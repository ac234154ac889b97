"""What differs between the SGLang versions the plugin is written for, in one place.

Everything else in the plugin asks this module instead of testing versions itself:

* `SUPPORTED`: the SGLang releases the plugin has been run on. With `--enable-uniprefill` the
  start-up check (`patches.check_sglang`) refuses any other release, naming what changed.
* Hook rows that exist for some releases only carry a version specifier (`Hook.sglang`), and
  `patches.all_hooks()` keeps only those that contain the installed release (`applies`).
* What moved and is read by more than one hook, through the accessors at the end of this
  module (each answers on every supported release).
* What moved between the releases surveyed so far (0.5.18-0.5.22 were not), the map for
  porting a patch module:

| | 0.5.17 | 0.5.23 |
|---|---|---|
| prefix cache (`mem_cache/registry.py`; `--radix-cache-backend` in both) | `RadixCache` for a plain model (`UnifiedRadixCache` for hybrid ones or under `SGLANG_ENABLE_UNIFIED_RADIX_TREE`), `ChunkCache` when disabled; `cache_unfinished_req`, `cache_finished_req` | `UnifiedRadixCache` for every model but pure sliding-window ones, also when disabled; `checkpoint`, `on_release` |
| `ServerArgs` | a dataclass | a `msgspec` Struct, resolved by `resolve_once()` |
| request KV fields | `req.req_pool_idx`, `req.cache_protected_len`, `req.extend_range` (start, end), `req.prefix_indices` | `req.kv.req_pool_idx`, `req.kv.cache_protected_len`, `req.prefix_len`, `req.extend_end` |
| process-wide server args | `server_args.get_global_server_args()` | `runtime_context.get_server_args()` (in both) |
| a `PrefillAdder`'s KV budget | `rem_total_token_offset`, `cur_rem_token_offset` | `memory_budget.total_offset`, `.current_offset` |
| a tree that shares nothing | `is_chunk_cache()` | `not supports_prefix_sharing()` |
| the decoder layer's residual | passed to the layer and to its norms | `forward_batch.residual_stream`; the norms still take it |
| attention rows | as given | narrowed to the batch's token count (`padded_extend_real_tokens`) |
| `PrefillCudaGraphRunner.load_batch` | returns the static batch | returns (static batch, shared-read ends) |

How each checked release is tested: 0.5.23, the release pip resolves for a user, by `bash .ci/run`
(the README's demo command in a fresh environment, then the whole CPU suite); 0.5.17 by the last
leg of `bash .ci/run`, a virtual environment that sees the first one's packages after its own
(pip installs there what 0.5.17 pins apart: torch 2.11, transformers 5.12, ...), running the hook
table, the versions check, a CPU engine's smoke test, chunked prefill and the rejoin
(`test_rejoin.py`, less its fault and pool-pressure tests), Qwen3-Next (whose 0.5.23 model
allocates on the CUDA device and does not build on the CPU engine) and the hybrids'
experimental prefix cache (`test_hybrid_prefix_cache.py`); and by the GPU tests
(`tests/gpu/`), whose offline bundle carries 0.5.17.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from packaging.specifiers import SpecifierSet
from packaging.version import Version

# Widen as each release is run end to end (the CPU suite, `--check`, a GPU run). Checked:
# 0.5.17 and 0.5.23; 0.5.18-0.5.22 were never installed, so they stay out.
SUPPORTED = SpecifierSet(">=0.5.17,<0.5.24,!=0.5.18.*,!=0.5.19.*,!=0.5.20.*,!=0.5.21.*,!=0.5.22.*")


def installed() -> Version:
    import sglang

    return Version(sglang.__version__)


def supported(version: Optional[Version] = None) -> bool:
    return SUPPORTED.contains(version or installed(), prereleases=True)


def applies(specifier: Optional[str], version: Optional[Version] = None) -> bool:
    """Whether a row limited to `specifier` (None: every release) is for the installed one."""
    if specifier is None:
        return True
    return SpecifierSet(specifier).contains(version or installed(), prereleases=True)


# ---- ServerArgs: 0.5.17 resolves a dataclass in place when it is built; 0.5.23's msgspec Struct
# keeps the operator's input, resolves in `resolve_once()` (which the launchers call) and
# declares what it decided beside the fields.

def seal_server_args(cls: type) -> type:
    """Finish a ServerArgs subclass that declares its fields as annotations: a subclass of a
    dataclass must be made one; a Struct subclass already has its fields."""
    return dataclasses.dataclass(cls) if dataclasses.is_dataclass(cls.__mro__[1]) else cls


def resolves_when_built(server_args_cls: type) -> bool:
    """Whether building `server_args_cls` resolves it (`__post_init__`), else `resolve_once`."""
    return dataclasses.is_dataclass(server_args_cls)


def resolved(server_args) -> Any:
    """The server args as SGLang resolved them (a read-only view on 0.5.23)."""
    try:
        from sglang.srt.arg_groups.model_override_base import resolving_view
    except ImportError:  # resolved in place
        return server_args
    return resolving_view(server_args)


def default_attention_backend(server_args) -> str:
    """The attention backend SGLang picks for these args when given none (fa3 on Hopper for
    MHA models), by SGLang's own rule: 0.5.23 keeps it in its resolution pipeline, 0.5.17 on
    ServerArgs."""
    # Both releases memoize the model config they build on the args; this one is built from
    # args not yet resolved, so it is dropped again: SGLang builds its own while resolving.
    memos = ("model_config", "_model_config", "_model_config_built_from")
    had = {m for m in memos if m in getattr(server_args, "__dict__", {})
           or getattr(server_args, m, None) is not None}
    try:
        try:
            from sglang.srt.arg_groups.model_override_base import (get_default_attn_backend,
                                                                   model_config_of,
                                                                   use_mla_backend)
        except ImportError:
            return server_args._get_default_attn_backend(server_args.use_mla_backend(),
                                                         server_args.get_model_config())
        return get_default_attn_backend(server_args, use_mla_backend(server_args),
                                        model_config_of(server_args))
    finally:
        for memo in set(memos) - had:
            if memo in getattr(server_args, "__dict__", {}):
                delattr(server_args, memo)
            elif getattr(server_args, memo, None) is not None:
                setattr(server_args, memo, None)


# ---- A scheduler request's KV bookkeeping.

def req_kv(req) -> Any:
    """What holds `req_pool_idx` and `cache_protected_len` (0.5.23: `req.kv`; 0.5.17's `req.kv`
    holds other fields)."""
    kv = getattr(req, "kv", None)
    return kv if hasattr(kv, "req_pool_idx") else req


def req_pool_idx(req) -> Optional[int]:
    return req_kv(req).req_pool_idx


def cache_protected_len(req) -> int:
    """Leading tokens the prefix cache owns (matched or inserted) for `req`."""
    return int(getattr(req_kv(req), "cache_protected_len", 0) or 0)


def prefix_len(req) -> int:
    """Leading tokens the request's KV slots already hold: where this step's extend starts."""
    if hasattr(req, "prefix_len"):
        return req.prefix_len
    return len(req.prefix_indices) if req.prefix_indices is not None else 0


def extend_range(req) -> Optional[tuple]:
    """(start, end) of this step's extend in the request's tokens; None between steps."""
    if hasattr(req, "extend_end"):
        return None if req.extend_end is None else (req.prefix_len, req.extend_end)
    rng = getattr(req, "extend_range", None)
    return None if rng is None else (rng.start, rng.end)


def holds_no_prefixes(tree_cache) -> bool:
    """Whether the scheduler's prefix cache shares nothing (0.5.17's ChunkCache; on 0.5.23 a
    disabled tree)."""
    if hasattr(tree_cache, "supports_prefix_sharing"):
        return not tree_cache.supports_prefix_sharing()
    return tree_cache.is_chunk_cache()


def charge_prefill_budget(adder, tokens: int) -> None:
    """Count `tokens` more as taken in a `PrefillAdder`'s KV budget, total and this round's
    (0.5.23: its `memory_budget`)."""
    budget = getattr(adder, "memory_budget", None)
    if budget is not None:
        budget.total_offset += tokens
        budget.current_offset += tokens
    else:
        adder.rem_total_token_offset += tokens
        adder.cur_rem_token_offset += tokens


# ---- The model runner's runners.

def loaded_batch(loaded) -> Any:
    """The batch a runner's `load_batch` returned (0.5.23's `PrefillCudaGraphRunner` returns it
    with the shared-read ends of its metadata)."""
    return loaded[0] if isinstance(loaded, tuple) else loaded
