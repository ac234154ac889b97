"""Triton-interpreter plumbing for CPU test modules of Triton kernels.

The interpreter only works if ``TRITON_INTERPRET=1`` is set before triton is first imported
(triton's own @jit helpers such as tl.sum are decorated at import), and a process that set it
can no longer compile GPU kernels.  Importing this module, before the kernels under test,
decides once per process:

* ``RUN_IN_PROCESS`` True: no GPU is visible and triton is either not imported yet (the
  variable is then set here) or was already imported in interpreter mode; the tests run here;
* otherwise the in-process tests skip and a test calls ``run_file_in_subprocess(__file__)``,
  which re-runs the module in a fresh interpreter-mode python process.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

SUBPROCESS_ENV = "UNIPREFILL_KERNEL_TESTS_SUBPROCESS"


def _imported_in_interpreter_mode() -> bool:
    if "triton" not in sys.modules:
        return False
    import triton.language as tl

    return type(tl.standard.sum).__name__ == "InterpretedFunction"


RUN_IN_PROCESS = os.environ.get(SUBPROCESS_ENV) == "1" or (
    not torch.cuda.is_available()
    and ("triton" not in sys.modules or _imported_in_interpreter_mode())
)
if RUN_IN_PROCESS:
    os.environ["TRITON_INTERPRET"] = "1"

SKIP_REASON = "triton already imported for the GPU, or a GPU visible: covered by the subprocess run"


def run_file_in_subprocess(test_file: str, timeout: float = 1800) -> None:
    """Run the pytest module ``test_file`` in a fresh python with the interpreter on and no GPU."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    env[SUBPROCESS_ENV] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", os.path.abspath(test_file)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout[-8000:] + res.stderr[-4000:]


def subprocess_suite(test_file: str):
    """A module's `test_cpu_suite_in_subprocess`: where this process cannot run its Triton tests
    under the interpreter (`RUN_IN_PROCESS` false), it runs the whole module in a fresh python
    (`run_file_in_subprocess`); in that fresh python it skips."""
    import pytest

    @pytest.mark.slow
    def test_cpu_suite_in_subprocess():
        if RUN_IN_PROCESS:
            pytest.skip("interpreter tests run in this process")
        run_file_in_subprocess(test_file)

    return test_cpu_suite_in_subprocess
