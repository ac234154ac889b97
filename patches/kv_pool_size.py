"""Hook: `sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size`
(AFTER).

Why: SGLang sizes the KV pool as the memory `--mem-fraction-static` leaves, divided by the bytes
one token's KV takes in every layer (the cell size). With prefix re-selection the plugin keeps
a checkpoint per KV slot (uniprefill_sglang/prefix_checkpoint.py: the residual stream and this
rank's query heads at the first drop layer, in the model's dtype). Counting it in the cell size
makes the pool and the checkpoint together fit the same budget, instead of the checkpoint eating
the activations' headroom.
"""

from sglang.srt.plugins.hook_registry import HookRegistry, HookType


def _add_checkpoint_bytes(cell_size, configurator, kvc, *args, **kwargs):
    from sglang.srt.runtime_context import get_parallel

    from uniprefill_sglang.prefix_checkpoint import PrefixCheckpoint
    from uniprefill_sglang.prefix_reuse import needs_checkpoint

    server_args = kvc.server_args
    if not getattr(server_args, "enable_uniprefill", False) or kvc.is_draft_worker:
        return cell_size
    if not needs_checkpoint(server_args, server_args.uniprefill_config()):
        return cell_size
    mc = kvc.model_config
    query = mc.num_attention_heads * mc.head_dim // get_parallel().attn_tp_size
    return cell_size + PrefixCheckpoint.bytes_per_slot(mc.hidden_size, query, kvc.model_dtype)


def register() -> None:
    HookRegistry.register(
        "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size",
        _add_checkpoint_bytes, HookType.AFTER)
