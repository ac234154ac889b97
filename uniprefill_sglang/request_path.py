"""A request's path through UniPrefill, written down: its three phases, the SGLang objects that
carry UniPrefill state from one phase to the next, and one knob followed from the HTTP body to
the selection. This module holds no code. A name quoted as module:attribute is an attribute of
uniprefill_sglang.module (or, for a module starting with sglang., of SGLang's);
tests/test_request_path.py checks that each exists.

Phases
------
1. Admit (tokenizer manager, then scheduler). SGLang checks a request's sampling parameters in
   `sglang.srt.sampling.sampling_params:SamplingParams.verify`; the hook
   `patches.sampling_params:_verify_knobs` checks its UniPrefill knobs there with
   `request_knobs:parse_request_knobs` and a bad one is an HTTP 400 naming it (the parse itself
   is not kept). The scheduler then admits the request as SGLang does; under the staged KV
   layout the stage pools' room counts too (`patches.kv_allocator:_before_admission`).
2. Plan (scheduler, once per forward batch). `ForwardBatch.init_new` builds the batch the model
   runner runs; its hook `patches.forward_batch:_attach_plan` decides per request with
   `request_plan:plan_batch` and `request_plan:decide`, from the request's knobs parsed once on
   this side (`request_plan:request_knobs`), and attaches a `request_plan:ForwardInputs` (the
   batch's req-pool rows and its `request_plan:BatchPlan`) to the batch.
3. Forward (model runner). `patches.model_runner:_forward_with_context` runs around
   `ModelRunner._forward_raw`: `runtime:UniPrefillRuntime.begin_forward` opens a
   `context:DropContext` on the batch's inputs, and every hook of the forward reads it from the
   batch it is given (`context:drop_context`): the drop layer's RadixAttention runs the drop
   (`model_integration:_wrap_drop_attention`, `drop:drop`), each decoder layer's entry moves its
   inputs to the survivors and hands the context to its sublayers' wrappers
   (`model_integration:LayerCall`), the attention adapters read KV through per-stage views
   (`backends.common:needs_view`), and the logits hook reports per request
   (`patches.logits:_logits_forward`). `runtime:UniPrefillRuntime.end_forward` closes it and
   records per request the KV each later stage lacks; a forward that failed in UniPrefill's code
   is rolled back (`runtime:UniPrefillRuntime.abandon_forward`) and runs again dense.

What carries UniPrefill state
-----------------------------
One attribute per SGLang object kind, each with one meaning:

| SGLang object | attribute | type | written by | read by |
|---|---|---|---|---|
| `Req` | `uniprefill_knobs` | `request_knobs:RequestKnobs` or `request_knobs:RequestKnobError` | `request_plan:request_knobs` | `request_plan:decide` |
| `ForwardBatch` | `uniprefill_inputs` | `request_plan:ForwardInputs` | `patches.forward_batch:_attach_plan`, `runtime:UniPrefillRuntime.begin_forward` | `request_plan:forward_plan`, `context:drop_context`, `runtime:UniPrefillRuntime.host_rows`, `patches.model_runner:_forward_with_context` |
| a runner's copy of the batch (eager or CUDA graph) | `uniprefill_inputs` | the live batch's `request_plan:ForwardInputs` | `patches.cuda_graphs:_carry_inputs` | `context:drop_context` |
| KV pool | `uniprefill_stage_buffers` | `stage_pools:StagedBuffers` | `patches.kv_pool:_create_stage_buffers` | `patches.kv_pool:_write_at_stage_slots`, `stage_pools:wire_stage_pools` |
| KV allocator | `uniprefill_stage_pools` | `stage_pools:StagePools` | `stage_pools:wire_stage_pools` | `patches.kv_allocator:_pools` |
| `Scheduler` | `uniprefill_admission` | `patches.kv_allocator:_Admission` | `patches.kv_allocator:_admission` | `patches.kv_allocator:_retry_after_drops`, `patches.kv_allocator:admission_retries` |
| radix cache | `uniprefill_matched_prefix_len` | `int` or `None` | `patches.radix_cache:_record_insert`, `patches.radix_cache:_record_first_insert` | `patches.radix_cache:_insert_marking_shared` |
| attention backend | `uniprefill_adapter_state` | its adapter's `State` | `backends.common:StageViewAdapter.state` | that adapter's hooks |
| Triton's forward metadata | `uniprefill_decode_views` | `dict` of per-stage views | `backends.triton:init_forward_metadata`, `backends.triton:init_forward_metadata_out_graph` | `backends.triton:forward_decode` |
| FlashInfer's decode metadata | `uniprefill_stage_wrappers` | `bool`: one wrapper per stage | `backends.flashinfer:init_forward_metadata`, `backends.flashinfer:init_forward_metadata_out_graph` | `backends.flashinfer:get_wrapper_idx` |
| FlashInfer's decode metadata | `uniprefill_windows` | `dict` of window key lists | the same | `backends.flashinfer:forward_decode` |

Within a forward the drop context is passed on, never looked up: through the batch's
`uniprefill_inputs` to whatever SGLang hands the batch, and through a `LayerCall` to the
sublayers it does not. Beside the forward's inputs (its plan, the batch, extend or not) it holds
one part per concern, each defined by the module that writes it: the surviving rows
(`context:Survivors`), the KV each request holds per stage and the adapters' views
(`kv_validity:ForwardKV`), what the forward does to parked rows and the rows rejoining
(`parking:ParkingStep`), the cached prefixes it moved to private slots
(`prefix_reuse:MovedPrefixes`), the rows a sublayer run in pieces runs now (`pieces:RowPieces`)
and the per-request report (`context:DropReport`). What outlives a forward lives on the runtime
(`runtime:UniPrefillRuntime`: the per-stage KV bookkeeping, the parked rows, the prefix
checkpoint), reached through `runtime:get_runtime`.

The path of `uniprefill_top_p`
------------------------------
1. The HTTP body: `/generate`'s `sampling_params.custom_params.uniprefill_top_p`, or the OpenAI
   endpoints' `custom_params` (`extra_body` in the Python client). SGLang builds a
   `sglang.srt.sampling.sampling_params:SamplingParams` holding it in `custom_params`.
2. `patches.sampling_params:_verify_knobs` parses it with `request_knobs:parse_request_knobs`
   (a number in (0, 1], one per drop layer, or a comma-separated string): a bad value is a 400.
3. On the scheduler the `Req` keeps the sampling params. At the request's first plan
   `request_plan:request_knobs` parses them into a `request_knobs:RequestKnobs` kept on the Req
   as `req.uniprefill_knobs`; `request_plan:decide` copies its `top_p` (a tuple, one per drop)
   into the request's `request_plan:RequestDecision`, which `request_plan:plan_batch` puts in
   the batch's `request_plan:BatchPlan`, and `patches.forward_batch:_attach_plan` on
   `forward_batch.uniprefill_inputs.plan`.
4. `runtime:UniPrefillRuntime.begin_forward` reads the plan (`request_plan:forward_plan`) into
   the forward's `context:DropContext` (`plan`), set on `forward_batch.uniprefill_inputs`
   as `drop_context`.
5. At each drop layer `model_integration:_wrap_drop_attention` gets the context from its
   `forward_batch` argument and calls `drop:drop`; `drop:_plan_step` takes the drop's value
   (`request_plan:RequestDecision.top_p_at`) into the `selection:DropCandidates` (`top_p`, one
   per request), and `drop:_select` calls `selection:select_survivors`, which keeps each
   request's top blocks holding that share of the attention mass.
"""
