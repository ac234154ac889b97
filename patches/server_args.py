"""Hook: `sglang.srt.server_args.ServerArgs` (class REPLACE) and `Engine.server_args_class`.

Why: SGLang builds its CLI and `Engine(**kwargs)` from the ServerArgs dataclass; our subclass adds
the `--enable-uniprefill` / `--uniprefill-*` fields and validates them at start-up.
"""

from sglang.srt.plugins.hook_registry import HookRegistry, HookType


def register() -> None:
    from uniprefill_sglang.server_args import UniPrefillServerArgs

    HookRegistry.register("sglang.srt.server_args.ServerArgs", UniPrefillServerArgs,
                          HookType.REPLACE)
    # Engine keeps its own class attribute (bound at import), which the module-level
    # replacement does not reach.
    from sglang.srt.entrypoints.engine import Engine

    if Engine.server_args_class is not UniPrefillServerArgs:
        Engine.server_args_class = UniPrefillServerArgs
