"""Every SGLang hook of uniprefill-sglang, one module per upstream component.

Each module has a `register()` that registers its hooks with SGLang's
`HookRegistry`; each hook's docstring names the upstream function it changes and why.
Nothing in SGLang's files is edited: `HookRegistry.apply_hooks()` (run by SGLang's plugin loader
in the launcher, in `sglang.Engine` and in every scheduler process) swaps them in.
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


def register_all() -> None:
    for module in _MODULES:
        module.register()
