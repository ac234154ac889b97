"""The plugin's process state, behind one accessor: the only module-level mutable state.

Every SGLang process the plugin runs in (the launcher with its tokenizer manager, each
scheduler rank) holds one `PluginState`. What it holds is written in one place each:

* `schedule`: the drop schedule, resolved once per process from the model's facts
  (schedule.py; the first hook that sees the model resolves it, every later one reads it);
* `runtime`: the model runner's UniPrefill runtime (patches/model_runner.py builds it);
* `metrics`: the tokenizer manager's Prometheus counters (patches/metrics.py);
* `logged`: the dense fallbacks already logged (each is logged once per process).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from uniprefill_sglang.config import UniPrefillConfig
    from uniprefill_sglang.runtime import UniPrefillRuntime
    from uniprefill_sglang.schedule import Schedule


@dataclasses.dataclass
class PluginState:
    schedule: Optional["Schedule"] = None
    runtime: Optional["UniPrefillRuntime"] = None
    metrics: Optional[object] = None
    logged: set = dataclasses.field(default_factory=set)
    # The UniPrefill config of the server args it was built from (requests read it often).
    _config: Optional[tuple] = None

    def config(self, server_args) -> "UniPrefillConfig":
        """The server's UniPrefill config, built once per server args object."""
        if self._config is None or self._config[0] is not server_args:
            self._config = (server_args, server_args.uniprefill_config())
        return self._config[1]


_STATE = PluginState()


def plugin_state() -> PluginState:
    return _STATE


def reset_plugin_state() -> None:
    """A fresh state (tests that run several configurations in one process)."""
    global _STATE
    _STATE = PluginState()
