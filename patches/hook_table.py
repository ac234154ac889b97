"""One row per change the plugin makes to SGLang: its target, its kind, its function and why.

Every patch module lists its rows in `HOOKS`; `patches.all_hooks()` gathers them, with the
attention adapters' rows, into the one table the loader registers (`patches.register_all`) and
`python -m uniprefill_sglang.patches` prints. Kinds:

* `before`, `after`, `around`, `replace`: SGLang's `HookRegistry` swaps the target;
* `assign`: the loader sets a class attribute that the module-level replacement cannot reach;
* `instance`: what a model runner hook sets on built objects, per instance (wrappers on the
  model's modules, an attribute of the attention backend; listed so the table is complete;
  nothing to register).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import json
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Union

from packaging.version import Version

# The parameters of every hooked function that the hooks were written for, per SGLang version:
# {target: {version: [parameter, ...]}}. Any recorded list is accepted on any version (the
# versions say where each was seen); `python -m uniprefill_sglang.patches --record` records the
# installed SGLang's, keeping the other versions'.
SIGNATURES = Path(__file__).with_name("signatures.json")

KINDS = ("before", "after", "around", "replace", "assign", "instance")

UNRESOLVED = "does not resolve"


@dataclasses.dataclass(frozen=True)
class Hook:
    target: str
    kind: str
    # The hook, or "module:name" for one imported only when the loader registers it.
    function: Union[Callable, str]
    why: str
    # An attention backend's class name: the hook is needed only where that backend serves.
    backend: Optional[str] = None
    # A version specifier ("<0.5.18", ">=0.5.23"): the row exists for those SGLang releases only.
    sglang: Optional[str] = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"hook kind {self.kind!r} of {self.target} is not one of {KINDS}")

    def applies(self) -> bool:
        """Whether the row is for the installed SGLang (uniprefill_sglang/versions.py)."""
        from uniprefill_sglang import versions

        return versions.applies(self.sglang)

    def resolve(self) -> Callable:
        if not isinstance(self.function, str):
            return self.function
        module, name = self.function.split(":")
        return getattr(importlib.import_module(module), name)

    @property
    def function_name(self) -> str:
        if isinstance(self.function, str):
            return self.function.replace(":", ".")
        return f"{self.function.__module__}.{self.function.__qualname__}"


def resolve_target(target: str):
    """The upstream object a dotted target names (the longest importable module, then
    attributes); raises ImportError or AttributeError when it does not exist."""
    parts = target.split(".")
    failed = None  # the longest module that exists but failed to import
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError as error:
            if failed is None and _exists(".".join(parts[:cut])):
                failed = error
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            if failed is not None:
                raise ImportError(f"{target}: its module does not import here ({failed})")
            raise
        return obj
    raise ImportError(f"no module of {target} can be imported")


def _exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent that is a module, not a package
        return False


def parameters(target: str) -> List[str]:
    """The parameter names of a hooked function, in order (kinds and defaults aside: a hook
    passes arguments through by name and position). A method of a module that does not import
    on this machine (SGLang's FA3 backend loads CUDA kernels at import) is read from its source,
    so its signature is checked and recorded on CPU-only machines too."""
    try:
        return list(inspect.signature(resolve_target(target)).parameters)
    except ImportError:
        return source_parameters(target)


def source_parameters(target: str) -> List[str]:
    """`module.Class.method`'s parameter names, read from the module's source without
    importing it; raises ImportError when the module, class or method is not there."""
    module, cls, method = target.rsplit(".", 2)
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ImportError(f"no module {module}")
    tree = ast.parse(Path(spec.origin).read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for fn in node.body:
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name == method:
                    a = fn.args
                    names = [x.arg for x in a.posonlyargs + a.args]
                    names += [a.vararg.arg] if a.vararg else []
                    names += [x.arg for x in a.kwonlyargs]
                    names += [a.kwarg.arg] if a.kwarg else []
                    bound = any(getattr(d, "id", None) == "classmethod" for d in fn.decorator_list)
                    return names[1:] if bound else names  # as `inspect` gives a classmethod
    raise ImportError(f"{target} is not in the source of {module}")


def signed(rows: Iterable[Hook]) -> List[str]:
    """The targets whose signature a hook depends on: the functions it wraps or runs beside."""
    return sorted({h.target for h in rows if h.kind in ("before", "after", "around")})


def recorded_signatures() -> Dict[str, Dict[str, List[str]]]:
    """{target: {SGLang version: [parameter, ...]}} (`SIGNATURES`)."""
    return json.loads(SIGNATURES.read_text())


def parameter_change(target: str, now: List[str], recorded: dict) -> Optional[str]:
    """None when `now` is one of the parameter lists recorded for `target`, else what changed
    against the newest recorded one."""
    by_version = recorded.get(target, {})
    if now in by_version.values():
        return None
    if not by_version:
        return f"no parameters recorded (now {now})"
    before = by_version[max(by_version, key=Version)]
    versions = ", ".join(v for v, params in by_version.items() if params == before)
    added = [p for p in now if p not in before]
    removed = [p for p in before if p not in now]
    if not added and not removed:
        return f"parameters reordered to {now} from {before} (SGLang {versions})"
    what = ", ".join([f"adds {added}"] * bool(added) + [f"drops {removed}"] * bool(removed))
    return f"{what} against its parameters on SGLang {versions}"


def signature_changes(rows: Iterable[Hook]) -> Dict[str, str]:
    """Per hooked target whose parameters are none of the recorded ones (or that no longer
    resolves: `UNRESOLVED` and why), what changed."""
    recorded = recorded_signatures()
    changes = {}
    for target in signed(rows):
        try:
            now = parameters(target)
        except (ImportError, AttributeError) as e:
            changes[target] = f"{UNRESOLVED} ({e})"
            continue
        change = parameter_change(target, now, recorded)
        if change:
            changes[target] = change
    return changes
