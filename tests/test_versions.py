"""patches/versions.py: the supported releases and rows limited to some releases."""

import pytest
from packaging.version import Version

from uniprefill_sglang.patches import versions


def test_the_installed_release_is_supported():
    import sglang

    assert versions.installed() == Version(sglang.__version__)
    assert versions.supported()
    assert versions.supported(Version("0.5.17.post1"))
    assert not versions.supported(Version("0.5.16"))


@pytest.mark.parametrize("specifier, applies", [(None, True), ("<0.5.18", True),
                                                (">=0.5.17,<0.5.18", True), (">=0.5.23", False)])
def test_a_row_limited_to_some_releases(specifier, applies):
    assert versions.applies(specifier, Version("0.5.17")) is applies
    assert versions.applies(specifier, Version("0.5.23")) is (specifier in (None, ">=0.5.23"))
