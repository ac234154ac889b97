"""The hook table is the whole list of changes to SGLang, every target exists upstream, every
hooked function has the parameters the hooks were written for, and start-up refuses an SGLang
whose hooked functions changed or that is not a supported release."""

import json
from types import SimpleNamespace

import pytest

from uniprefill_sglang.patches import all_hooks, check_sglang, register_all
from uniprefill_sglang.patches import hook_table as table_module  # the module

RECORD = table_module.SIGNATURES  # the shipped record


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


def _record_with(tmp_path, monkeypatch, target, by_version):
    """Point the check at a copy of the record in which `target` has `by_version`."""
    recorded = json.loads(RECORD.read_text())
    recorded[target] = by_version
    path = tmp_path / "signatures.json"
    path.write_text(json.dumps(recorded))
    monkeypatch.setattr(table_module, "SIGNATURES", path)


def test_hooked_functions_have_the_recorded_parameters(tmp_path, monkeypatch):
    rows = all_hooks()
    assert table_module.signature_changes(rows) == {}
    # A function upstream changed: named, with what changed.
    target = "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill"
    _record_with(tmp_path, monkeypatch, target, {"0.5.17": ["self", "running_batch", "budget"]})
    changes = table_module.signature_changes(rows)
    assert list(changes) == [target] and "budget" in changes[target]


def test_any_recorded_version_of_a_signature_is_accepted(tmp_path, monkeypatch):
    target = "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill"
    now = table_module.parameters(target)
    _record_with(tmp_path, monkeypatch, target,
                 {"0.5.17": now, "99.0.0": ["self", "running_batch", "budget"]})
    assert table_module.signature_changes(all_hooks()) == {}


def test_record_writes_the_installed_version_and_keeps_the_others(tmp_path, monkeypatch):
    import sglang

    from uniprefill_sglang.patches.__main__ import main

    target = "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill"
    _record_with(tmp_path, monkeypatch, target, {"99.0.0": ["self", "budget"],
                                                 sglang.__version__: ["self"]})
    assert main(["--record"]) == 0
    recorded = table_module.recorded_signatures()
    assert recorded[target] == {sglang.__version__: table_module.parameters(target),
                                "99.0.0": ["self", "budget"]}
    assert list(recorded[target]) == sorted(recorded[target], key=table_module.Version)
    # Every target keeps its record, also those of rows for other releases only.
    assert set(recorded) == set(json.loads(RECORD.read_text()))
    assert all(sglang.__version__ in recorded[t] for t in table_module.signed(all_hooks()))


def test_start_up_refuses_a_hooked_function_whose_parameters_changed(tmp_path, monkeypatch):
    """The model runner hook's start-up check, on the installed SGLang, against a record in
    which one hooked function has other parameters: it refuses before patching anything and
    names the target, what changed and SGLang's version."""
    import sglang
    from sglang.srt.plugins.hook_registry import HookRegistry

    from uniprefill_sglang.patches.model_runner import _check_hooks

    def no_patching():
        raise AssertionError("hooks were applied before the signature check")

    monkeypatch.setattr(HookRegistry, "apply_hooks", no_patching)
    target = "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill"
    now = table_module.parameters(target)
    _record_with(tmp_path, monkeypatch, target, {"0.5.17": now + ["budget"]})
    with pytest.raises(RuntimeError) as refused:
        _check_hooks(SimpleNamespace(attn_backend=None))
    message = str(refused.value)
    assert (f"changed on SGLang {sglang.__version__}: {target}: drops ['budget'] against its "
            "parameters on SGLang 0.5.17.") in message, message
    assert "Start without --enable-uniprefill" in message
    # An attention adapter's hook is checked only where its backend serves.
    target = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.forward_extend"
    _record_with(tmp_path, monkeypatch, target, {"0.5.17": ["self", "q"]})
    with pytest.raises(RuntimeError, match="TritonAttnBackend.forward_extend: adds"):
        check_sglang({"TritonAttnBackend"})
    check_sglang({"TorchNativeAttnBackend"})


def test_a_signature_refusal_also_names_the_targets_that_do_not_resolve(monkeypatch):
    from uniprefill_sglang import environ
    from uniprefill_sglang.patches import BROKEN_TEST_TARGET

    monkeypatch.setenv(environ.TEST_FAULT.name, "hook")  # adds a target no SGLang has
    check_sglang(set())  # alone, it is left to unresolved_hooks
    target = "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill"
    now = table_module.parameters(target)
    recorded = json.loads(RECORD.read_text())
    recorded[target] = {"0.5.17": now[::-1]}
    monkeypatch.setattr(table_module, "recorded_signatures", lambda: recorded)
    with pytest.raises(RuntimeError) as refused:
        check_sglang(set())
    message = str(refused.value)
    assert f"{target}: parameters reordered to {now} from {now[::-1]} (SGLang 0.5.17)" in message
    assert f"; and hook target(s) {BROKEN_TEST_TARGET} did not resolve." in message, message


def test_start_up_refuses_a_release_outside_the_supported_ones(monkeypatch, capsys):
    from packaging.version import Version

    from uniprefill_sglang import versions
    from uniprefill_sglang.patches.__main__ import main

    assert main(["--check"]) == 0
    # A release between the checked ones, never installed.
    monkeypatch.setattr(versions, "installed", lambda: Version("0.5.20"))
    assert main(["--check"]) == 1
    assert f"not a supported release ({versions.SUPPORTED})" in capsys.readouterr().out
    with pytest.raises(RuntimeError) as refused:
        check_sglang(set())
    assert str(refused.value).startswith(
        f"UniPrefill: SGLang 0.5.20 is not a supported release. This plugin supports SGLang "
        f"{versions.SUPPORTED}. Start without --enable-uniprefill"), refused.value


def test_rows_for_other_releases_are_left_out(monkeypatch):
    from uniprefill_sglang import versions
    from uniprefill_sglang.patches import radix_cache
    from uniprefill_sglang.patches.hook_table import Hook

    later = Hook("sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.checkpoint",
                 "around", lambda original, *a, **k: original(*a, **k), "test",
                 sglang=f">{versions.installed()}")
    now = Hook("sglang.srt.mem_cache.radix_cache.RadixCache.insert", "after",
               lambda result, *a, **k: result, "test", sglang=f"=={versions.installed()}")
    monkeypatch.setattr(radix_cache, "HOOKS", radix_cache.HOOKS + (later, now))
    rows = all_hooks()
    assert now in rows and later not in rows


def test_parameters_read_from_source_match_the_record():
    """The source reading that serves targets whose module does not import here (FA3's) gives
    the parameters recorded for the installed SGLang (by `inspect` where the module imports)."""
    import sglang

    recorded, checked = table_module.recorded_signatures(), 0
    for target in table_module.signed(all_hooks()):
        try:
            from_source = table_module.source_parameters(target)
        except ImportError:  # a method inherited or assigned, not defined in its class body
            continue
        assert from_source == recorded[target][sglang.__version__], target
        checked += 1
    assert checked >= 10
    with pytest.raises(ImportError):
        table_module.source_parameters("sglang.srt.managers.scheduler.Scheduler.no_such_method")
