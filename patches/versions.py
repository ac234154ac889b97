"""What differs between the SGLang versions the plugin is written for, in one place.

Everything else in the plugin asks this module instead of testing versions itself:

* `SUPPORTED`: the SGLang releases the plugin has been run on. With `--enable-uniprefill` the
  start-up check (`patches.check_sglang`) refuses any other release, naming what changed.
* Hook rows that exist for some releases only carry a version specifier (`Hook.sglang`), and
  `patches.all_hooks()` keeps only those that contain the installed release (`applies`).
* What moved between the releases surveyed so far (0.5.18-0.5.22 were not), the map for
  porting a patch module:

| | 0.5.17 | 0.5.23 |
|---|---|---|
| prefix cache (`mem_cache/registry.py`; `--radix-cache-backend` in both) | `RadixCache` for a plain model (`UnifiedRadixCache` for hybrid ones or under `SGLANG_ENABLE_UNIFIED_RADIX_TREE`), `ChunkCache` when disabled; `cache_unfinished_req`, `cache_finished_req` | `UnifiedRadixCache` for every model but pure sliding-window ones, also when disabled; `checkpoint`, `on_release` |
| `ServerArgs` | a dataclass | a `msgspec` Struct, resolved by `resolve_once()` |
| request KV fields | `req.req_pool_idx`, `req.cache_protected_len`, `req.extend_range.end` | `req.kv.req_pool_idx`, `req.kv.cache_protected_len`, `req.extend_end` |
"""

from __future__ import annotations

from typing import Optional

from packaging.specifiers import SpecifierSet
from packaging.version import Version

# Widen as each release is run end to end (the CPU suite, `--check`, a GPU run).
SUPPORTED = SpecifierSet(">=0.5.17,<0.5.18")


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
