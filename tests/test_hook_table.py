"""The hook table is the whole list of changes to SGLang, and every target exists upstream."""

import importlib

from uniprefill_sglang.patches import hook_table, register_all


def _resolve(target: str):
    parts = target.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(target)


def test_every_registered_hook_is_a_row_and_every_row_is_registered():
    from sglang.srt.plugins.hook_registry import HookRegistry

    register_all()
    ours = {t for t, hooks in HookRegistry._hooks.items()
            if any((getattr(fn, "__module__", "") or "").startswith("uniprefill_sglang")
                   for _, fn, _ in hooks)}
    rows = {h.target for h in hook_table() if h.kind in ("before", "after", "around", "replace")}
    assert ours == rows


def test_every_target_resolves_on_the_installed_sglang():
    for hook in hook_table():
        if hook.kind == "instance":
            continue
        assert _resolve(hook.target) is not None, hook.target
        assert callable(hook.resolve()), hook.function_name
        assert hook.why


def test_the_table_prints(capsys):
    from uniprefill_sglang.patches.__main__ import main

    main()
    out = capsys.readouterr().out
    for hook in hook_table():
        assert hook.target in out
