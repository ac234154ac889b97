"""Every SGLang hook of uniprefill-sglang, one module per upstream component.

Each module has a `register()` that registers its hooks with SGLang's
`HookRegistry`; each hook's docstring names the upstream function it changes and why.
Nothing in SGLang's files is edited: `HookRegistry.apply_hooks()` (run by SGLang's plugin loader
in the launcher, in `sglang.Engine` and in every scheduler process) swaps them in. It only logs
a target it cannot resolve, so the model runner hook checks, once the model and its attention
backends exist, that every hook this process needs took (`unresolved_hooks`): an attention
adapter's hooks are needed where its backend serves the model, every other hook always.
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

_MODULES = (server_args, sampling_params, forward_batch, model_runner, logits, attention_backends,
            scheduler, radix_cache, cuda_graphs, metrics, kv_pool,
            kv_allocator)


# Test only (UNIPREFILL_TEST_FAULT=hook): a target no SGLang has, to check the start-up refusal.
BROKEN_TEST_TARGET = "sglang.srt.managers.scheduler.Scheduler.uniprefill_test_missing_target"


def register_all() -> None:
    from uniprefill_sglang import environ

    for module in _MODULES:
        module.register()
    if environ.TEST_FAULT.get() == "hook":
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(BROKEN_TEST_TARGET, lambda *a, **k: None, HookType.BEFORE)


def _ours(hooks) -> bool:
    return any((getattr(fn, "__module__", "") or "").startswith("uniprefill_sglang")
               for _, fn, _ in hooks)


def unresolved_hooks(backend_classes) -> list:
    """The plugin's hook targets that are not patched in this process and that it needs:
    every target but the attention adapters of backends not in `backend_classes` (class
    names). Targets are retried first: a module that could not be imported when SGLang's
    loader ran (an import cycle at start-up) usually can be now."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from uniprefill_sglang.backends import adapters

    optional = {a.target for a in adapters() if a.class_name not in set(backend_classes)}
    HookRegistry.apply_hooks()  # patched targets are skipped
    return sorted(t for t, hooks in HookRegistry._hooks.items()
                  if _ours(hooks) and t not in HookRegistry._patched
                  and t.rsplit(".", 1)[0] not in optional)
