"""Server args as `python -m sglang.launch_server` makes them, for the tests of the flags."""

from __future__ import annotations


def launcher_server_args(argv: list):
    """Load the plugins (the launcher's first step), parse `argv` and resolve the result: on
    SGLang 0.5.23 `prepare_server_args` leaves that to `resolve_once`, which the launchers call."""
    from sglang.srt import server_args as sa
    from sglang.srt.plugins import load_plugins

    from uniprefill_sglang import versions

    load_plugins()
    args = sa.prepare_server_args(argv)
    if not versions.resolves_when_built(type(args)):
        args.resolve_once()
    return args
