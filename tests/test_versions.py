"""uniprefill_sglang/versions.py: the supported releases and rows limited to some releases."""

from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from uniprefill_sglang import versions


def test_the_installed_release_is_supported():
    import sglang

    assert versions.installed() == Version(sglang.__version__)
    assert versions.supported()
    assert versions.supported(Version("0.5.17.post1"))
    assert versions.supported(Version("0.5.23"))
    for unchecked in ("0.5.16", "0.5.18", "0.5.22.post1", "0.5.24"):
        assert not versions.supported(Version(unchecked)), unchecked


def test_the_package_requires_the_supported_releases():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    (sglang,) = [r for r in map(Requirement, pyproject["project"]["dependencies"])
                 if r.name == "sglang"]
    assert sglang.specifier == versions.SUPPORTED


@pytest.mark.parametrize("specifier, applies", [(None, True), ("<0.5.18", True),
                                                (">=0.5.17,<0.5.18", True), (">=0.5.23", False)])
def test_a_row_limited_to_some_releases(specifier, applies):
    assert versions.applies(specifier, Version("0.5.17")) is applies
    assert versions.applies(specifier, Version("0.5.23")) is (specifier in (None, ">=0.5.23"))
