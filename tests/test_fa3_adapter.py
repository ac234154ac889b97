"""The FA3 adapter's pure parts (its attention runs on Hopper only: tests/gpu/test_backends_gpu.py
compares it with the reference there): the page table a stage view becomes, which backends a
GPU server gets with --enable-uniprefill, and the batch mode an absorbed MLA call runs FA3 in."""

import random
from types import SimpleNamespace

import pytest
import torch

from uniprefill_sglang.backends.fa3 import page_table
from uniprefill_sglang.config import UniPrefillConfigError
from uniprefill_sglang.schedule import ModelFacts
from uniprefill_sglang.server_args import UniPrefillServerArgs


def _page_table_reference(lens, indices, width):
    rows, start = [], 0
    for n in lens:
        rows.append(indices[start:start + n] + [0] * (width - n))
        start += n
    return rows


@pytest.mark.parametrize("seed", range(5))
def test_page_table_lists_each_requests_slots_then_zeros(seed):
    rng = random.Random(seed)
    lens = [rng.randint(0, 40) for _ in range(rng.randint(1, 7))]
    indices = [rng.randint(1, 10_000) for _ in range(sum(lens))]
    width = max(lens + [1]) + rng.randint(0, 5)
    indptr = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    got = page_table(indptr, torch.tensor(indices, dtype=torch.int64), width)
    assert got.dtype == torch.int32 and got.shape == (len(lens), width)
    assert got.tolist() == _page_table_reference(lens, indices, width)


def test_page_table_of_no_keys():
    got = page_table(torch.zeros(3, dtype=torch.int32), torch.empty(0, dtype=torch.int64), 1)
    assert got.tolist() == [[0], [0]]


LLAMA = ModelFacts(("LlamaForCausalLM",), 4, 64, None, frozenset())
GEMMA3 = ModelFacts(("Gemma3ForCausalLM",), 6, 64,
                    ("sliding_attention",) * 5 + ("full_attention",), frozenset())
GPT_OSS = ModelFacts(("GptOssForCausalLM",), 4, 64,
                     ("sliding_attention", "full_attention") * 2, frozenset())
DEEPSEEK = ModelFacts(("DeepseekV2ForCausalLM",), 4, 64, None, frozenset())


def _choose(monkeypatch, picked, facts, attention=None, prefill=None, decode=None):
    """The backends chosen when SGLang would pick `picked` (a Hopper answer stood in for: no
    such GPU here)."""
    from uniprefill_sglang import versions

    monkeypatch.setattr(versions, "default_attention_backend", lambda args: picked)
    args = SimpleNamespace(attention_backend=attention, prefill_attention_backend=prefill,
                           decode_attention_backend=decode, disable_hybrid_swa_memory=False)
    UniPrefillServerArgs._choose_gpu_attention_backends(args, facts)
    assert args.disable_hybrid_swa_memory == (facts is GPT_OSS)
    return args.attention_backend, args.prefill_attention_backend, args.decode_attention_backend


def test_sglangs_fa3_is_kept_for_prefill_with_flashinfer_decode(monkeypatch):
    assert _choose(monkeypatch, "fa3", LLAMA) == ("fa3", None, "flashinfer")


def test_models_with_sliding_window_layers_and_other_picks_get_flashinfer(monkeypatch):
    assert _choose(monkeypatch, "fa3", GEMMA3) == ("flashinfer", None, None)
    assert _choose(monkeypatch, "fa3", None) == ("flashinfer", None, None)  # config unread
    assert _choose(monkeypatch, "flashinfer", LLAMA) == ("flashinfer", None, None)
    assert _choose(monkeypatch, "trtllm_mha", LLAMA) == ("flashinfer", None, None)


def test_gpt_oss_never_lands_on_flashinfer(monkeypatch):
    """SGLang refuses to start gpt-oss on FlashInfer: fa3 stays with Triton decode, another pick
    becomes Triton, and its sliding-window layers share the one KV pool the views read."""
    assert _choose(monkeypatch, "fa3", GPT_OSS) == ("fa3", None, "triton")
    assert _choose(monkeypatch, "trtllm_mha", GPT_OSS) == ("triton", None, None)
    assert _choose(monkeypatch, "fa3", GPT_OSS, attention="triton") == ("triton", None, None)


def test_a_family_served_on_named_backends_keeps_sglangs_pick(monkeypatch):
    """DeepSeek's MLA has a UniPrefill path on Triton: with no flag SGLang's own choice stands
    (its requests run dense there, the reason naming the flag), a user's is kept."""
    monkeypatch.delenv("UNIPREFILL_PREVIEW_BACKENDS", raising=False)
    assert _choose(monkeypatch, "fa3", DEEPSEEK) == (None, None, None)
    assert _choose(monkeypatch, "fa3", DEEPSEEK, attention="triton") == ("triton", None, None)
    assert _choose(monkeypatch, "fa3", DEEPSEEK, attention="fa3") == ("fa3", None, None)


def test_deepseek_on_fa3_prefill_decodes_on_triton_under_the_preview(monkeypatch):
    """Its FA3 prefill adapter is a preview: SGLang's fa3 pick (or a user's) is served then,
    decoding on Triton (the FA3 adapter serves no decode views, FlashInfer's MLA backend has no
    adapter); a pick outside the served backends stays untouched."""
    monkeypatch.setenv("UNIPREFILL_PREVIEW_BACKENDS", "1")
    assert _choose(monkeypatch, "fa3", DEEPSEEK) == ("fa3", None, "triton")
    assert _choose(monkeypatch, "fa3", DEEPSEEK, attention="fa3") == ("fa3", None, "triton")
    assert _choose(monkeypatch, "fa3", DEEPSEEK, prefill="fa3") == (None, "fa3", "triton")
    assert _choose(monkeypatch, "flashinfer", DEEPSEEK) == (None, None, None)
    assert _choose(monkeypatch, "fa3", DEEPSEEK, attention="triton") == ("triton", None, None)


def test_a_users_backends_are_kept(monkeypatch):
    assert _choose(monkeypatch, "fa3", LLAMA, attention="fa3") == ("fa3", None, "flashinfer")
    assert _choose(monkeypatch, "fa3", LLAMA, attention="triton") == ("triton", None, None)
    assert _choose(monkeypatch, "fa3", LLAMA, prefill="fa3", decode="triton") == (
        None, "fa3", "triton")
    with pytest.raises(UniPrefillConfigError, match="--decode-attention-backend fa3"):
        _choose(monkeypatch, "fa3", LLAMA, attention="fa3", decode="fa3")


def test_a_view_the_call_cannot_take_is_refused_naming_why():
    """`common.refuse_unservable_view`, which the FA3 and Triton adapters share."""
    from uniprefill_sglang.backends.common import StageViewAdapter, refuse_unservable_view
    from uniprefill_sglang.errors import UniPrefillError

    class Adapter(StageViewAdapter):
        target = "sglang.srt.layers.attention.some_backend.SomeBackend"

        def unsupported_reason(self, backend):
            return backend.why

    layer, kv = SimpleNamespace(layer_id=3), torch.zeros(1)
    served = SimpleNamespace(why=None)
    refuse_unservable_view(Adapter(), served, layer, kv, kv, {"score_mod": None})  # servable
    for backend, k, kwargs, why in (
            (SimpleNamespace(why="a page size other than 1"), kv, {}, "a page size other than 1"),
            (served, None, {}, "no new keys"),
            (served, kv, {"score_mod": object()}, "a score_mod"),
            (served, kv, {"rel_bias": object()}, "a rel_bias")):
        with pytest.raises(UniPrefillError, match=f"SomeBackend layer 3 .*\\({why}\\)"):
            refuse_unservable_view(Adapter(), backend, layer, k, kv, kwargs)


def test_sliding_window_layers_are_served_unless_their_pool_or_an_fp8_cache_is_separate():
    """gpt-oss's (and a named fa3 Gemma 3's) sliding-window layers run the positional kernel
    after a drop; SGLang's separate sliding-window pool and an fp8 cache there are not served."""
    from uniprefill_sglang.backends.fa3 import ADAPTER

    def backend(**over):
        fields = dict(page_size=1, use_mla=False, has_swa=True, use_sliding_window_kv_pool=False,
                      has_local_attention=False, is_encoder_decoder=False,
                      token_to_kv_pool=SimpleNamespace(dtype=torch.bfloat16))
        return SimpleNamespace(**{**fields, **over})

    assert ADAPTER.unsupported_reason(backend()) is None
    assert "sliding-window KV pool" in ADAPTER.unsupported_reason(
        backend(use_sliding_window_kv_pool=True))
    assert "fp8" in ADAPTER.unsupported_reason(
        backend(token_to_kv_pool=SimpleNamespace(dtype=torch.float8_e4m3fn)))
    assert ADAPTER.unsupported_reason(backend(has_swa=False, token_to_kv_pool=SimpleNamespace(
        dtype=torch.float8_e4m3fn))) is None
    # MLA (DeepSeek, a preview): served over its latent pool in the model's dtype only.
    assert ADAPTER.unsupported_reason(backend(has_swa=False, use_mla=True)) is None
    assert ADAPTER.unsupported_reason(backend(has_swa=False, use_mla=True, token_to_kv_pool=(
        SimpleNamespace(dtype=torch.float8_e4m3fn)))) == "FA3 with MLA and an fp8 KV cache"


def test_an_absorbed_mla_call_runs_fa3_outside_the_multi_head_prefix_mode(monkeypatch):
    """The layers before the first drop run DeepSeek's multi-head form, which leaves the batch's
    `attn_attend_prefix_cache` set; FA3 runs the absorbed form (every layer from the first drop
    on) only where it is None, so each absorbed call clears it and gives it back. A multi-head
    call keeps it, and so does every call where UniPrefill has no drop schedule (no runtime).
    No drop context here: the dense path of such a server."""
    from uniprefill_sglang.backends import fa3
    from uniprefill_sglang.backends.fa3 import forward_extend

    seen = []

    def original(backend, q, k, v, layer, forward_batch, save_kv_cache, *args, **kwargs):
        seen.append((forward_batch.attn_attend_prefix_cache, save_kv_cache, kwargs))
        return "out"

    backend = SimpleNamespace(use_mla=True, token_to_kv_pool=None)
    layer = SimpleNamespace(layer_id=1)
    rope = torch.zeros(2, 1, 4)
    batch = SimpleNamespace(attn_attend_prefix_cache=False)
    forward_extend(original, backend, "q", "k", "v", layer, batch, True, q_rope=rope, k_rope=rope)
    assert seen[-1][:2] == (False, True)  # UniPrefill off: upstream's call unchanged
    monkeypatch.setattr(fa3, "active_runtime", lambda: SimpleNamespace())  # a drop schedule
    for mode in (False, True, None):
        batch = SimpleNamespace(attn_attend_prefix_cache=mode)
        assert forward_extend(original, backend, "q", "k", "v", layer, batch, True,
                              q_rope=rope, k_rope=rope) == "out"
        assert seen[-1][:2] == (None, True) and seen[-1][2]["k_rope"] is rope
        assert batch.attn_attend_prefix_cache is mode
    batch = SimpleNamespace(attn_attend_prefix_cache=False)
    forward_extend(original, backend, "q", "k", None, layer, batch, False)  # the multi-head form
    assert seen[-1][:2] == (False, False)


def _follow_up_batch(rng: random.Random, staged: bool):
    """A dense extend over cached prefixes whose slots hold KV up to a random stage (a
    follow-up question): every new row runs at every stage."""
    from uniprefill_sglang.context import DropContext, Survivors
    from uniprefill_sglang.kv_validity import ForwardKV, SlotStages

    drops, bs, num_slots = rng.randint(1, 4), rng.randint(1, 4), 2048
    pools = None
    if staged:  # each later stage keeps a slot's KV at its own index (a permutation per stage)
        maps = torch.stack([torch.randperm(num_slots) for _ in range(drops)]).to(torch.int32)
        pools = SimpleNamespace(maps=maps, stage_slots=lambda s, k: maps[k - 1, s.long()])
    slots = SlotStages(num_slots, drops, "cpu", pools=pools)
    free = torch.randperm(num_slots).tolist()
    req_to_token = torch.zeros(bs + 2, 400, dtype=torch.int32)
    rows = torch.randperm(bs + 2)[:bs]  # the requests' rows of the table
    new_slots, lens, fixed, prefix_valid = [], [], [], []
    for b in range(bs):
        prefix, new = rng.choice((0, rng.randint(1, 200))), rng.randint(1, 60)
        seq = torch.tensor([free.pop() for _ in range(prefix + new)], dtype=torch.int32)
        req_to_token[rows[b], : prefix + new] = seq
        stage = torch.tensor([rng.randint(0, drops) for _ in range(prefix)], dtype=torch.int8)
        slots.slot_stage[seq[:prefix].to(torch.int64)] = stage
        new_slots.append(seq[prefix:])
        lens.append(new)
        fixed.append(prefix)
        prefix_valid.append([prefix] + [int((stage >= s).sum()) for s in range(1, drops + 1)])
    fb = SimpleNamespace(req_pool_indices=rows)
    ctx = DropContext(plan=None, forward_batch=fb, is_extend=True,
                      survivors=Survivors(out_cache_loc=torch.cat(new_slots), lens=lens,
                                          fixed_lens=fixed),
                      kv=ForwardKV(prefix_valid=prefix_valid, sparse=[True] * bs))
    runtime = SimpleNamespace(slots=slots, check_kv_lens=True)
    return runtime, SimpleNamespace(req_to_token=req_to_token), ctx


@pytest.mark.parametrize("seed", range(12))
def test_a_follow_ups_views_built_at_once_equal_the_stage_by_stage_ones(seed):
    """Where the drop layers do not act, `_extend_view` builds every stage's page table in one
    pass: the same rows as the per-stage path (`stage_keys`), and as a readable reference (per
    request, the prefix slots the stage holds, then its new rows)."""
    from uniprefill_sglang.backends import fa3

    rng = random.Random(seed)
    runtime, backend, ctx = _follow_up_batch(rng, staged=seed % 3 == 0)
    at_once = fa3._views_of_unchanged_rows(runtime, backend, ctx)
    rows = ctx.forward_batch.req_pool_indices
    assert sorted(at_once) == [(s, None) for s in range(1, runtime.slots.full + 1)]
    for (stage, _), view in at_once.items():
        one = fa3._stage_view(runtime, backend, ctx, stage)
        table, seqlens, cu_q, cu_k, max_q, max_k, _ = view
        assert table.dtype == torch.int32 and table.is_contiguous()
        assert table.data_ptr() % 64 == 0
        assert torch.equal(seqlens, one[1]) and torch.equal(cu_q, one[2])
        assert torch.equal(cu_k, one[3]) and (max_q, max_k) == one[4:6]
        start = 0
        for b, n in enumerate(ctx.survivors.lens):
            prefix = backend.req_to_token[rows[b], : ctx.survivors.fixed_lens[b]].to(torch.int64)
            held = prefix[runtime.slots.slot_stage[prefix] >= stage]
            new = ctx.survivors.out_cache_loc[start:start + n].to(torch.int64)
            expected = runtime.slots.pool_slots(torch.cat([held, new]), stage).tolist()
            count = int(seqlens[b])
            assert count == len(expected)
            assert table[b, :count].tolist() == expected == one[0][b, :count].tolist()
            start += n
