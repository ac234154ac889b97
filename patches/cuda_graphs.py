"""Hooks on SGLang's CUDA graph runners (`sglang.srt.model_executor.runner`).

* `PrefillCudaGraphRunner.can_run_graph` (AROUND), below.
* `PrefillCudaGraphRunner._trim_logits_output` (AROUND): the runner rebuilds the
  LogitsProcessorOutput of a replayed batch and drops its `customized_info`, where the logits
  hook (patches/logits.py) reports the per-request UniPrefill decisions
  (`meta_info["uniprefill"]`); carry it over.
* `EagerRunner.load_batch`, `PrefillCudaGraphRunner.load_batch` and
  `decode_cuda_graph_runner.build_replay_fb_view` (AFTER): the runners run the model on copies
  of the live batch (the eager runner's copy in its static buffers, the static batch the prefill
  graph's eager attention and tail are given, the view a decode graph plans its attention
  metadata from); they carry its UniPrefill inputs, drop context included
  (context.drop_context).
* `DecodeCudaGraphRunner.can_run_graph` (AROUND): the adapters' per-stage decode-graph index
  lists are sized to the KV pool, not to upstream's max batch x context length
  (backends/common.py `decode_graph_entries`); a decode batch whose sequences hold more entries
  (requests sharing cached prefix slots) decodes eagerly, counted in `eager_decode_overflows`.

`can_run_graph` (AROUND):

Why: a prefill CUDA graph is captured for fixed token counts, while a step in which the drop
layers act (drop, park, restore or let rows rejoin: `DropContext.acts`) changes its row count
mid-forward and runs the drop's host code between layers. Such a step runs eagerly. Every other
step replays the graph, also where later layers read per-stage KV views (a sparse cached prefix,
the staged KV layout): SGLang's breakable graph runs attention eagerly between its captured
segments, so the adapters' extend hooks plan and run the views there, from the drop context the
static batch carries (`load_batch` above). The answer is reported per request (`prefill_cuda_graph` in
`meta_info["uniprefill"]`). Where FlashInfer serves a sliding-window model every prefill runs
eagerly (`_flashinfer_wrapper_pair`). Decode graphs need no bypass: the attention backends
capture them with one view per stage (patches/attention_backends.py).
"""

from uniprefill_sglang.patches.hook_table import Hook


def needs_eager_prefill(forward_batch) -> bool:
    from uniprefill_sglang.backends import block_sparse
    from uniprefill_sglang.context import drop_context
    from uniprefill_sglang.runtime import get_runtime

    runtime, ctx = get_runtime(), drop_context(forward_batch)
    if runtime is None or ctx is None or not ctx.is_extend:
        return False
    if block_sparse.runs_in(ctx, runtime):  # its attention is chosen on the host per step
        return True
    return runtime.has_schedule and ctx.acts


def _flashinfer_wrapper_pair(runner) -> bool:
    """FlashInfer serving a sliding-window model (a wrapper pair): SGLang 0.5.17's breakable
    prefill graph replays its padded rows through a ragged wrapper planned for the batch's own
    rows (`q.shape[0] (3072) does not match qo_indptr[-1] (3000)`, Gemma 3): eager there."""
    backend = getattr(runner.model_runner, "attn_backend", None)
    return type(backend).__name__ == "FlashInferAttnBackend" and backend.num_wrappers > 1


def _prefill_can_run_graph(original, runner, forward_batch, *args, **kwargs):
    from uniprefill_sglang.context import drop_context

    replay = (not needs_eager_prefill(forward_batch) and not _flashinfer_wrapper_pair(runner)
              and original(runner, forward_batch, *args, **kwargs))
    ctx = drop_context(forward_batch)
    if ctx is not None and ctx.is_extend:
        ctx.report.prefill_graph = bool(replay)
    return replay


def _carry_inputs_to_loaded_batch(result, runner, forward_batch, *args, **kwargs):
    """The batch a runner loads the live one into (the eager runner's copy in its static
    buffers, which the model runs on; the static batch a prefill graph replays with, which its
    eager attention and tail are given) carries the live batch's UniPrefill inputs, drop context
    included."""
    from uniprefill_sglang.versions import loaded_batch

    _carry_inputs(forward_batch, loaded_batch(result))
    return result


def _carry_inputs_to_replay_view(view, forward_batch, *args, **kwargs):
    """The view a decode graph's replay prepares its attention metadata from carries the live
    batch's UniPrefill inputs (the adapters' per-stage lists read its KV gaps)."""
    _carry_inputs(forward_batch, view)
    return view


def _carry_inputs(forward_batch, copy) -> None:
    inputs = getattr(forward_batch, "uniprefill_inputs", None)
    if inputs is not None:
        copy.uniprefill_inputs = inputs


def _keep_customized_info(original, runner, output, *args, **kwargs):
    trimmed = original(runner, output, *args, **kwargs)
    info = getattr(output, "customized_info", None)
    if info is not None and getattr(trimmed, "customized_info", None) is None:
        trimmed.customized_info = info
    return trimmed


def _decode_can_run_graph(original, runner, forward_batch, *args, **kwargs):
    from uniprefill_sglang.backends.common import decode_graph_fits, seq_lens_sum
    from uniprefill_sglang.runtime import get_runtime

    replay = original(runner, forward_batch, *args, **kwargs)
    runtime = get_runtime()
    if not replay or runtime is None or not forward_batch.forward_mode.is_decode():
        return replay
    padding = runner.max_bs * max(1, int(getattr(runner, "seq_len_fill_value", 1)))
    if decode_graph_fits(runtime, seq_lens_sum(forward_batch, forward_batch.batch_size), padding):
        return True
    runtime.stats.eager_decode_overflows += 1
    return False


_RUNNER = "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner"
_DECODE = "sglang.srt.model_executor.runner.decode_cuda_graph_runner"
_DECODE_RUNNER = f"{_DECODE}.DecodeCudaGraphRunner"
_EAGER_RUNNER = "sglang.srt.model_executor.runner.eager_runner.EagerRunner"
HOOKS = (
    Hook(f"{_EAGER_RUNNER}.load_batch", "after", _carry_inputs_to_loaded_batch,
         "the copy of the batch the model runs on carries the live batch's drop context"),
    Hook(f"{_RUNNER}.load_batch", "after", _carry_inputs_to_loaded_batch,
         "the static batch a prefill graph replays with carries the live batch's drop context"),
    Hook(f"{_DECODE}.build_replay_fb_view", "after", _carry_inputs_to_replay_view,
         "the view a decode graph's replay plans attention from carries the live batch's "
         "drop context"),
    Hook(f"{_RUNNER}.can_run_graph", "around", _prefill_can_run_graph,
         "a batch that drops, or reads sparse KV, changes its row count mid-forward: eager"),
    Hook(f"{_RUNNER}._trim_logits_output", "around", _keep_customized_info,
         "a replayed batch's logits output keeps the per-request UniPrefill report"),
    Hook(f"{_DECODE_RUNNER}.can_run_graph", "around", _decode_can_run_graph,
         "per-stage decode-graph index lists are sized to the KV pool: a batch holding more "
         "entries (shared cached prefixes) decodes eagerly"),
)
