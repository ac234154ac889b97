"""Hooks on SGLang's KV pool: its size, its per-layer buffers and its writes.

* `sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size`
  (AFTER). SGLang sizes the KV pool as the memory `--mem-fraction-static` leaves divided by the
  bytes one token takes in every layer (the cell size). Two things change that under UniPrefill:
  - the staged KV layout (uniprefill_sglang/stage_pools.py): a layer after the first drop holds
    slots for a fraction of the tokens only, so a token costs the layers' bytes weighted by
    their stage pools' fractions, and the same memory holds more tokens;
  - prefix re-selection keeps a checkpoint per KV slot (prefix_checkpoint.py: the residual
    stream and this rank's query heads at the first drop layer); counted here, the pool and the
    checkpoint share the budget instead of the checkpoint eating the activations' headroom.
  The layout planned here is what the buffer hook below builds.
* `sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._create_buffers_normal` (AROUND). Under the
  staged layout each layer's K/V buffers get the rows of its stage's pool, not one row per full
  slot.
* `sglang.srt.mem_cache.memory_pool.MHATokenToKVPool.set_kv_buffer` (AROUND). Every KV write
  addresses full slots (`out_cache_loc`); a layer of a later stage writes at the tokens' slots
  in its own pool (`StagePools.stage_slots`). Reads go through the per-stage views, built on the
  stage slots by the attention adapters.
"""

import logging
from contextlib import nullcontext

import torch
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

logger = logging.getLogger(__name__)


def _uniprefill_args(kvc):
    server_args = kvc.server_args
    if not getattr(server_args, "enable_uniprefill", False) or kvc.is_draft_worker:
        return None
    return server_args


def _plan_layout(kvc, config):
    """The staged layout for this model, or None (shared layout, or nothing to drop)."""
    from uniprefill_sglang.architectures import config_layer_types
    from uniprefill_sglang.architectures import lookup as architecture_entry
    from uniprefill_sglang.config import (attention_backend_names,
                                          unsupported_architecture_reason, validate_for_model)
    from uniprefill_sglang.stage_pools import StageLayout, default_stage_fractions

    if config.kv_layout != "staged" or kvc.use_mla_backend:
        return None
    args = kvc.server_args
    backends = attention_backend_names(args)
    if "triton" in backends and args.enable_deterministic_inference:
        # The Triton adapter does not serve deterministic inference (its split KV is fixed).
        logger.warning("UniPrefill: Triton under deterministic inference keeps the shared KV "
                       "layout")
        return None
    hf_config = kvc.model_config.hf_config
    text_config = getattr(hf_config, "text_config", hf_config)
    architectures = getattr(hf_config, "architectures", None) or []
    layer_types = config_layer_types(text_config)
    if unsupported_architecture_reason(architectures, layer_types, backends):
        return None
    entry = architecture_entry(architectures)
    if entry is not None and entry.recurrent_state:
        # Its KV pool (HybridLinearKVPool) holds the full-attention layers only.
        logger.info("UniPrefill: %s keeps the shared KV layout", ", ".join(architectures))
        return None
    num_layers = text_config.num_hidden_layers
    drop_layers = validate_for_model(config, architectures, num_layers, layer_types=layer_types,
                                     attention_backends=backends)
    if not drop_layers:
        return None
    fractions = config.stage_kv_fraction or default_stage_fractions(len(drop_layers),
                                                                    config.keep_ratio)
    return StageLayout(drop_layers, num_layers, fractions,
                       min_slots=kvc.model_config.context_len + 1)


def _cell_size(cell_size, configurator, kvc, *args, **kwargs):
    from sglang.srt.runtime_context import get_parallel

    from uniprefill_sglang.prefix_checkpoint import PrefixCheckpoint
    from uniprefill_sglang.prefix_reuse import needs_checkpoint
    from uniprefill_sglang.stage_pools import plan_layout

    server_args = _uniprefill_args(kvc)
    if server_args is None:
        return cell_size
    config = server_args.uniprefill_config()
    layout = _plan_layout(kvc, config)
    plan_layout(layout)
    if layout is not None:
        cell_size = int(cell_size * layout.kv_fraction())
    if not needs_checkpoint(server_args, config):
        return cell_size
    mc = kvc.model_config
    query = mc.num_attention_heads * mc.head_dim // get_parallel().attn_tp_size
    return cell_size + PrefixCheckpoint.bytes_per_slot(mc.hidden_size, query, kvc.model_dtype)


def _create_stage_buffers(original, pool, *args, **kwargs):
    """Buffers of `size + 1` rows for stage-0 layers and `stage size + 1` for later ones (row 0
    absorbs padded writes, as upstream's padded page does)."""
    from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE

    from uniprefill_sglang.stage_pools import planned_layout

    layout = planned_layout()
    if layout is None or pool.start_layer != 0 or pool.layer_num != layout.stages.num_layers:
        return original(pool, *args, **kwargs)
    if pool.page_size != 1 or pool.use_hnd or pool.kv_cache_layout == "vectorized_5d":
        # The cell size already counted the stage pools: a full-size pool would not fit.
        raise RuntimeError("UniPrefill: the staged KV layout needs page size 1 and the NHD KV "
                           "cache layout; start with --uniprefill-kv-layout shared")
    sizes = [pool.size] + layout.stage_sizes(pool.size)
    rows = [sizes[layout.stage_of_layer(layer)] + 1 for layer in range(pool.layer_num)]
    custom = (torch.cuda.use_mem_pool(pool.custom_mem_pool) if pool.enable_custom_mem_pool
              else nullcontext())
    with pool.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE), custom:
        pool.k_buffer = [torch.zeros((n, pool.head_num, pool.head_dim), dtype=pool.store_dtype,
                                     device=pool.device) for n in rows]
        pool.v_buffer = [torch.zeros((n, pool.head_num, pool.v_head_dim), dtype=pool.store_dtype,
                                     device=pool.device) for n in rows]
    pool.uniprefill_layout = layout
    pool.uniprefill_stage_sizes = sizes[1:]
    pool.uniprefill_stage_of_layer = [layout.stage_of_layer(l) for l in range(pool.layer_num)]
    pool.uniprefill_stage_maps = None  # set by the runtime (StagePools.maps)


def _write_at_stage_slots(original, pool, layer, loc_info, *args, **kwargs):
    maps = getattr(pool, "uniprefill_stage_maps", None)
    if maps is not None and layer is not None:
        layer_id = kwargs.get("layer_id_override")
        stage = pool.uniprefill_stage_of_layer[layer.layer_id if layer_id is None else layer_id]
        if stage:
            from sglang.srt.mem_cache.memory_pool import unwrap_write_loc

            loc, _, _ = unwrap_write_loc(loc_info)
            loc_info = maps[stage - 1][loc.to(torch.int64)].to(loc.dtype)
    return original(pool, layer, loc_info, *args, **kwargs)


def register() -> None:
    HookRegistry.register(
        "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size",
        _cell_size, HookType.AFTER)
    pool = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool"
    HookRegistry.register(f"{pool}._create_buffers_normal", _create_stage_buffers,
                          HookType.AROUND)
    HookRegistry.register(f"{pool}.set_kv_buffer", _write_at_stage_slots, HookType.AROUND)
