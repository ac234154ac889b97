"""TEST-ONLY stand-in for the CPU build of ``sgl_kernel`` (never ship or install this).

Why: SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) imports ``sgl_kernel`` and some of its
submodules at start-up, but PyPI has no CPU build of sgl-kernel; the ``sglang-kernel`` wheel that
``pip install sglang`` brings is a CUDA build whose ``import sgl_kernel`` fails on a machine
without CUDA (``No module named 'common_ops'``). For a Llama-family model with
``attention_backend="torch_native"`` the CPU path only *imports* names from sgl_kernel and falls
back to plain torch for the actual math, so an importable module is enough.

How: put the folder that contains this package (``tests/stubs``) FIRST on ``PYTHONPATH`` (the
environment variable, not just ``sys.path``: SGLang starts its scheduler/detokenizer processes
with ``spawn`` and they must import the stub too). Then:

* ``import sgl_kernel`` / ``import sgl_kernel.<anything>`` / ``from sgl_kernel.x.y import z``
  all succeed: every submodule is synthesised on demand by a meta-path finder;
* every name looked up on those modules is a ``_StubKernel`` object; calling it (or calling any
  attribute reached from it) raises ``RuntimeError("sgl_kernel CPU stub: <name> called")``, so
  any real use of a kernel is loud instead of silently wrong;
* but for the Gated DeltaNet layer (Qwen3-Next): its CPU kernels, ``sgl_kernel.mamba``'s
  ``causal_conv1d_fn_cpu``, ``causal_conv1d_update_cpu``, ``chunk_gated_delta_rule_cpu`` and
  ``torch.ops.sgl_kernel``'s ``fused_gdn_gating_cpu`` and
  ``fused_sigmoid_gating_delta_rule_update_cpu``, run the torch references of
  ``linear_attention_reference`` (beside this package).

``uniprefill_sglang.tools.cpu_engine.cpu_engine_env()`` builds the right ``PYTHONPATH``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+cpu-test-stub"
IS_UNIPREFILL_TEST_STUB = True


class _StubKernel:
    """Placeholder for any sgl_kernel attribute; raises when called."""

    __slots__ = ("_name",)

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"sgl_kernel CPU stub: {self._name} called")

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _StubKernel(f"{self._name}.{attr}")

    def __repr__(self) -> str:
        return f"<sgl_kernel CPU stub {self._name}>"


def _module_getattr(modname: str):
    def __getattr__(attr: str):
        # Dunders (``__path__``, ``__file__``, ``__wrapped__``...) must stay missing so that the
        # import system and inspect/doctest/pytest introspection behave normally.
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(f"module {modname!r} has no attribute {attr!r}")
        return _StubKernel(f"{modname}.{attr}")

    return __getattr__


__getattr__ = _module_getattr(__name__)


def _gdn_kernels() -> dict:
    """The Gated DeltaNet CPU kernels SGLang calls, by name, as their torch references."""
    import linear_attention_reference as ref

    return {"causal_conv1d_fn_cpu": ref.causal_conv1d_varlen,
            "causal_conv1d_update_cpu": ref.causal_conv1d_step,
            "chunk_gated_delta_rule_cpu": ref.gated_delta_rule_varlen,
            "fused_gdn_gating_cpu": ref.gdn_gating,
            "fused_sigmoid_gating_delta_rule_update_cpu": ref.gated_delta_rule_decode}


_MAMBA_KERNELS = ("causal_conv1d_fn_cpu", "causal_conv1d_update_cpu",
                  "chunk_gated_delta_rule_cpu")
_TORCH_OPS = ("fused_gdn_gating_cpu", "fused_sigmoid_gating_delta_rule_update_cpu")


def _register_torch_ops() -> None:
    """SGLang looks these up on ``torch.ops.sgl_kernel`` when its GDN backend is imported."""
    import torch

    kernels = _gdn_kernels()
    for name in _TORCH_OPS:
        setattr(torch.ops.sgl_kernel, name, kernels[name])


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return types.ModuleType(spec.name)

    def exec_module(self, module):
        module.__getattr__ = _module_getattr(module.__name__)
        module.__doc__ = f"sgl_kernel CPU test stub submodule {module.__name__}"
        module.IS_UNIPREFILL_TEST_STUB = True
        if module.__name__ == __name__ + ".mamba":
            kernels = _gdn_kernels()
            for name in _MAMBA_KERNELS:
                setattr(module, name, kernels[name])
            _register_torch_ops()


class _StubFinder(importlib.abc.MetaPathFinder):
    """Synthesises any ``sgl_kernel.<sub>[.<subsub>...]`` as a package of stubs."""

    _loader = _StubLoader()

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(__name__ + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self._loader, is_package=True)


if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _StubFinder())
