"""The package's layers hold: no import cycle among its modules, and imports point down only.

Layers, top to bottom (module names as installed, pyproject.toml's package-dir):

* `uniprefill_sglang.patches` (the folder patches/), with `uniprefill_sglang.plugin`, the entry
  point SGLang's plugin loader calls, which registers the patches: the hooks into SGLang;
* the package: every other module of `uniprefill_sglang`; within it, the offline tooling
  (`uniprefill_sglang.tools`) sits above the serving core: the core, the patches and the kernels
  import none of it;
* `uniprefill_sglang.kernels` (the folder kernels/): torch and Triton only, no SGLang; its
  switches come in as arguments.

Every import counts: module-level and function-local ones, `try` fallbacks, a package's
`__init__` importing its submodules; only those under `if TYPE_CHECKING:` are left out (they never
run). `from x import y` names the submodule `x.y` where there is one, else `x`. Importing
`a.b.c` also runs `a.b`'s `__init__`, which counts unless `a.b` encloses the importing module
(a package is already being imported when its submodules run; a name it defines, imported from
it by a submodule, does count). Imports by name at run time
(importlib, a hook row's "module:function") are not seen.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "uniprefill_sglang"
KERNELS = f"{PACKAGE}.kernels"
PATCHES = f"{PACKAGE}.patches"
TOOLS = f"{PACKAGE}.tools"
# Installed package -> source folder (pyproject.toml's package-dir).
SOURCES = {PACKAGE: "uniprefill_sglang", KERNELS: "kernels", PATCHES: "patches"}
ENTRY_POINTS = (f"{PACKAGE}.plugin",)
SGLANG = ("sglang", "sgl_kernel")


def find_modules(root: Path) -> Dict[str, Tuple[Path, bool]]:
    """{module name: (file, is a package)} of every module under `root`'s source folders."""
    modules = {}
    for package, folder in SOURCES.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if package == PACKAGE and parts[0] in ("kernels", "patches"):
                continue  # a source checkout's view of the subpackages: listed under their own
            is_package = parts[-1] == "__init__"
            modules[".".join([package] + parts[:-1 if is_package else None])] = (path, is_package)
    return modules


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_names(module: str, path: Path, is_package: bool, modules) -> List[Tuple[str, int]]:
    """(absolute module name, line) of every import that runs, wherever it sits."""
    found = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child.test):
                for other in child.orelse:
                    visit_node(other)
            else:
                visit_node(child)

    def visit_node(node):
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: None if is_package else -1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.append((full if full in modules else base, node.lineno))
        else:
            visit(node)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return found


def import_graph(root: Path):
    """({module: {imported project module: [line, ...]}}, {module: [(external name, line)]})."""
    modules = find_modules(root)
    graph: Dict[str, Dict[str, List[int]]] = {m: {} for m in modules}
    external: Dict[str, List[Tuple[str, int]]] = {m: [] for m in modules}
    for module, (path, is_package) in modules.items():
        ancestors = {module.rsplit(".", n)[0] for n in range(1, module.count(".") + 1)}
        for name, line in imported_names(module, path, is_package, modules):
            parts = name.split(".")
            enclosing = [".".join(parts[:n]) for n in range(len(parts), 0, -1)]
            named = next((m for m in enclosing if m in modules), None)
            if named is None:
                external[module].append((name, line))
                continue
            targets = {named} | ({m for m in enclosing if m in modules} - ancestors)
            for target in sorted(targets - {module}):
                lines = graph[module].setdefault(target, [])
                if line not in lines:
                    lines.append(line)
    return graph, external


def cycles(graph) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found = []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def shortest_cycle(graph, component: List[str]) -> List[str]:
    """One shortest cycle through the component's first module, each step with its lines."""
    start = component[0]
    previous = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for a in frontier:
            for b in sorted(graph[a]):
                if b == start:
                    path = [a]
                    while previous[path[-1]] is not None:
                        path.append(previous[path[-1]])
                    path = path[::-1] + [start]
                    return [start] + [f"{b} (line {', '.join(map(str, graph[a][b]))})"
                                      for a, b in zip(path, path[1:])]
                if b in component and b not in previous:
                    previous[b] = a
                    following.append(b)
        frontier = following
    raise AssertionError(f"{start} is on no cycle")


def layer(module: str) -> int:
    if module == KERNELS or module.startswith(KERNELS + "."):
        return 0
    if module == PATCHES or module.startswith(PATCHES + ".") or module in ENTRY_POINTS:
        return 2
    return 1


def is_tooling(module: str) -> bool:
    return module == TOOLS or module.startswith(TOOLS + ".")


def problems(root: Path) -> List[str]:
    """Every cycle (its modules and the imports among them), every import that points up a
    layer, every import of the tooling from outside it, and every SGLang import of a kernel
    module."""
    graph, external = import_graph(root)
    found = []
    for component in cycles(graph):
        found.append(f"import cycle among {', '.join(component)}: "
                     + " -> ".join(shortest_cycle(graph, component)))
    names = {0: "kernels", 1: "package", 2: "patches"}
    for a, targets in sorted(graph.items()):
        for b, lines in sorted(targets.items()):
            if layer(b) > layer(a):
                found.append(f"{a} ({names[layer(a)]}) imports {b} ({names[layer(b)]}) "
                             f"at line {', '.join(map(str, lines))}")
            elif is_tooling(b) and not is_tooling(a):
                found.append(f"{a} imports the tooling {b} at line {', '.join(map(str, lines))}")
        if layer(a) == 0:
            found += [f"{a} imports SGLang ({name}) at line {line}" for name, line in external[a]
                      if name.split(".")[0] in SGLANG]
    return found


def test_the_package_has_no_import_cycle_and_its_layers_hold():
    found = problems(REPO)
    assert not found, "\n".join(found)


# ---- The checker itself, on a small tree whose problems are known.

def _write(root: Path, files: Dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


SOUND = {
    "uniprefill_sglang/__init__.py": "",
    "uniprefill_sglang/errors.py": "class Failed(Exception):\n    pass\n",
    "uniprefill_sglang/low.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                "    from uniprefill_sglang.high import High\n",
    "uniprefill_sglang/high.py": "from . import low\nfrom uniprefill_sglang.kernels import op\n"
                                 "def f():\n    from .errors import Failed\n",
    "kernels/__init__.py": "from .op import run\nimport torch\n",
    "kernels/op.py": "def run():\n    from . import helper\n",
    "kernels/helper.py": "",
    "uniprefill_sglang/deep.py": "import uniprefill_sglang.kernels.helper\n",
    "patches/__init__.py": "from uniprefill_sglang.patches import model_runner\n",
    "patches/model_runner.py": "def hook():\n    from uniprefill_sglang import high\n",
    "uniprefill_sglang/plugin.py": "def load():\n    from uniprefill_sglang.patches import x\n",
    "uniprefill_sglang/tools/__init__.py": "",
    "uniprefill_sglang/tools/demo.py": "from uniprefill_sglang import high\n",
}


def test_the_checker_passes_a_sound_tree(tmp_path):
    _write(tmp_path, SOUND)
    graph, _ = import_graph(tmp_path)
    assert graph["uniprefill_sglang.high"] == {"uniprefill_sglang.low": [1],
                                               "uniprefill_sglang.kernels": [2],
                                               "uniprefill_sglang.kernels.op": [2],
                                               "uniprefill_sglang.errors": [4]}
    assert graph["uniprefill_sglang.kernels.op"] == {"uniprefill_sglang.kernels.helper": [2]}
    assert graph["uniprefill_sglang.low"] == {}  # under TYPE_CHECKING
    # importing a submodule runs its package's __init__ too
    assert graph["uniprefill_sglang.deep"] == {"uniprefill_sglang.kernels": [1],
                                               "uniprefill_sglang.kernels.helper": [1]}
    assert problems(tmp_path) == []


@pytest.mark.parametrize("files, expected", [
    # a cycle closed by a function-local relative import
    ({"uniprefill_sglang/errors.py": "def f():\n    from .high import g\n"},
     "import cycle among uniprefill_sglang.errors, uniprefill_sglang.high: "
     "uniprefill_sglang.errors -> uniprefill_sglang.high (line 2) -> "
     "uniprefill_sglang.errors (line 4)"),
    # a package's __init__ and its submodule
    ({"patches/model_runner.py": "def hook():\n    from uniprefill_sglang.patches import x\n"},
     "import cycle among uniprefill_sglang.patches, uniprefill_sglang.patches.model_runner"),
    # only the entry point among the package's modules may import the patches
    ({"uniprefill_sglang/errors.py": "import uniprefill_sglang.patches.model_runner\n"},
     "uniprefill_sglang.errors (package) imports uniprefill_sglang.patches (patches)"),
    # the serving core imports no tooling
    ({"uniprefill_sglang/errors.py": "def f():\n    from uniprefill_sglang.tools import demo\n"},
     "uniprefill_sglang.errors imports the tooling uniprefill_sglang.tools.demo at line 2"),
    ({"kernels/helper.py": "from uniprefill_sglang import errors\n"},
     "uniprefill_sglang.kernels.helper (kernels) imports uniprefill_sglang.errors (package)"),
    ({"kernels/helper.py": "def f():\n    import sglang.srt.utils\n"},
     "uniprefill_sglang.kernels.helper imports SGLang (sglang.srt.utils) at line 2"),
])
def test_the_checker_finds_a_known_problem(tmp_path, files, expected):
    _write(tmp_path, {**SOUND, **files})
    assert any(p.startswith(expected) for p in problems(tmp_path)), problems(tmp_path)
