"""Hooks on `sglang.srt.model_executor.model_runner.ModelRunner`.

* `init_attention_backends` (AFTER): the model, KV pool and backends exist now (and no CUDA graph
  has been captured yet): build the UniPrefill runtime and wrap the model's layers.
* `_forward_raw` (AROUND): open the per-forward drop context around every forward. A forward
  in which UniPrefill acted and that raised runs once more without it (an extend: every request
  dense, each reporting why in meta_info; a decode: with its KV lengths re-read from the device),
  so an error in the plugin's code never takes the server down. If that run fails too, the error
  is SGLang's and propagates as it would without the plugin. A failed debug check
  (`context.CheckFailed`) is never caught: it exists to make a bookkeeping bug loud.
"""

import logging

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

logger = logging.getLogger(__name__)


def _install_runtime(result, model_runner, *args, **kwargs):
    from uniprefill_sglang import model_integration
    from uniprefill_sglang.architectures import config_layer_types
    from uniprefill_sglang.architectures import lookup as architecture_entry
    from uniprefill_sglang.config import (attention_backend_names,
                                          unsupported_architecture_reason, validate_for_model)
    from uniprefill_sglang.kv_validity import LayerStages
    from uniprefill_sglang.request_plan import log_fallback_once, set_no_schedule_reason
    from uniprefill_sglang.runtime import UniPrefillRuntime, set_runtime

    server_args = model_runner.server_args
    if not getattr(server_args, "enable_uniprefill", False) or model_runner.is_draft_worker:
        return result
    config = server_args.uniprefill_config()
    hf_config = model_runner.model_config.hf_config
    text_config = getattr(hf_config, "text_config", hf_config)
    num_layers = text_config.num_hidden_layers
    architectures = getattr(hf_config, "architectures", None) or []
    layer_types = config_layer_types(text_config)
    backends = attention_backend_names(server_args)
    drop_layers = validate_for_model(config, architectures, num_layers, layer_types=layer_types,
                                     attention_backends=backends)
    unsupported = unsupported_architecture_reason(architectures, layer_types, backends)
    set_no_schedule_reason(unsupported)
    if unsupported:
        # Served dense, every request says why in meta_info; say it once here, loudly.
        logger.warning("UniPrefill: %s; every request runs dense", unsupported)
    stages = LayerStages(drop_layers, num_layers)
    runtime = UniPrefillRuntime(config, stages, model_runner.req_to_token_pool,
                                model_runner.token_to_kv_pool, model_runner.device,
                                _tp_agreement(model_runner),
                                checkpoint_shape=_checkpoint_shape(model_runner, config),
                                allocator=model_runner.token_to_kv_pool_allocator)
    if drop_layers and not model_integration.install(model_runner.model, runtime,
                                                     architecture_entry(architectures)):
        log_fallback_once(f"model {type(model_runner.model).__name__} does not have the decoder "
                          "layers its architecture's integration expects")
        runtime.stages = LayerStages((), num_layers)
    if runtime.slots.staged:
        _check_staged_layout(model_runner, runtime)
    if not runtime.has_schedule and not unsupported:
        log_fallback_once(f"architecture {architectures} without a drop schedule")
    logger.info("UniPrefill enabled: drop layers %s, %s", list(runtime.stages.drop_layers), config)
    set_runtime(runtime)
    return result


def _check_staged_layout(model_runner, runtime):
    """Under the staged KV layout the layers after the first drop can only be read through the
    plugin's per-stage views: refuse at start-up what would read them another way."""
    from uniprefill_sglang.backends import staged_layout_unsupported

    why = ("the model runs without a drop schedule" if not runtime.has_schedule
           else staged_layout_unsupported(model_runner.attn_backend))
    if why:
        raise RuntimeError(f"UniPrefill: the staged KV layout cannot serve this model: {why}; "
                           "start with --uniprefill-kv-layout shared")


def _checkpoint_shape(model_runner, config):
    """(hidden_size, query_size, dtype) of the checkpoint when prefix re-selection can use it:
    the radix cache is on and the prefix policy verifies or re-selects (prefix_reuse.py)."""
    from uniprefill_sglang.model_integration import query_size
    from uniprefill_sglang.prefix_reuse import needs_checkpoint

    if not needs_checkpoint(model_runner.server_args, config):
        return None
    queries = query_size(model_runner.model)
    if queries is None:
        return None
    return model_runner.model_config.hidden_size, queries, model_runner.dtype


def _tp_agreement(model_runner):
    """Attention heads split over ranks: each scores with its own heads (tp_agreement.py)."""
    from sglang.srt.distributed.parallel_state import get_attn_tp_group

    from uniprefill_sglang.tp_agreement import TPScoreAgreement

    group = get_attn_tp_group()
    if group.world_size == 1:
        return None
    logger.info("UniPrefill: scores summed over the attention TP group %s", group.ranks)
    return TPScoreAgreement.from_group_coordinator(group)


def _forward_with_context(original, model_runner, forward_batch, *args, **kwargs):
    from uniprefill_sglang.context import CheckFailed
    from uniprefill_sglang.runtime import get_runtime

    runtime = get_runtime()
    if runtime is None:
        return original(model_runner, forward_batch, *args, **kwargs)
    ctx = runtime.begin_forward(forward_batch)
    try:
        result = original(model_runner, forward_batch, *args, **kwargs)
    except Exception as error:
        if isinstance(error, CheckFailed) or not _uniprefill_acted(ctx):
            runtime.end_forward(ctx)
            raise
        logger.exception("UniPrefill: a %s forward failed in UniPrefill's code; running it again "
                         "without it", "prefill" if ctx.is_extend else "decode")
        runtime.abandon_forward(ctx)
        if ctx.is_extend and ctx.plan is not None:
            forward_batch.uniprefill_plan = ctx.plan.all_dense(
                f"UniPrefill error, ran dense: {type(error).__name__}: {error}")
        else:
            for row in runtime.host_rows(forward_batch):
                runtime.kv_gaps.invalidate(row)
        ctx = runtime.begin_forward(forward_batch)
        try:
            return original(model_runner, forward_batch, *args, **kwargs)
        finally:
            runtime.end_forward(ctx)
    runtime.end_forward(ctx)
    return result


def _uniprefill_acted(ctx) -> bool:
    """Did this forward drop, park, or read a per-stage view (so its failure may be ours)?"""
    if ctx.is_extend and ctx.plan is not None and ctx.plan.any_enabled:
        return True
    return bool(ctx.sparse) and any(ctx.sparse)


def register() -> None:
    target = "sglang.srt.model_executor.model_runner.ModelRunner"
    HookRegistry.register(f"{target}.init_attention_backends", _install_runtime, HookType.AFTER)
    HookRegistry.register(f"{target}._forward_raw", _forward_with_context, HookType.AROUND)
