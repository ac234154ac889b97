"""Every change uniprefill-sglang makes to SGLang, one module per upstream component.

Each module lists its rows in `HOOKS` (patches/hook_table.py: target, kind, function, why; the
attention adapters' rows come from their adapters), and `all_hooks()` is the one list of them
that the loader registers and `python -m uniprefill_sglang.patches` prints. Nothing in SGLang's
files is edited: `HookRegistry.apply_hooks()` (run by SGLang's plugin loader in the launcher,
in `sglang.Engine` and in every scheduler process) swaps them in. It only logs a target it
cannot resolve, so the model runner hook checks, once the model and its attention backends
exist, that every hook this process needs took (`unresolved_hooks`): an attention adapter's
hooks are needed where its backend serves the model, every other hook always.
"""

from uniprefill_sglang.patches import (
    attention_backends,
    cuda_graphs,
    forward_batch,
    kv_allocator,
    kv_pool,
    logits,
    metrics,
    model_runner,
    radix_cache,
    sampling_params,
    scheduler,
    server_args,
)
from uniprefill_sglang.patches.hook_table import Hook

_MODULES = (server_args, sampling_params, forward_batch, model_runner, logits, scheduler,
            radix_cache, cuda_graphs, metrics, kv_pool, kv_allocator)


# Test only (UNIPREFILL_TEST_FAULT=hook): a target no SGLang has, to check the start-up refusal.
BROKEN_TEST_TARGET = "sglang.srt.managers.scheduler.Scheduler.uniprefill_test_missing_target"


def all_hooks() -> tuple:
    """Every row, in registration order (the test-only broken target under its fault)."""
    from uniprefill_sglang import environ

    rows = [hook for module in _MODULES for hook in module.HOOKS]
    rows += attention_backends.adapter_hooks()
    if environ.TEST_FAULT.get() == "hook":
        rows.append(Hook(BROKEN_TEST_TARGET, "before", lambda *a, **k: None,
                         "test only: a target no SGLang has (UNIPREFILL_TEST_FAULT=hook)"))
    return tuple(rows)


def register_all() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    kinds = {"before": HookType.BEFORE, "after": HookType.AFTER, "around": HookType.AROUND,
             "replace": HookType.REPLACE}
    for hook in all_hooks():
        if hook.kind in kinds:
            HookRegistry.register(hook.target, hook.resolve(), kinds[hook.kind])
        elif hook.kind == "assign":
            owner, name = hook.target.rsplit(".", 1)
            module, cls = owner.rsplit(".", 1)
            setattr(getattr(__import__(module, fromlist=[cls]), cls), name, hook.resolve())


def _ours(hooks) -> bool:
    return any((getattr(fn, "__module__", "") or "").startswith("uniprefill_sglang")
               for _, fn, _ in hooks)


def unresolved_hooks(backend_classes) -> list:
    """The plugin's hook targets that are not patched in this process and that it needs:
    every target but the attention adapters of backends not in `backend_classes` (class
    names). Targets are retried first: a module that could not be imported when SGLang's
    loader ran (an import cycle at start-up) usually can be now."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    optional = {h.target for h in attention_backends.adapter_hooks()
                if h.backend not in set(backend_classes)}
    HookRegistry.apply_hooks()  # patched targets are skipped
    return sorted(t for t, hooks in HookRegistry._hooks.items()
                  if _ours(hooks) and t not in HookRegistry._patched and t not in optional)
