"""Every change uniprefill-sglang makes to SGLang, one module per upstream component.

Each module lists its rows in `HOOKS` (patches/hook_table.py: target, kind, function, why; the
attention adapters' rows come from their adapters), and `all_hooks()` is the one list of them
that the loader registers and `python -m uniprefill_sglang.patches` prints. Nothing in SGLang's
files is edited: `HookRegistry.apply_hooks()` (run by SGLang's plugin loader in the launcher,
in `sglang.Engine` and in every scheduler process) swaps them in. It only logs a target it
cannot resolve and wraps a function whatever its parameters, so the model runner hook checks,
once the model and its attention backends exist, that every hook this process needs took
(`unresolved_hooks`) and that every function they wrap or run beside has parameters recorded
for it in `signatures.json`, on a release of `versions.SUPPORTED` (`check_sglang`): an attention
adapter's hooks are needed where its backend serves the model, every other hook always. Rows
for some SGLang releases only say so (`Hook.sglang`); `all_hooks()` keeps those for the
installed one.
"""

import importlib

from uniprefill_sglang.patches import (
    attention_backends,
    cuda_graphs,
    forward_batch,
    fused_kv_write,
    kv_allocator,
    kv_pool,
    logits,
    metrics,
    model_runner,
    radix_attention,
    radix_cache,
    sampling_params,
    scheduler,
    server_args,
)
from uniprefill_sglang.patches.hook_table import Hook

_MODULES = (server_args, sampling_params, forward_batch, model_runner, logits, scheduler,
            radix_cache, radix_attention, cuda_graphs, metrics, kv_pool, kv_allocator,
            fused_kv_write)


# Test only (UNIPREFILL_TEST_FAULT=hook): a target no SGLang has, to check the start-up refusal.
BROKEN_TEST_TARGET = "sglang.srt.managers.scheduler.Scheduler.uniprefill_test_missing_target"


def all_hooks() -> tuple:
    """Every row for the installed SGLang, in registration order (the test-only broken
    target under its fault)."""
    from uniprefill_sglang import environ

    rows = [hook for module in _MODULES for hook in module.HOOKS]
    rows += attention_backends.adapter_hooks()
    rows = [hook for hook in rows if hook.applies()]
    if environ.TEST_FAULT.get() == "hook":
        rows.append(Hook(BROKEN_TEST_TARGET, "before", lambda *a, **k: None,
                         "test only: a target no SGLang has (UNIPREFILL_TEST_FAULT=hook)"))
    return tuple(rows)


# Adapter rows whose backend module did not import when the loader registered the hooks:
# registered by `unresolved_hooks` once UniPrefill runs, should the module import by then.
_DEFERRED: list = []


def register_all() -> None:
    for hook in all_hooks():
        if hook.backend is not None and not _backend_imports(hook):
            if hook not in _DEFERRED:
                _DEFERRED.append(hook)
        else:
            _register(hook)


def _register(hook) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    kinds = {"before": HookType.BEFORE, "after": HookType.AFTER, "around": HookType.AROUND,
             "replace": HookType.REPLACE}
    if hook.kind in kinds:
        HookRegistry.register(hook.target, hook.resolve(), kinds[hook.kind])
    elif hook.kind == "assign":
        owner, name = hook.target.rsplit(".", 1)
        module, cls = owner.rsplit(".", 1)
        setattr(getattr(__import__(module, fromlist=[cls]), cls), name, hook.resolve())


def _backend_imports(hook) -> bool:
    """Whether the module of an attention adapter's backend imports in this process. Where it
    does not (a backend whose kernels this platform lacks: SGLang's CPU engine cannot import
    some of them), SGLang cannot build that backend either, and registering its hook would
    only have the loader log an import traceback that reads as a failure. Such a row waits in
    `_DEFERRED` (an import cycle at start-up can clear later)."""
    import logging

    module = hook.target.rsplit(".", 2)[0]  # module.Class.method
    try:
        importlib.import_module(module)
        return True
    except Exception as error:  # what the loader's own import would have logged
        logging.getLogger(__name__).debug("UniPrefill: %s not hooked (%s does not import "
                                          "here: %s)", hook.target, module, error)
        return False


def _ours(hooks) -> bool:
    return any((getattr(fn, "__module__", "") or "").startswith("uniprefill_sglang")
               for _, fn, _ in hooks)


def _optional_targets(backend_classes) -> set:
    """The attention adapters' targets of backends not in `backend_classes` (class names)."""
    return {h.target for h in attention_backends.adapter_hooks()
            if h.backend not in set(backend_classes)}


def check_sglang(backend_classes) -> None:
    """Refuse to start on an SGLang release outside `versions.SUPPORTED`, or when a function a
    needed hook wraps or runs beside has parameters none of the recorded ones
    (`signatures.json`): its hook would be handed arguments it was not written for. The
    message also names the needed targets that do not resolve; alone, on a supported release,
    those are left to `unresolved_hooks`."""
    from uniprefill_sglang import versions
    from uniprefill_sglang.patches.hook_table import UNRESOLVED, signature_changes

    optional = _optional_targets(backend_classes)
    changes = signature_changes([h for h in all_hooks() if h.target not in optional])
    changed = {t: c for t, c in changes.items() if not c.startswith(UNRESOLVED)}
    missing = sorted(set(changes) - set(changed))
    release = versions.installed()
    problems = []
    if not versions.supported():
        problems.append(f"SGLang {release} is not a supported release")
    if changed:
        problems.append(f"hooked SGLang function(s) changed on SGLang {release}: " + "; ".join(
            f"{target}: {change}" for target, change in changed.items()))
    if problems and missing:
        problems.append(f"hook target(s) {', '.join(missing)} did not resolve")
    if problems:
        raise RuntimeError(
            "UniPrefill: " + "; and ".join(problems)
            + f". This plugin supports SGLang {versions.SUPPORTED}. "
            "Start without --enable-uniprefill, or install a supported SGLang")


def unresolved_hooks(backend_classes) -> list:
    """The plugin's hook targets that are not patched in this process and that it needs:
    every target but the attention adapters of backends not in `backend_classes` (class
    names). `check_sglang` runs first (and raises). Targets
    are retried: a module that could not be imported when SGLang's loader ran (an import
    cycle at start-up) usually can be now."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    check_sglang(backend_classes)
    optional = _optional_targets(backend_classes)
    for hook in [h for h in _DEFERRED if _backend_imports(h)]:
        _DEFERRED.remove(hook)
        _register(hook)
    HookRegistry.apply_hooks()  # patched targets are skipped
    return sorted(t for t, hooks in HookRegistry._hooks.items()
                  if _ours(hooks) and t not in HookRegistry._patched and t not in optional)


# The model runner's start-up check (one of the table's rows, it cannot import the table).
model_runner.use_hook_check(unresolved_hooks)
