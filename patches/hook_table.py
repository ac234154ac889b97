"""One row per change the plugin makes to SGLang: its target, its kind, its function and why.

Every patch module lists its rows in `HOOKS`; `patches.hook_table()` gathers them, with the
attention adapters' rows, into the one table the loader registers (`patches.register_all`) and
`python -m uniprefill_sglang.patches` prints. Kinds:

* `before`, `after`, `around`, `replace`: SGLang's `HookRegistry` swaps the target;
* `assign`: the loader sets a class attribute that the module-level replacement cannot reach;
* `instance`: wrappers set on a built model's modules, per instance, by a model runner hook
  (listed so the table is complete; nothing to register).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Optional, Union

KINDS = ("before", "after", "around", "replace", "assign", "instance")


@dataclasses.dataclass(frozen=True)
class Hook:
    target: str
    kind: str
    # The hook, or "module:name" for one imported only when the loader registers it.
    function: Union[Callable, str]
    why: str
    # An attention backend's class name: the hook is needed only where that backend serves.
    backend: Optional[str] = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"hook kind {self.kind!r} of {self.target} is not one of {KINDS}")

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
