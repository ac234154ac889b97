"""Hooks on `sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner`.

* `can_run_graph` (AROUND), below.
* `_trim_logits_output` (AROUND): the runner rebuilds the LogitsProcessorOutput of a replayed
  batch and drops its `customized_info`, where the logits hook (patches/logits.py) reports the
  per-request UniPrefill decisions (`meta_info["uniprefill"]`); carry it over.

`can_run_graph` (AROUND):

Why: a prefill CUDA graph is captured for fixed token counts, while a batch that drops tokens
changes its row count mid-forward (and its later layers read per-stage KV views planned at run
time). Such a batch, and one whose requests reuse a sparse cached prefix, runs eagerly; batches
with nothing to drop and no sparse KV keep the graph, under the shared KV layout only (under the
staged layout every layer after the first drop reads its own pool through those views). Decode
graphs need no bypass: the attention backends capture them with one view per stage
(patches/attention_backends.py).
"""

from uniprefill_sglang.patches.hook_table import Hook


def needs_eager_prefill(forward_batch) -> bool:
    from uniprefill_sglang.context import current
    from uniprefill_sglang.runtime import get_runtime

    runtime, ctx = get_runtime(), current()
    if runtime is None or not runtime.has_schedule or ctx is None or not ctx.is_extend:
        return False
    if runtime.slots.staged:
        return True  # the later stages' KV is read through views planned at run time
    plan = ctx.plan
    if plan is not None and any(d.enabled or getattr(d, "park", False) for d in plan.decisions):
        return True  # a drop (or chunked-prefill parking) may happen in this forward
    return bool(ctx.sparse) and any(ctx.sparse)  # a cached prefix misses KV in later stages


def _prefill_can_run_graph(original, runner, forward_batch, *args, **kwargs):
    if needs_eager_prefill(forward_batch):
        return False
    return original(runner, forward_batch, *args, **kwargs)


def _keep_customized_info(original, runner, output, *args, **kwargs):
    trimmed = original(runner, output, *args, **kwargs)
    info = getattr(output, "customized_info", None)
    if info is not None and getattr(trimmed, "customized_info", None) is None:
        trimmed.customized_info = info
    return trimmed


_RUNNER = "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner"
HOOKS = (
    Hook(f"{_RUNNER}.can_run_graph", "around", _prefill_can_run_graph,
         "a batch that drops, or reads sparse KV, changes its row count mid-forward: eager"),
    Hook(f"{_RUNNER}._trim_logits_output", "around", _keep_customized_info,
         "a replayed batch's logits output keeps the per-request UniPrefill report"),
)
