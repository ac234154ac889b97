"""The drop schedule of a process, resolved once from one bundle of model facts.

`ModelFacts` is what UniPrefill reads of a model and its server (architectures, depth, layer
kinds, attention backends); `resolve` turns facts and the config into a frozen `Schedule`:
the drop layers, the layer-to-stage table, the staged KV layout if any, whether the prefix
checkpoint is kept, and why every request runs dense when nothing drops. Start-up checks
(server_args.py) resolve it to refuse bad flags early; in a scheduler process the first hook
that sees the model (the KV pool's cell size, else the model runner) resolves it into the
process state, and every later hook reads that one.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import FrozenSet, Optional, Tuple

from uniprefill_sglang import architectures as arch_table
from uniprefill_sglang import environ
from uniprefill_sglang.config import (UniPrefillConfig, attention_backend_names,
                                      unsupported_architecture_reason, validate_for_model)
from uniprefill_sglang.kv_validity import LayerStages
from uniprefill_sglang.state import plugin_state

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    architectures: Tuple[str, ...]
    num_layers: int
    hidden_size: int
    layer_types: Optional[Tuple[str, ...]]
    attention_backends: FrozenSet[str]
    # The server's context length: a stage pool holds at least one whole request.
    context_len: Optional[int] = None

    @classmethod
    def of(cls, hf_config, server_args, context_len: Optional[int] = None) -> "ModelFacts":
        text_config = getattr(hf_config, "text_config", hf_config)
        return cls(tuple(getattr(hf_config, "architectures", None) or ()),
                   text_config.num_hidden_layers, text_config.hidden_size,
                   arch_table.config_layer_types(text_config),
                   frozenset(attention_backend_names(server_args)), context_len)

    @classmethod
    def read(cls, server_args) -> Optional["ModelFacts"]:
        """The facts of `--model-path` before SGLang loads it; None when its config cannot be
        read (the scheduler's model runner resolves the schedule again from the loaded model)."""
        try:
            from transformers import AutoConfig

            hf_config = AutoConfig.from_pretrained(server_args.model_path,
                                                   trust_remote_code=server_args.trust_remote_code)
        except Exception as e:
            logger.info("UniPrefill: model config not readable at start-up (%s)", e)
            return None
        return cls.of(hf_config, server_args)

    @property
    def entry(self) -> Optional[arch_table.Architecture]:
        return arch_table.lookup(self.architectures)


@dataclasses.dataclass(frozen=True)
class Schedule:
    stages: LayerStages
    # Per stage 1..D, its KV pool's fraction of the full pool under the staged layout (else None).
    stage_fractions: Optional[Tuple[float, ...]]
    # Does the server keep the prefix checkpoint (re-selection over cached prefixes)?
    checkpoint: bool
    # Why no request drops (None when the schedule has drop layers).
    dense_reason: Optional[str]
    facts: ModelFacts

    @property
    def drop_layers(self) -> Tuple[int, ...]:
        return self.stages.drop_layers

    @property
    def staged(self) -> bool:
        return self.stage_fractions is not None

    @functools.cached_property
    def stage_layout(self):
        """The staged KV layout's static part (stage_pools.StageLayout), or None."""
        from uniprefill_sglang.stage_pools import StageLayout

        if not self.staged:
            return None
        return StageLayout(self.drop_layers, self.stages.num_layers, self.stage_fractions,
                           min_slots=(self.facts.context_len or 0) + 1)


NO_DROP_LAYERS = "no drop layers"


def resolve(config: UniPrefillConfig, facts: ModelFacts, server_args,
            use_mla: bool = False) -> Schedule:
    """The schedule for a model; raises UniPrefillConfigError on drop layers it cannot have."""
    from uniprefill_sglang.prefix_reuse import needs_checkpoint
    from uniprefill_sglang.stage_pools import default_stage_fractions

    backends = facts.attention_backends
    drop_layers = validate_for_model(config, facts.architectures, facts.num_layers,
                                     layer_types=facts.layer_types, attention_backends=backends)
    why = unsupported_architecture_reason(facts.architectures, facts.layer_types, backends)
    entry = facts.entry
    recurrent = entry is not None and entry.recurrent_state
    if (recurrent and drop_layers and not server_args.disable_radix_cache
            and not environ.HYBRID_PREFIX_CACHE.get()):
        # Start-up turns the radix cache off for such a family (unless the experimental switch
        # keeps it, checked there); it may not have read the model's config then.
        why = (f"{', '.join(facts.architectures)} keeps a recurrent state per cached prefix and "
               "the radix cache is on; start with --disable-radix-cache to drop")
        drop_layers = ()
    fractions = None
    if drop_layers and _staged_layout_applies(config, server_args, use_mla, recurrent, facts):
        fractions = tuple(config.stage_kv_fraction
                          or default_stage_fractions(len(drop_layers), config.keep_ratio))
    return Schedule(LayerStages(drop_layers, facts.num_layers), fractions,
                    bool(drop_layers) and needs_checkpoint(server_args, config),
                    None if drop_layers else (why or NO_DROP_LAYERS), facts)


def _staged_layout_applies(config, server_args, use_mla, recurrent, facts) -> bool:
    if config.kv_layout != "staged" or use_mla:
        return False
    if "triton" in facts.attention_backends and server_args.enable_deterministic_inference:
        # The Triton adapter does not serve deterministic inference (its split KV is fixed).
        logger.warning("UniPrefill: Triton under deterministic inference keeps the shared KV "
                       "layout")
        return False
    if recurrent:  # its KV pool (HybridLinearKVPool) holds the full-attention layers only
        logger.info("UniPrefill: %s keeps the shared KV layout", ", ".join(facts.architectures))
        return False
    return True


def process_schedule(server_args, model_config, use_mla: bool = False) -> Schedule:
    """This process's schedule, resolved at the first call (every later call gets the same)."""
    state = plugin_state()
    if state.schedule is None:
        facts = ModelFacts.of(model_config.hf_config, server_args, model_config.context_len)
        state.schedule = resolve(state.config(server_args), facts, server_args, use_mla)
    return state.schedule
