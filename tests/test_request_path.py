"""The request's path as uniprefill_sglang/request_path.py writes it down: every name it gives
exists, each side-car's writers write it, and the code keeps the rules it states (one meaning
per attribute, the drop context passed on with the batch, never read from process state)."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

from uniprefill_sglang import request_path

DOC = request_path.__doc__
REFERENCE = re.compile(r"`((?:sglang\.)?[\w.]+):([\w.]+)`")
ROOT = Path(__file__).resolve().parents[1]
# The package's own code and its patches (the flags' module assigns ServerArgs fields, which
# are flags, not side-cars; tooling does not run in a request's path).
SOURCES = [p for d in ("uniprefill_sglang", "patches") for p in (ROOT / d).rglob("*.py")
           if p.name not in ("server_args.py", "calibrate.py") and "tools" not in p.parts]


def resolve(module: str, name: str):
    module = module if module.startswith("sglang.") else f"uniprefill_sglang.{module}"
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def table_rows():
    """(attribute, writer references) per row of the side-car table."""
    rows = []
    for line in DOC.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| ") or len(cells) != 5 or cells[1] == "attribute":
            continue
        rows.append((cells[1].strip("`"), REFERENCE.findall(cells[3])))
    return rows


@pytest.mark.parametrize("module,name", sorted(set(REFERENCE.findall(DOC))))
def test_every_name_it_gives_exists(module, name):
    assert resolve(module, name) is not None


def test_each_side_car_is_written_by_its_writers():
    rows = table_rows()
    assert len(rows) >= 10
    for attribute, writers in rows:
        for module, name in writers:
            assert attribute in inspect.getsource(resolve(module, name)), (attribute, name)


def test_every_side_car_the_code_sets_is_in_the_table():
    documented = {attribute for attribute, _ in table_rows()}
    written = set()
    for path in SOURCES:
        written |= set(re.findall(r"\.(uniprefill_\w+) = ", path.read_text()))
    assert written and written <= documented, written - documented


def test_one_meaning_per_attribute_and_no_process_state_mid_forward():
    """No SGLang object carries a bare `uniprefill` attribute, and the drop context is never
    read from the process's state."""
    for path in SOURCES:
        text = path.read_text()
        assert not re.search(r"\.uniprefill\b(?!_)", text), path
        assert not re.search(r"(getattr|setattr|__dict__\.get)\([^)]*[\"']uniprefill[\"']",
                             text), path
        assert "plugin_state().forward" not in text, path
    from uniprefill_sglang import context, state

    assert "forward" not in {f.name for f in state.PluginState.__dataclass_fields__.values()}
    assert not hasattr(context, "current")
