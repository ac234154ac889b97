"""The Triton adapter (uniprefill_sglang/backends/triton.py) on the CPU: SGLang's Triton attention
backend runs its kernels through Triton's interpreter, so the adapter's per-stage views run here
against the torch_native reference, on a 4-layer Llama with seeded random weights.

Both engines use the staged KV layout, a keep ratio of 0.5 at layers 1 and 2, chunked prefill
at 128 tokens and the radix cache. The Triton engine must answer exactly as the reference, with
the same kept counts:
* two prompts batched, each longer than a chunk (earlier chunks park, then the views of
  compacted survivors);
* a question over a document, then two more over the cached document: one re-selects (verify),
  one reads the sparse prefix as cached (reuse-sparse: views of a prefix that lacks tokens in
  later stages), all decoding eight tokens through the per-stage decode views.
* a prompt with block-sparse attention (backends/block_sparse.py), chunked: the adapter hands
  its layers to the module before and after the drops (the attention itself is the module's
  torch path on the CPU, its Triton kernel being tested in test_block_sparse.py).
The GPU tests (tests/gpu) cover the same adapter with CUDA graphs, bf16 and long prompts.
"""

from __future__ import annotations

import random

import pytest

from uniprefill_sglang.tools.cpu_engine import idle_state, make_cpu_engine, triton_interpreter

# CI-extended: the Triton adapter runs through the scheduler in CI with gpt-oss and DeepSeek MLA.
pytestmark = pytest.mark.extended

LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512,
             hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
             rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
             initializer_range=0.2, bos_token_id=1, eos_token_id=2)
ENGINE = dict(skip_tokenizer_init=True, context_length=2048, log_level="warning",
              enable_uniprefill=True, uniprefill_drop_layers="1,2", uniprefill_keep_ratio=0.5,
              uniprefill_block_size=16, uniprefill_sink_tokens=16, uniprefill_last_queries=16,
              chunked_prefill_size=128, uniprefill_prefix_checkpoint=True,
              uniprefill_block_sparse_block_size=16, uniprefill_block_sparse_min_tokens=64,
              # one part per sequence in Triton's decode kernel keeps the interpreter quick
              triton_attention_num_kv_splits=1)
GREEDY = {"temperature": 0.0, "max_new_tokens": 8}


def _ids(rng, n):
    return [rng.randrange(3, LLAMA["vocab_size"]) for _ in range(n)]


_rng = random.Random(0)
BATCH = [_ids(_rng, 300), _ids(_rng, 200)]
DOC = _ids(_rng, 256)
QUESTIONS = [_ids(_rng, 40) for _ in range(3)]
SPARSE = _ids(_rng, 260)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    from uniprefill_sglang.tools.model_zoo import random_model

    return random_model(tmp_path_factory.mktemp("llama_tiny"), LLAMA)


def _workload(engine) -> dict:
    out = {"batch": engine.generate(input_ids=BATCH, sampling_params=GREEDY)}
    policies = ("verify", "verify", "reuse-sparse")
    out["doc"] = [engine.generate(input_ids=DOC + q, sampling_params=dict(
        GREEDY, custom_params={"uniprefill_prefix_policy": p}))
        for q, p in zip(QUESTIONS, policies)]
    # block-sparse attention before and after the drops, a chunk's queries over its prefix
    out["sparse"] = engine.generate(input_ids=SPARSE, sampling_params=dict(
        GREEDY, custom_params={"uniprefill_block_sparse_density": 0.3}))
    out["state"] = idle_state(engine)
    return out


@pytest.fixture(scope="module")
def runs(model_dir):
    out = {}
    for backend in ("torch_native", "triton"):
        with triton_interpreter():
            engine = make_cpu_engine(model_dir, attention_backend=backend, **ENGINE)
        try:
            out[backend] = _workload(engine)
        finally:
            engine.shutdown()
    return out


def _answers(run) -> list:
    return [(o["output_ids"], o["meta_info"]["uniprefill"][-1]["kept_tokens"],
             (o["meta_info"]["uniprefill"][-1].get("prefix") or {}).get("action"),
             o["meta_info"]["uniprefill"][-1].get("block_sparse_density"))
            for o in run["batch"] + run["doc"] + [run["sparse"]]]


def test_the_workload_drops_parks_and_reuses(runs):
    ref = runs["torch_native"]
    kept = [o["meta_info"]["uniprefill"][-1]["kept_tokens"] for o in ref["batch"]]
    assert [k[0] for k in kept] == [len(p) for p in BATCH]  # parked chunks rejoined
    assert all(k[-1] < k[0] for k in kept)
    actions = [(o["meta_info"]["uniprefill"][-1].get("prefix") or {}).get("action")
               for o in ref["doc"]]
    assert actions[0] is None and actions[2] == "reused"
    assert all(o["meta_info"]["cached_tokens"] >= len(DOC) for o in ref["doc"][1:])
    assert 0.3 <= ref["sparse"]["meta_info"]["uniprefill"][-1]["block_sparse_density"] < 0.6


def test_triton_answers_as_the_reference(runs):
    assert _answers(runs["triton"]) == _answers(runs["torch_native"])


@pytest.mark.parametrize("backend", ["torch_native", "triton"])
def test_staged_pools_sound_when_idle(runs, backend):
    state = runs[backend]["state"]
    assert state["kv_layout"] == "staged"
    assert state["kv_pool_problems"] == [] and state["parked_requests"] == 0
    assert state["available_kv_tokens"] + state["evictable_kv_tokens"] == \
        state["max_total_num_tokens"]
