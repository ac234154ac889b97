"""Run stock SGLang 0.5.17's CPU engine (``sglang.Engine``) on a machine without a GPU.

Used by the CPU test suite and CPU demos; nothing here is needed on a GPU machine.

What SGLang's CPU path needs (found by running it):

* ``SGLANG_USE_CPU_ENGINE=1`` in the environment **before ``sglang`` is imported**: about fifty
  SGLang modules evaluate ``_is_cpu = is_cpu()`` at import time (and ``is_cpu`` is cached).
* An importable ``sgl_kernel``. PyPI has no CPU build; the ``sglang-kernel`` wheel is a CUDA build
  that fails to import here. The test-only stub in ``tests/stubs/sgl_kernel`` (every kernel call
  raises) is enough for Llama-family models with ``attention_backend="torch_native"``. It must be
  first on ``PYTHONPATH`` (the env var: the scheduler and detokenizer are *spawned* processes).
* ``device="cpu"``, ``attention_backend="torch_native"``; CUDA graphs are switched off anyway
  (we pass ``disable_cuda_graph=True`` to say so).
* An explicit ``dtype``: with ``dtype="auto"`` SGLang turns a float32 checkpoint into **float16**,
  and float16 matmuls on this CPU (AVX512-BF16, no AMX-FP16) are 4-6x slower than float32. We
  default to ``"float32"`` (the exact dequantised GGUF weights; stable greedy outputs for A/B
  comparisons). ``"bfloat16"`` is ~1.4x faster end to end (prefill 2K/4K/6K tokens: 3.1/8.5/15 s
  against 4.3/11.3/21 s for float32 on 2 idle cores); it got its 3 pass-key probes right too.
* ``max_total_tokens`` explicitly (otherwise SGLang sizes the KV pool from a fraction of host RAM).
* Nothing else: no ``SGLANG_CPU_OMP_THREADS_BIND`` (without AMX SGLang skips its thread binding
  and only logs a warning), no warm-up switch (``Engine`` does not warm up; only the HTTP server
  does), no tokenizer settings.

Caveats: x86 only (on arm64 SGLang calls ``torch.ops.sgl_kernel.init_cpu_threads_env``, which the
stub cannot provide; on AMX machines SGLang checks ``torch.ops.sgl_kernel.convert_weight_packed``
first, so the stub keeps the plain-torch path). One engine is ~5 GB of RSS over its three
processes (fp32, 32K-token KV pool): several engines at once on a 24 GB box get OOM-killed.
torch_native's extend recomputes attention for the cached prefix rows too (it pads the query to
the full sequence), so a 1-token extend after a cached 4K prefix costs about a 4K prefill's
attention; decode is ~0.15 s/token at 2-6K context.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any, Mapping

from uniprefill_sglang import environ

STUB_ENV_VAR = environ.SGL_KERNEL_STUB_DIR.name
REPO_ROOT_ENV_VAR = environ.REPO_ROOT.name

# Defaults for a 2-core / 24 GB box and SmolLM2-135M (8K context). Any can be overridden.
DEFAULT_ENGINE_KWARGS: dict[str, Any] = dict(
    device="cpu",
    attention_backend="torch_native",
    disable_cuda_graph=True,
    dtype="float32",
    context_length=8192,
    max_total_tokens=32768,  # KV pool: 32K tokens (1.4 GB at fp32 for SmolLM2)
    chunked_prefill_size=8192,  # one prefill step per prompt unless a test asks for chunking
    max_prefill_tokens=8192,
    max_running_requests=16,
    random_seed=0,
    log_level="error",
)


def find_stub_dir(repo_root: str | os.PathLike | None = None) -> Path:
    """Folder to put on PYTHONPATH so that ``import sgl_kernel`` finds the test stub.

    Looked up, in order: ``repo_root/tests/stubs`` if ``repo_root`` is given; env
    ``UNIPREFILL_SGL_KERNEL_STUB_DIR``; ``$UNIPREFILL_REPO_ROOT/tests/stubs``; ``tests/stubs``
    next to the ``uniprefill_sglang`` folder (a source checkout or an editable install).
    """
    candidates: list[tuple[str, Path]] = []
    if repo_root is not None:
        candidates.append(("repo_root argument", Path(repo_root) / "tests" / "stubs"))
    else:
        if environ.SGL_KERNEL_STUB_DIR.get():
            candidates.append((STUB_ENV_VAR, Path(environ.SGL_KERNEL_STUB_DIR.get())))
        if environ.REPO_ROOT.get():
            candidates.append(
                (REPO_ROOT_ENV_VAR, Path(environ.REPO_ROOT.get()) / "tests" / "stubs")
            )
        candidates.append(
            ("package checkout", Path(__file__).resolve().parents[2] / "tests" / "stubs")
        )
    for _, c in candidates:
        if (c / "sgl_kernel" / "__init__.py").is_file():
            return c.resolve()
    tried = "; ".join(f"{src}: {c}" for src, c in candidates)
    raise FileNotFoundError(
        "sgl_kernel CPU test stub not found (looked for <dir>/sgl_kernel/__init__.py in "
        f"{tried}). Pass repo_root= or set {REPO_ROOT_ENV_VAR}."
    )


def cpu_engine_env(
    repo_root: str | os.PathLike | None = None, base_env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The env vars the CPU engine needs (only those; merge them into ``os.environ`` yourself).

    ``PYTHONPATH`` is the stub folder followed by ``base_env``'s (default ``os.environ``)
    existing ``PYTHONPATH``, so the stub shadows the CUDA ``sgl_kernel`` from ``sglang-kernel``.
    """
    base = os.environ if base_env is None else base_env
    stub = str(find_stub_dir(repo_root))
    old = [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p and p != stub]
    return {
        "SGLANG_USE_CPU_ENGINE": "1",
        "PYTHONPATH": os.pathsep.join([stub, *old]),
        # The kernel version check only runs on CUDA; set it anyway so no path trips on the stub.
        "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1",
        # Tokenizer threads would only compete with the scheduler for the 2 cores.
        "TOKENIZERS_PARALLELISM": "false",
    }


def activate_cpu_engine_env(repo_root: str | os.PathLike | None = None) -> dict[str, str]:
    """Apply ``cpu_engine_env()`` to this process (``os.environ`` and ``sys.path``).

    Call before anything imports ``sglang`` (conftest does it at import time). Raises if
    ``sglang`` or a non-stub ``sgl_kernel`` was already imported in a way that cannot be fixed.
    """
    env = cpu_engine_env(repo_root)
    os.environ.update(env)
    stub = env["PYTHONPATH"].split(os.pathsep)[0]
    if stub in sys.path:
        sys.path.remove(stub)
    sys.path.insert(0, stub)
    _check_process_state()
    return env


def _check_process_state() -> None:
    sk = sys.modules.get("sgl_kernel")
    if sk is not None and not getattr(sk, "IS_UNIPREFILL_TEST_STUB", False):
        raise RuntimeError(
            "a real sgl_kernel is already imported in this process; activate the CPU engine env "
            "(uniprefill_sglang.tools.cpu_engine.activate_cpu_engine_env) before importing sglang"
        )
    common = sys.modules.get("sglang.srt.utils.common")
    if common is not None and not common.is_cpu():
        raise RuntimeError(
            "sglang was imported before SGLANG_USE_CPU_ENGINE=1 was set, so its modules cached "
            "is_cpu()=False; activate the CPU engine env before importing sglang"
        )


def make_cpu_engine(model_path: str, repo_root: str | os.PathLike | None = None, **engine_kwargs):
    """Build an ``sglang.Engine`` on the CPU with ``DEFAULT_ENGINE_KWARGS`` (overridable).

    The caller owns the engine and must call ``engine.shutdown()`` (it kills every child
    process of this process, so do not run two engines side by side and shut only one down).
    """
    activate_cpu_engine_env(repo_root)
    import sglang

    kwargs = {**DEFAULT_ENGINE_KWARGS, **engine_kwargs}
    return sglang.Engine(model_path=model_path, **kwargs)


@contextlib.contextmanager
def triton_interpreter():
    """Engines started inside run SGLang's Triton kernels on the CPU through Triton's
    interpreter (slow: for small models). Their scheduler processes inherit the variable when
    they are spawned; this process gets its environment back afterwards."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


def flush_cache(engine, timeout_s: float = 60.0) -> None:
    """Empty an engine's radix cache. SGLang refuses while the last request is still leaving the
    scheduler (the response can arrive first), so retry until it is idle."""
    deadline = time.monotonic() + timeout_s
    while not engine.flush_cache().success:
        assert time.monotonic() < deadline, "radix cache flush kept being refused"
        time.sleep(0.1)


def uniprefill_state(engine) -> dict:
    """The scheduler's `uniprefill` state (patches/scheduler.py) from `get_server_info`."""
    return engine.get_server_info()["internal_states"][0]["uniprefill"]


def idle_state(engine, timeout_s: float = 60.0) -> dict:
    """The `uniprefill` state once the scheduler is idle. A response can arrive before its
    request has left the scheduler, and the pool checks (`kv_pool_problems`) run only when idle."""
    deadline = time.monotonic() + timeout_s
    while not (state := uniprefill_state(engine))["idle"]:
        assert time.monotonic() < deadline, "the engine never became idle"
        time.sleep(0.2)
    return state
