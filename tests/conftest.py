"""Shared fixtures: the real SmolLM2-135M-Instruct and SGLang engines on the CPU.

On a machine without CUDA (or with ``UNIPREFILL_CPU_ENGINE=1``) this conftest switches SGLang to
its CPU engine *at import time*, before any test module can import ``sglang``: it sets
``SGLANG_USE_CPU_ENGINE=1`` and puts ``tests/stubs`` (the test-only ``sgl_kernel`` stand-in) first
on ``PYTHONPATH`` and ``sys.path`` (see ``uniprefill_sglang/tools/cpu_engine.py``). With CUDA present
(or ``UNIPREFILL_CPU_ENGINE=0``) nothing is changed.

Engines are expensive here (about 20 s to start on 2 idle cores, a minute when the box is busy),
so tests should share one per configuration: use ``module_engine_factory`` for an engine that
lives for a test module, ``engine_factory`` for one that lives for a single test. Both shut
every engine they built down at teardown, also when the test or the start-up failed.
``Engine.shutdown()`` kills every child process of the pytest process, so never keep an engine
from one factory alive while another factory's engine is shut down.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def _want_cpu_engine() -> bool:
    from uniprefill_sglang import environ

    flag = environ.CPU_ENGINE.get()
    if flag is not None:
        return flag == "1"
    try:
        import torch

        return not torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing or broken
        return True


USE_CPU_ENGINE = _want_cpu_engine()
if USE_CPU_ENGINE:
    from uniprefill_sglang.tools.cpu_engine import activate_cpu_engine_env

    activate_cpu_engine_env(REPO_ROOT)

_ENGINE_STARTS: list[tuple[str, float]] = []


class EngineFactory:
    """``factory(**engine_kwargs)`` builds a CPU engine for SmolLM2 (or ``model_path=...``)."""

    def __init__(self, default_model_path: str):
        self.default_model_path = default_model_path
        self.engines: list = []

    def __call__(self, model_path: str | None = None, **engine_kwargs):
        from uniprefill_sglang.tools.cpu_engine import make_cpu_engine

        if not USE_CPU_ENGINE:
            pytest.skip("CPU engine tests need a machine without CUDA (or UNIPREFILL_CPU_ENGINE=1)")
        t0 = time.perf_counter()
        engine = make_cpu_engine(model_path or self.default_model_path, REPO_ROOT, **engine_kwargs)
        self.engines.append(engine)
        dt = time.perf_counter() - t0
        engine.startup_seconds = dt
        _ENGINE_STARTS.append((", ".join(f"{k}={v}" for k, v in engine_kwargs.items()), dt))
        return engine

    def shutdown_all(self) -> None:
        errors = []
        while self.engines:
            engine = self.engines.pop()
            try:
                engine.shutdown()
            except Exception as e:  # keep shutting the others down
                errors.append(e)
        if errors:
            raise errors[0]


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """Hugging Face folder of SmolLM2-135M-Instruct (converted once, cached; see model_zoo)."""
    from uniprefill_sglang.tools.model_zoo import prepare_smollm2

    return prepare_smollm2()


@pytest.fixture(scope="module")
def module_engine_factory(smollm2_path):
    factory = EngineFactory(smollm2_path)
    try:
        yield factory
    finally:
        factory.shutdown_all()


@pytest.fixture
def engine_factory(smollm2_path):
    factory = EngineFactory(smollm2_path)
    try:
        yield factory
    finally:
        factory.shutdown_all()


def pytest_terminal_summary(terminalreporter):
    if _ENGINE_STARTS:
        terminalreporter.section("SGLang CPU engine start-ups")
        for kwargs, dt in _ENGINE_STARTS:
            terminalreporter.write_line(f"{dt:6.1f} s  {kwargs or '(defaults)'}")
