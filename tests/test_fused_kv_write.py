"""The fused rotary KV write (patches/fused_kv_write.py): off once UniPrefill has changed a
forward's rows, as the model sees the switch, and hooked in every supported model that binds it."""

import importlib
import pkgutil
from types import SimpleNamespace

import pytest

from uniprefill_sglang.architectures import SUPPORTED_NAMES
from uniprefill_sglang.context import DropContext
from uniprefill_sglang.patches import fused_kv_write
from uniprefill_sglang.request_plan import ForwardInputs


def _sglang_model_modules():
    import sglang.srt.models as models

    for info in pkgutil.iter_modules(models.__path__):
        name = f"{models.__name__}.{info.name}"
        try:
            yield name, importlib.import_module(name)
        except Exception:  # noqa: BLE001  a model module that needs CUDA or extras: not ours
            continue


@pytest.mark.slow  # imports every SGLang model module (about 20 s)
def test_every_supported_model_that_binds_the_switch_has_it_hooked():
    binding = set()
    for name, module in _sglang_model_modules():
        entries = getattr(module, "EntryClass", [])
        entries = entries if isinstance(entries, (list, tuple)) else [entries]
        serves = {cls.__name__ for cls in entries} & SUPPORTED_NAMES
        if serves and hasattr(module, "enable_fused_set_kv_buffer"):
            binding.add(name)
    assert "sglang.srt.models.qwen3_moe" in binding
    assert binding <= set(fused_kv_write.MODEL_MODULES), binding - set(fused_kv_write.MODEL_MODULES)


@pytest.mark.parametrize("compacted", [False, True])
def test_the_switch_is_off_only_after_a_drop(compacted):
    calls = []

    def original(forward_batch):
        calls.append(forward_batch)
        return True

    batch = SimpleNamespace(uniprefill_inputs=ForwardInputs(req_rows=None))
    ctx = DropContext(plan=None, forward_batch=batch, is_extend=True)
    ctx.survivors.compacted = compacted
    batch.uniprefill_inputs.drop_context = ctx
    assert fused_kv_write._not_after_a_drop(original, batch) is (not compacted)
    assert calls == ([] if compacted else [batch])
    batch.uniprefill_inputs.drop_context = None
    assert fused_kv_write._not_after_a_drop(original, batch) is True  # between forwards
