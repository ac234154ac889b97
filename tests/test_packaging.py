"""A regular (non-editable) install carries every module: the wheel built from this tree holds
each package file, declares the SGLang plugin entry point, and the installed copy loads its
hooks from outside the source tree. (CI installs with `pip install -e .`, which would hide a
package missing from pyproject.toml.)"""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
# Installed package -> source folder (pyproject.toml's package-dir).
SOURCES = {"uniprefill_sglang": "uniprefill_sglang", "uniprefill_sglang/kernels": "kernels",
           "uniprefill_sglang/patches": "patches"}


def _expected_files() -> set:
    files = set()
    for dest, src in SOURCES.items():
        for path in (REPO / src).rglob("*.py"):
            rel = path.relative_to(REPO / src)
            if "__pycache__" in rel.parts or (src == "uniprefill_sglang" and rel.parts[0] in
                                              ("kernels", "patches")):
                continue
            files.add(f"{dest}/{rel.as_posix()}")
    return files


def _fresh_source(tmp_path: Path) -> Path:
    """The files a build reads, copied: a `build/` folder left in the tree by an earlier build
    would otherwise lend the wheel modules that pyproject.toml does not list."""
    src = tmp_path / "src"
    for name in ("pyproject.toml", "README.md", *SOURCES.values()):
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    return src


def test_wheel_holds_every_module_and_loads_outside_the_tree(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist"), str(_fresh_source(tmp_path))],
                   check=True, timeout=600)
    (wheel,) = (tmp_path / "dist").glob("uniprefill_sglang-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    missing = _expected_files() - names
    assert not missing, f"modules missing from the wheel: {sorted(missing)}"
    assert "[sglang.srt.plugins]" in entry_points and "uniprefill_sglang.plugin:load" in entry_points

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(site), str(wheel)], check=True, timeout=600)
    code = ("import uniprefill_sglang, uniprefill_sglang.plugin as p; p.load(); "
            "import uniprefill_sglang.backends.flashinfer, uniprefill_sglang.backends.triton; "
            "import uniprefill_sglang.tools.tasks; "
            "print(uniprefill_sglang.__file__)")
    # The installed copy first; the rest of PYTHONPATH stays (on the CPU it carries the
    # test-only sgl_kernel stand-in, conftest.py).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(site), os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1].startswith(str(site)), out.stdout
