"""uniprefill-sglang: UniPrefill prefill token dropping as a plugin for stock SGLang."""

__version__ = "0.1.0"

import os as _os

# pyproject.toml installs the top-level kernels/ and patches/ folders as this package's
# subpackages; a plain source checkout on sys.path (no install) gets the same view here.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if all(_os.path.isfile(_os.path.join(_root, d, "__init__.py")) for d in ("kernels", "patches")):
    __path__.append(_root)
