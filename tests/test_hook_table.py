"""The hook table is the whole list of changes to SGLang, every target exists upstream, and
every hooked function has the parameters the hooks were written for."""

from uniprefill_sglang.patches import all_hooks, register_all
from uniprefill_sglang.patches import hook_table as table_module  # the module


def test_every_registered_hook_is_a_row_and_every_row_is_registered():
    from sglang.srt.plugins.hook_registry import HookRegistry

    register_all()
    ours = {t for t, hooks in HookRegistry._hooks.items()
            if any((getattr(fn, "__module__", "") or "").startswith("uniprefill_sglang")
                   for _, fn, _ in hooks)}
    rows = {h.target for h in all_hooks() if h.kind in ("before", "after", "around", "replace")}
    assert ours == rows


def test_every_target_resolves_on_the_installed_sglang():
    for hook in all_hooks():
        if hook.kind == "instance":
            continue
        assert table_module.resolve_target(hook.target) is not None, hook.target
        assert callable(hook.resolve()), hook.function_name
        assert hook.why


def test_the_table_prints(capsys):
    from uniprefill_sglang.patches.__main__ import main

    assert main([]) == 0
    out = capsys.readouterr().out
    for hook in all_hooks():
        assert hook.target in out


def test_hooked_functions_have_the_recorded_parameters(tmp_path, monkeypatch):
    rows = all_hooks()
    assert table_module.signature_changes(rows) == {}
    # A function upstream changed: named, with what changed.
    target = "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill"
    recorded = tmp_path / "signatures.json"
    recorded.write_text(table_module.SIGNATURES.read_text().replace(
        '"running_batch"]', '"running_batch", "budget"]'))
    monkeypatch.setattr(table_module, "SIGNATURES", recorded)
    changes = table_module.signature_changes(rows)
    assert list(changes) == [target] and "budget" in changes[target]
