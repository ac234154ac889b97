"""Hook: `sglang.srt.server_args.ServerArgs` (class REPLACE) and `Engine.server_args_class`.

Why: SGLang builds its CLI and `Engine(**kwargs)` from the ServerArgs dataclass; our subclass adds
the `--enable-uniprefill` / `--uniprefill-*` fields and validates them at start-up.
"""

from uniprefill_sglang.patches.hook_table import Hook


HOOKS = (
    Hook("sglang.srt.server_args.ServerArgs", "replace",
         "uniprefill_sglang.server_args:UniPrefillServerArgs",
         "the --enable-uniprefill flags on every launcher and on sglang.Engine"),
    # Engine binds its class attribute at import, which the replacement above does not reach.
    Hook("sglang.srt.entrypoints.engine.Engine.server_args_class", "assign",
         "uniprefill_sglang.server_args:UniPrefillServerArgs",
         "sglang.Engine(**kwargs) accepts the flags too"),
)
