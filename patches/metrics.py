"""Hook: `sglang.srt.managers.tokenizer_manager.TokenizerManager.collect_metrics` (AFTER).

Why: with `--enable-metrics` SGLang counts each finished request in `collect_metrics`
(`observe_one_finished_request`: prompt/generation tokens, latency), in the tokenizer manager,
which is also where the request's `meta_info["uniprefill"]` entries come together
(`ReqState.customized_info_accumulated`) and the process whose Prometheus registry `/metrics`
reads (multiprocess mode). After SGLang's own counting we count the request's UniPrefill outcome
(dropped; dense, by reason) and its kept fraction (uniprefill_sglang/metrics.py). Counting here
and not in the scheduler keeps the scheduler's hot loop untouched and counts each request once,
whatever its number of chunks and forwards.
"""

from uniprefill_sglang.patches.hook_table import Hook

from uniprefill_sglang.patches.logits import META_KEY


def _get_metrics(tokenizer_manager):
    from uniprefill_sglang.state import plugin_state

    state = plugin_state()
    if state.metrics is None:
        from uniprefill_sglang.metrics import UniPrefillMetrics

        state.metrics = UniPrefillMetrics(
            {"model_name": tokenizer_manager.server_args.served_model_name})
    return state.metrics


def _count_outcome(result, tokenizer_manager, state, *args, **kwargs):
    if not state.finished or not getattr(tokenizer_manager.server_args, "enable_uniprefill",
                                         False):
        return result
    if getattr(state, "_uniprefill_counted", False):
        return result
    state._uniprefill_counted = True
    entries = state.customized_info_accumulated.get(META_KEY)
    _get_metrics(tokenizer_manager).observe(entries)
    return result


HOOKS = (
    Hook("sglang.srt.managers.tokenizer_manager.TokenizerManager.collect_metrics", "after",
         _count_outcome, "count each finished request's UniPrefill outcome for /metrics"),
)
