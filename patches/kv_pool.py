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
  The schedule resolved here (uniprefill_sglang/schedule.py) is what the buffer hook below
  builds the layout of.
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
from uniprefill_sglang.patches.hook_table import Hook

logger = logging.getLogger(__name__)


def _schedule(kvc):
    """This process's drop schedule (resolved here, at the first hook that sees the model), or
    None when UniPrefill is off."""
    from uniprefill_sglang.schedule import process_schedule

    server_args = kvc.server_args
    if not getattr(server_args, "enable_uniprefill", False) or kvc.is_draft_worker:
        return None
    return process_schedule(server_args, kvc.model_config, use_mla=kvc.use_mla_backend)


def _cell_size(cell_size, configurator, kvc, *args, **kwargs):
    from sglang.srt.runtime_context import get_parallel

    from uniprefill_sglang.prefix_checkpoint import PrefixCheckpoint

    schedule = _schedule(kvc)
    if schedule is None:
        return cell_size
    if schedule.staged:
        cell_size = int(cell_size * schedule.stage_layout.kv_fraction())
    if not schedule.checkpoint:
        return cell_size
    mc = kvc.model_config
    query = mc.num_attention_heads * mc.head_dim // get_parallel().attn_tp_size
    return cell_size + PrefixCheckpoint.bytes_per_slot(mc.hidden_size, query, kvc.model_dtype)


def _create_stage_buffers(original, pool, *args, **kwargs):
    """Buffers of `size + 1` rows for stage-0 layers and `stage size + 1` for later ones (row 0
    absorbs padded writes, as upstream's padded page does)."""
    from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE

    from uniprefill_sglang.stage_pools import StagedBuffers
    from uniprefill_sglang.state import plugin_state

    schedule = plugin_state().schedule  # resolved by the cell-size hook, which runs first
    layout = schedule.stage_layout if schedule is not None else None
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
    pool.uniprefill_stage_buffers = StagedBuffers(layout, sizes[1:],
                                    [layout.stage_of_layer(l) for l in range(pool.layer_num)])


def _write_at_stage_slots(original, pool, layer, loc_info, *args, **kwargs):
    staged = getattr(pool, "uniprefill_stage_buffers", None)
    maps = staged.maps if staged is not None else None
    if maps is not None and layer is not None:
        layer_id = kwargs.get("layer_id_override")
        stage = staged.stage_of_layer[layer.layer_id if layer_id is None else layer_id]
        if stage:
            from sglang.srt.mem_cache.memory_pool import unwrap_write_loc

            loc, _, _ = unwrap_write_loc(loc_info)
            loc_info = maps[stage - 1][loc.to(torch.int64)].to(loc.dtype)
    return original(pool, layer, loc_info, *args, **kwargs)


_POOL = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool"
HOOKS = (
    Hook("sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator."
         "_compute_cell_size", "after", _cell_size,
         "a token's bytes under the staged layout, plus the prefix checkpoint's"),
    Hook(f"{_POOL}._create_buffers_normal", "around", _create_stage_buffers,
         "staged layout: each layer's buffers have its stage pool's rows"),
    Hook(f"{_POOL}.set_kv_buffer", "around", _write_at_stage_slots,
         "a later stage's layer writes at the tokens' slots in its own pool"),
)
