"""Environment switches: declared once (uniprefill_sglang/environ.py), read by one rule, and
documented in the README."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from uniprefill_sglang import environ

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("YES", True), (" on ", True),
                                       ("0", False), ("", False), ("off", False), ("2", False)])
def test_one_truthiness_rule(monkeypatch, value, on):
    for flag in (s for s in environ.ALL if isinstance(s, environ.Flag)):
        monkeypatch.setenv(flag.name, value)
        assert flag.get() is on, flag.name


def test_a_choice_names_its_variable_when_misspelt(monkeypatch):
    monkeypatch.setenv(environ.TEST_FAULT.name, "dorp")
    with pytest.raises(ValueError, match="UNIPREFILL_TEST_FAULT"):
        environ.TEST_FAULT.get()
    monkeypatch.delenv(environ.TEST_FAULT.name)
    assert environ.TEST_FAULT.get() is None


def test_every_switch_is_documented_and_read_only_through_environ():
    readme = (REPO / "README.md").read_text()
    for switch in environ.ALL:
        assert f"`{switch.name}" in readme, f"{switch.name} is missing from the README"
    for path in [*REPO.glob("uniprefill_sglang/**/*.py"), *REPO.glob("kernels/*.py"),
                 *REPO.glob("patches/*.py"), REPO / "tests" / "conftest.py"]:
        if path.name == "environ.py":
            continue
        read_here = re.findall(r"""environ(?:\.get\(|\[)["'](UNIPREFILL_[A-Z_]+)""", path.read_text())
        assert not read_here, f"{path} reads {read_here} itself: declare it in environ.py"


@pytest.mark.parametrize("force_reference, force_triton, path", [
    ("0", "0", None), ("1", "0", "reference"), ("0", "1", "triton"), ("1", "1", "reference")])
def test_the_kernel_switches_become_the_kernels_path_argument(monkeypatch, force_reference,
                                                              force_triton, path):
    import torch

    from uniprefill_sglang import kernels

    monkeypatch.setenv(environ.FORCE_REFERENCE.name, force_reference)
    monkeypatch.setenv(environ.FORCE_TRITON.name, force_triton)
    assert environ.kernel_path() == path
    assert kernels.use_triton(torch.device("cpu"), environ.kernel_path()) is (path == "triton")
