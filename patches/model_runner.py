"""Hooks on `sglang.srt.model_executor.model_runner.ModelRunner`.

* `init_attention_backends` (AFTER): the model, KV pool and backends exist now (and no CUDA graph
  has been captured yet): build the UniPrefill runtime and wrap the model's layers.
* `_forward_raw` (AROUND): open the per-forward drop context around every forward. A forward
  in which UniPrefill acted and that raised runs once more without it, so an error in the
  plugin's code never takes the server down: a decode with its KV lengths re-read from the
  device; an extend with every request dense from its prompt's first token (parked rows of
  earlier chunks and cached prefixes lacking tokens rejoin whole; meta_info says "UniPrefill
  error, re-prefilled dense"). Should that dense run fail in the plugin's rejoin too, the batch
  runs plain and the requests whose earlier chunks could not be recomputed are failed with an
  error (patches/scheduler.py), never answered from incomplete KV. Under tensor parallelism
  only the plugin's own errors are recovered from. Any other second failure is SGLang's and
  propagates as it would without the plugin. A failed debug check
  (`errors.CheckFailed`) is never caught: it exists to make a bookkeeping bug loud.
"""

import logging
from typing import Callable, Optional

from uniprefill_sglang.patches.hook_table import Hook

logger = logging.getLogger(__name__)

# The start-up check of the whole hook table (`patches.unresolved_hooks`), handed in by the
# table's module when it imports this one: this module is one of the table's rows.
_unresolved_hooks: Optional[Callable] = None


def use_hook_check(unresolved_hooks: Callable) -> None:
    global _unresolved_hooks
    _unresolved_hooks = unresolved_hooks


def _install_runtime(result, model_runner, *args, **kwargs):
    from uniprefill_sglang import model_integration
    from uniprefill_sglang.backends import (block_sparse, correct_upstream,
                                            full_attention_prefill, prepare_views)
    from uniprefill_sglang.drop import warm_up
    from uniprefill_sglang.kv_validity import LayerStages
    from uniprefill_sglang.request_plan import log_fallback_once
    from uniprefill_sglang.runtime import UniPrefillRuntime
    from uniprefill_sglang.schedule import NO_DROP_LAYERS, process_schedule
    from uniprefill_sglang.state import plugin_state

    server_args = model_runner.server_args
    if not getattr(server_args, "enable_uniprefill", False) or model_runner.is_draft_worker:
        return result
    _check_hooks(model_runner)
    corrected = correct_upstream(model_runner.attn_backend)
    if corrected:
        logger.warning("UniPrefill: %s", corrected)
    state = plugin_state()
    config = state.config(server_args)
    schedule = process_schedule(server_args, model_runner.model_config,
                                use_mla=model_runner.use_mla_backend)
    if schedule.dense_reason not in (None, NO_DROP_LAYERS):
        # Served dense, every request says why in meta_info; say it once here, loudly.
        logger.warning("UniPrefill: %s; every request runs dense", schedule.dense_reason)
    runtime = UniPrefillRuntime(config, schedule.stages, model_runner.req_to_token_pool,
                                model_runner.token_to_kv_pool, model_runner.device,
                                _tp_agreement(model_runner),
                                checkpoint_shape=_checkpoint_shape(model_runner, schedule),
                                allocator=model_runner.token_to_kv_pool_allocator)
    runtime.dense_reason = schedule.dense_reason
    runtime.piece_rows = max(0, server_args.chunked_prefill_size or 0)
    runtime.block_sparse_unserved = block_sparse.unserved_reason(
        type(full_attention_prefill(model_runner.attn_backend)).__name__,
        model_runner.use_mla_backend)
    runtime.parking.cost = _rejoin_cost(model_runner, schedule.facts.entry)
    architectures = list(schedule.facts.architectures)
    if runtime.has_schedule and not model_integration.install(
            model_runner.model, runtime, schedule.facts.entry):
        runtime.dense_reason = (f"model {type(model_runner.model).__name__} does not have the "
                                "decoder layers its architecture's integration expects")
        log_fallback_once(runtime.dense_reason)
        runtime.stages = LayerStages((), schedule.stages.num_layers)
    if runtime.slots.staged:
        _check_staged_layout(model_runner, runtime)
    if runtime.has_schedule:  # compile and allocate now, not in the first request
        warm_up(runtime, model_integration.drop_attention(model_runner.model,
                                                          runtime.stages.drop_layers[0]),
                model_runner.dtype)
        prepare_views(model_runner.attn_backend, runtime)
    if runtime.dense_reason == NO_DROP_LAYERS:
        log_fallback_once(f"architecture {architectures} without a drop schedule")
    logger.info("UniPrefill enabled: drop layers %s, %s", list(runtime.stages.drop_layers), config)
    state.runtime = runtime
    return result


def _rejoin_cost(model_runner, architecture):
    """What parking a chunked prompt costs in device memory (parking.RejoinCost)."""
    from uniprefill_sglang.model_integration import mixer_size, query_size
    from uniprefill_sglang.parking import RejoinCost
    from uniprefill_sglang.stage_pools import slot_bytes_per_layer

    config = model_runner.model_config
    hidden = config.hidden_size
    mlp = architecture.shape.mlp if architecture is not None else "mlp"
    tp = max(1, getattr(model_runner, "tp_size", 1))
    return RejoinCost.for_model(
        hidden, query_size(model_runner.model) or hidden,
        max(slot_bytes_per_layer(model_runner.token_to_kv_pool), default=0),
        model_runner.dtype, model_runner.device, mixer_size=mixer_size(model_runner.model, mlp),
        q_heads=max(1, config.num_attention_heads // tp), kv_heads=config.get_num_kv_heads(tp))


def _check_hooks(model_runner) -> None:
    """Refuse to start when a hook this model needs did not take (SGLang only logs it)."""
    import sglang

    missing = _unresolved_hooks(_backend_classes(model_runner.attn_backend))
    if missing:
        raise RuntimeError(
            f"UniPrefill: hook target(s) {', '.join(missing)} did not resolve on SGLang "
            f"{sglang.__version__}; this plugin was written for SGLang 0.5.17. Start without "
            "--enable-uniprefill, or install a supported SGLang")


def _backend_classes(backend) -> set:
    """Class names of an attention backend and of the backends it delegates to (a hybrid
    model's full- and linear-attention backends)."""
    names, todo = set(), [backend]
    while todo:
        b = todo.pop()
        if b is None or type(b).__name__ in names:
            continue
        names.add(type(b).__name__)
        todo += [v for k, v in vars(b).items()
                 if k.endswith("backend") and hasattr(v, "forward_extend")]
        todo += [v for v in getattr(b, "attn_backend_list", None) or []]
    return names


def _check_staged_layout(model_runner, runtime):
    """Under the staged KV layout the layers after the first drop can only be read through the
    plugin's per-stage views: refuse at start-up what would read them another way."""
    from uniprefill_sglang.backends import staged_layout_unsupported

    why = ("the model runs without a drop schedule" if not runtime.has_schedule
           else staged_layout_unsupported(model_runner.attn_backend))
    if why:
        raise RuntimeError(f"UniPrefill: the staged KV layout cannot serve this model: {why}; "
                           "start with --uniprefill-kv-layout shared")


def _checkpoint_shape(model_runner, schedule):
    """(hidden_size, query_size, dtype) of the checkpoint when prefix re-selection can use it:
    the radix cache is on and the prefix policy verifies or re-selects (prefix_reuse.py)."""
    from uniprefill_sglang.model_integration import query_size

    if not schedule.checkpoint:
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
    from uniprefill_sglang.request_plan import forward_plan
    from uniprefill_sglang.runtime import get_runtime

    runtime = get_runtime()
    if runtime is None:
        return original(model_runner, forward_batch, *args, **kwargs)
    plan = forward_plan(forward_batch)

    def run():
        return original(model_runner, forward_batch, *args, **kwargs)

    result, failure = _attempt(runtime, forward_batch, run)
    if failure is None:
        return result
    error, ctx = failure
    logger.error("UniPrefill: a %s forward failed in UniPrefill's code; running it again dense",
                 "prefill" if ctx.is_extend else "decode", exc_info=error)
    why, is_extend = f"{type(error).__name__}: {error}", ctx.is_extend
    runtime.abandon_forward(ctx)
    del failure, error, ctx
    _release_failed_forward()
    if not is_extend or plan is None:
        for row in runtime.host_rows(forward_batch):
            runtime.kv_gaps.invalidate(row)
        return _run_once(runtime, forward_batch, run)
    # Dense from the prompt's first token: parked rows of earlier chunks and cached prefixes
    # that lack tokens rejoin whole, so no later layer misses a token.
    forward_batch.uniprefill_inputs.plan = plan.all_dense(
        f"UniPrefill error, re-prefilled dense: {why}", restore=True)
    result, failure = _attempt(runtime, forward_batch, run)
    if failure is None:
        return result
    # The dense run needed UniPrefill's code too (rows rejoined) and failed: run the batch
    # plain, and fail the requests whose earlier chunks it could not recompute.
    logger.error("UniPrefill: the dense re-run failed too; failing the requests whose earlier "
                 "chunks it could not recompute", exc_info=failure[0])
    runtime.abandon_forward(failure[1], give_up_parking=True)
    del failure
    _release_failed_forward()
    forward_batch.uniprefill_inputs.plan = plan.all_dense(f"UniPrefill error, ran dense: {why}")
    return _run_once(runtime, forward_batch, run)


def _release_failed_forward() -> None:
    """Free what a failed forward still holds before the batch runs again: the failure's
    traceback frames keep its activations alive (after running out of memory in a rejoin,
    gigabytes), so the re-run would fail where the plain batch fits. The caller drops its own
    references to the error first."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _attempt(runtime, forward_batch, run):
    """One forward in a drop context: (result, None), or (None, (error, its context)) when it
    raised where UniPrefill acted and may be recovered from; any other error propagates."""
    from uniprefill_sglang.errors import CheckFailed

    ctx = runtime.begin_forward(forward_batch)
    try:
        result = run()
    except Exception as error:
        if (isinstance(error, CheckFailed) or not _uniprefill_acted(ctx)
                or not _recoverable(runtime, error)):
            runtime.end_forward(ctx)
            raise
        return None, (error, ctx)
    runtime.end_forward(ctx)
    return result, None


def _run_once(runtime, forward_batch, run):
    ctx = runtime.begin_forward(forward_batch)
    try:
        return run()
    finally:
        runtime.end_forward(ctx)


def _recoverable(runtime, error) -> bool:
    """Under tensor parallelism every rank must run the same forwards: only UniPrefill's own
    errors (raised alike on every rank, from the same host-known decisions) are recovered from;
    anything else (e.g. an OOM on one rank) re-raises, as a rank re-running alone would hang
    the collectives."""
    from uniprefill_sglang.errors import UniPrefillError

    return runtime.tp_agreement is None or isinstance(error, UniPrefillError)


def _uniprefill_acted(ctx) -> bool:
    """Did this forward drop, park, read a per-stage view or plan block-sparse attention (so
    its failure may be ours)?"""
    if ctx.acts or (ctx.plan is not None and ctx.plan.any_block_sparse):
        return True
    return bool(ctx.kv.sparse) and any(ctx.kv.sparse)


_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
HOOKS = (
    Hook(f"{_RUNNER}.init_attention_backends", "after", _install_runtime,
         "the model, KV pool and backends exist, no graph is captured yet: build the runtime"),
    Hook(f"{_RUNNER}._forward_raw", "around", _forward_with_context,
         "open the drop context around every forward; a failure in UniPrefill re-runs dense"),
    Hook("decoder layers, their drop layers' RadixAttention, residual norm and MLP", "instance",
         "uniprefill_sglang.model_integration:install",
         "the drop runs after a drop layer's attention and the later sublayers run on the "
         "survivors (set by init_attention_backends above)"),
    Hook("FlashInferAttnBackend.use_paged, for a model with sliding-window layers", "instance",
         "uniprefill_sglang.backends.flashinfer:window_in_prefill",
         "upstream's ragged prefill leaves Gemma 3's window out; its paged prefill applies it "
         "(set by init_attention_backends above, dense engines included)"),
)
