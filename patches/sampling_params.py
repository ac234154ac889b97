"""Hook: `sglang.srt.sampling.sampling_params.SamplingParams.verify` (AFTER).

Why: `SamplingParams.verify` is where SGLang checks a request's sampling parameters
(`TokenizerManager._create_tokenized_object` calls it for every request, before the request
reaches the scheduler); the `ValueError` it raises is answered as HTTP 400 by `/generate` and the
OpenAI endpoints, and raised to the caller by `sglang.Engine`. The UniPrefill knobs travel in
`custom_params`, which SGLang passes through unchecked, so without this hook a bad knob (a top-p
of 2, "abc", a typo in the key) could only be noticed on the scheduler side, where the request
already runs. Checking them here (uniprefill_sglang/request_knobs.py) answers a bad knob exactly
as a bad `temperature`: the same status, a message naming the knob.

Only while the server runs with `--enable-uniprefill` (read from the server args the tokenizer
manager publishes); otherwise the plugin is inert and `uniprefill*` keys are not ours to judge.
"""

from uniprefill_sglang.patches.hook_table import Hook


def _server_config():
    """The UniPrefill config of this process's server, or None when UniPrefill is off."""
    from sglang.srt.runtime_context import get_server_args

    try:
        server_args = get_server_args()
    except ValueError:  # not published: no tokenizer manager in this process
        return None
    if not getattr(server_args, "enable_uniprefill", False):
        return None
    from uniprefill_sglang.state import plugin_state

    return plugin_state().config(server_args)


def _verify_knobs(result, sampling_params, *args, **kwargs):
    from uniprefill_sglang.request_knobs import parse_request_knobs

    config = _server_config()
    if config is not None:
        parse_request_knobs(sampling_params.custom_params, config)
    return result


HOOKS = (
    Hook("sglang.srt.sampling.sampling_params.SamplingParams.verify", "after", _verify_knobs,
         "a bad per-request knob is a 400 naming it, as a bad temperature is"),
)
