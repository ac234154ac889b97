"""Qwen3-Next on SGLang's CPU engine: Gated DeltaNet layers after a drop run over the survivors.

The model is a reduced Qwen3-Next with random weights (`Qwen3NextForCausalLM`: 4 layers, a full
attention layer every second one, MoE MLPs with a shared expert), written by transformers. SGLang
runs its GDN layers on the CPU through the `sgl_kernel` CPU kernels, which the test-only stand-in
forwards to the torch references of `tests/stubs/linear_attention_reference.py`
(checked here against transformers' own torch implementation), and a few fused Triton kernels of
the model (its gated RMSNorm, the shared expert's gate) through Triton's interpreter.

With drops at layer 1, layer 2 (Gated DeltaNet) and layer 3 (full attention) run on the
survivors:
* top-p 1.0 answers token for token as dense;
* a forced keep ratio answers the same unchunked and under chunked prefill, where the earlier
  chunks park at the first drop and no row of theirs reaches the later linear layer before the
  final chunk: a later layer's recurrent state covers the survivors in order, or the two would
  differ from the first decoded token on;
* two prompts batched answer as each alone (the survivors' rows are packed per request).
* chunked at 128, the final chunk's step carries more than 128 rows after the drop, and the GDN
  layer after it runs them in pieces of 128, each continuing the state the one before left: its
  log-probabilities at top-p 1.0 equal dense's under the same chunking.
* block-sparse attention at its full-attention layers: every causal block answers as dense, a
  density of 0.3 over the forced keep is realised and answers.
"""

from __future__ import annotations

import random

import pytest
import torch
from hybrid_workload import (BLOCK_SPARSE_ENGINE, assert_block_sparse_over_full_attention,
                             assert_mixers_ran_in_pieces, assert_nothing_left,
                             block_sparse_requests, random_prompts, run_hybrid_workload)

import linear_attention_reference as ref
from uniprefill_sglang.tools.cpu_engine import make_cpu_engine, triton_interpreter

CONFIG = dict(
    architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=512,
    hidden_size=128, intermediate_size=256, num_hidden_layers=4, full_attention_interval=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=64, hidden_act="silu",
    max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0,
    partial_rotary_factor=0.25, linear_conv_kernel_dim=4, linear_key_head_dim=32,
    linear_value_head_dim=32, linear_num_key_heads=1, linear_num_value_heads=2,
    decoder_sparse_step=1, moe_intermediate_size=64, shared_expert_intermediate_size=64,
    num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[],
    tie_word_embeddings=False, initializer_range=0.2, bos_token_id=1, eos_token_id=2)
ENGINE = dict(skip_tokenizer_init=True, context_length=2048, log_level="warning",
              enable_uniprefill=True, uniprefill_drop_layers="1", uniprefill_block_size=16,
              uniprefill_sink_tokens=16, uniprefill_last_queries=16)
GREEDY = {"temperature": 0.0, "max_new_tokens": 12}
FORCED = dict(GREEDY, custom_params={"uniprefill_keep_ratio": 0.4})


# ---- the references against transformers' torch implementation ----------------------------------
def _hf():
    return pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


def _hf_conv_update(hf, x, state, weight, bias):
    """transformers' torch conv update with SiLU: `torch_causal_conv1d_update` (SiLU built in)
    up to 5.12, `causal_conv1d_update(..., activation=)` from 5.19 on."""
    old = getattr(hf, "torch_causal_conv1d_update", None)
    if old is not None:
        return old(x, state, weight, bias)
    return hf.causal_conv1d_update(x, state, weight, bias, activation="silu")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gated_delta_rule_reference_matches_transformers(seed):
    """Packed sequences, each from its own state slot, against transformers' recurrence run on
    each sequence alone (its state [K, V], ours [V, K]; its heads repeated by the caller)."""
    hf = _hf()
    g = torch.Generator().manual_seed(seed)
    hk, hv, dk, dv = 2, 4, 16, 8
    lens = [int(x) for x in torch.randint(1, 20, (3,), generator=g)]
    total = sum(lens)
    q, k = (torch.randn(1, total, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(1, total, hv, dv, generator=g)
    gate = -torch.rand(1, total, hv, generator=g)
    beta = torch.rand(1, total, hv, generator=g)
    pool = torch.randn(5, hv, dv, dk, generator=g)
    slots = torch.tensor([4, 0, 2])
    before = pool.clone()
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)))
    out, _, _ = ref.gated_delta_rule_varlen(q, k, v, gate, beta, pool, slots, cu)
    assert not torch.isnan(out).any()
    for b, slot in enumerate(slots.tolist()):
        s, e = int(cu[b]), int(cu[b + 1])
        rep = hv // hk
        want, state = hf.torch_recurrent_gated_delta_rule(
            q[:, s:e].repeat_interleave(rep, 2), k[:, s:e].repeat_interleave(rep, 2), v[:, s:e],
            gate[:, s:e], beta[:, s:e], before[slot].transpose(-1, -2).unsqueeze(0), True,
            use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[:, s:e], want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(pool[slot], state[0].transpose(-1, -2), rtol=1e-4, atol=1e-5)
    assert torch.equal(pool[[1, 3]], before[[1, 3]])  # slots of no sequence are untouched


@pytest.mark.parametrize("seed", [0, 1])
def test_causal_conv_reference_matches_transformers(seed):
    """Packed sequences with and without an initial state, and one decode step, against
    transformers' conv over [state, inputs]."""
    hf = _hf()
    g = torch.Generator().manual_seed(seed)
    dim, width = 12, 4
    weight, bias = torch.randn(dim, width, generator=g), None
    lens, initial = [5, 1, 9], [True, False, True]
    x = torch.randn(dim, sum(lens), generator=g)
    states = torch.randn(4, dim, width - 1, generator=g)
    slots = torch.tensor([3, 1, 0])
    before = states.clone()
    cu = torch.tensor([0, 5, 6, 15])
    out = ref.causal_conv1d_varlen(x, weight, bias, states, cu, slots, torch.tensor(initial))
    for b, slot in enumerate(slots.tolist()):
        s, e = int(cu[b]), int(cu[b + 1])
        start = before[slot].clone() if initial[b] else torch.zeros(dim, width - 1)
        state = start.unsqueeze(0)
        want = _hf_conv_update(hf, x[None, :, s:e], state, weight, bias)
        torch.testing.assert_close(out[:, s:e], want[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(states[slot], state[0])
    step_in = torch.randn(3, dim, generator=g)
    state = states[slots].clone()
    want = _hf_conv_update(hf, step_in.unsqueeze(-1), state, weight, bias)[..., 0]
    got = ref.causal_conv1d_step(step_in, states, weight, bias, "silu", conv_state_indices=slots)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(states[slots], state)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_piece_members_match_a_row_by_row_count(seed):
    """backends/common.piece_members (the rows of one piece, for the GDN and short-conv
    adapters) against counting the piece's rows one by one."""
    from uniprefill_sglang.backends.common import piece_members

    rng = random.Random(seed)
    lens = [rng.randint(1, 40) for _ in range(rng.randint(1, 6))]
    fixed = [rng.randint(0, 30) for _ in lens]
    owner = [b for b, n in enumerate(lens) for _ in range(n)]  # each row's request
    offset = [i for n in lens for i in range(n)]  # each row's index within its request
    for _ in range(20):
        start = rng.randrange(len(owner))
        end = rng.randint(start + 1, len(owner))
        members = sorted(set(owner[start:end]))
        rows = [owner[start:end].count(b) for b in members]
        before = [fixed[b] + min(offset[i] for i in range(start, end) if owner[i] == b)
                  for b in members]
        assert piece_members(lens, fixed, (start, end)) == (members, rows, before)
    assert piece_members(lens, fixed, None) == (list(range(len(lens))), lens, fixed)


# ---- the engine --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The reduced Qwen3-Next, random weights (seeded), as a Hugging Face folder. The config is
    written as given: SGLang reads the layer kinds from `full_attention_interval`."""
    pytest.importorskip("transformers")
    from uniprefill_sglang.tools.model_zoo import random_model

    return random_model(tmp_path_factory.mktemp("qwen3_next"), CONFIG)


PROMPT, OTHER = random_prompts(CONFIG["vocab_size"])


def _engine(model_dir, **kwargs):
    # SGLang runs the model's fused Triton kernels (gated RMSNorm, shared-expert gate) on a CPU
    # without Intel AMX only through Triton's interpreter.
    with triton_interpreter():
        return make_cpu_engine(model_dir, **ENGINE, **kwargs)


@pytest.fixture(scope="module")
def runs(model_dir):
    from uniprefill_sglang import versions

    if not versions.applies("<0.5.23"):
        # SGLang 0.5.23's Qwen3-Next allocates its layer buffers on
        # torch.get_device_module().current_device(), which the CPU engine has not: it runs on
        # 0.5.17 (CI's last leg) and on the GPU.
        pytest.skip("SGLang 0.5.23's Qwen3-Next does not build on the CPU engine")
    return run_hybrid_workload(
        lambda **kw: _engine(model_dir, **BLOCK_SPARSE_ENGINE, **kw), PROMPT, OTHER, GREEDY,
        FORCED, more=lambda engine: block_sparse_requests(engine, PROMPT, GREEDY, FORCED))


def _last(out) -> dict:
    return out["meta_info"]["uniprefill"][-1]


@pytest.mark.engine
def test_served_without_radix_cache_on_the_shared_layout(runs):
    assert runs["server"]["disable_radix_cache"] is True
    assert runs["state"]["drop_layers"] == [1]
    assert runs["state"]["kv_layout"] == "shared"


@pytest.mark.engine
def test_top_p_one_is_token_identical_to_dense(runs):
    assert runs["full"]["output_ids"] == runs["dense"]["output_ids"]
    assert _last(runs["full"])["kept_tokens"] == [len(PROMPT)] * 2
    assert runs["chunked_full"]["output_ids"] == runs["dense"]["output_ids"]


@pytest.mark.engine
def test_forced_drop_answers_the_same_chunked_and_batched(runs):
    kept = _last(runs["forced"])["kept_tokens"]
    assert _last(runs["forced"])["reason"] is None
    assert kept[0] == len(PROMPT) and kept[1] < 0.6 * len(PROMPT), kept
    assert len(runs["forced"]["output_ids"]) == GREEDY["max_new_tokens"]
    # Earlier chunks parked at layer 1 and the final chunk scored the whole prompt (kept[0]).
    assert _last(runs["chunked"])["kept_tokens"] == kept
    assert runs["chunked"]["output_ids"] == runs["forced"]["output_ids"]
    assert [o["output_ids"] for o in runs["batch"]] == \
        [runs["forced"]["output_ids"], runs["other"]["output_ids"]]
    assert [_last(o)["kept_tokens"] for o in runs["batch"]] == \
        [kept, _last(runs["other"])["kept_tokens"]]


@pytest.mark.engine
def test_linear_layers_after_a_rejoin_run_in_pieces(runs):
    assert_mixers_ran_in_pieces(runs)


@pytest.mark.engine
def test_block_sparse_attention_at_its_full_attention_layers(runs):
    assert_block_sparse_over_full_attention(runs)


@pytest.mark.engine
def test_nothing_left_behind(runs):
    assert_nothing_left(runs)


@pytest.mark.engine
def test_parking_is_priced_at_the_costlier_layer_kind(runs):
    """A rejoining row costs what the costlier layer kind holds alive (parking.RejoinCost): the
    GDN layer (hidden state, residual, norm output and its projections once: q/k/v/z, b/a, the
    convolution, the output; the mixer runs in pieces) or the attention layer (its rows'
    residual stream, or a drop layer's queries; the sublayer runs in pieces). float32 on the CPU
    engine."""
    c = CONFIG
    keys, values = (c["linear_num_key_heads"] * c["linear_key_head_dim"],
                    c["linear_num_value_heads"] * c["linear_value_head_dim"])
    projections = ((2 * keys + 2 * values) + 2 * c["linear_num_value_heads"]
                   + (2 * keys + values) + c["hidden_size"])
    query = c["num_attention_heads"] * c["head_dim"]
    attention = max(4 * c["hidden_size"], 3 * c["hidden_size"] + query) * 4
    assert runs["state"]["rejoin_row_bytes"] == max(attention,
                                                    (4 * c["hidden_size"] + projections) * 4)

