"""`python -m uniprefill_sglang.tools.calibrate`: the offline estimate, the FLOP model, profile loading
and precedence (fast), and one end-to-end run on a tiny slice whose profile an engine then
starts with (`engine`)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from uniprefill_sglang.tools import calibrate as cal
from uniprefill_sglang.config import (
    DEFAULT_BLOCK_SIZE,
    SHIPPED_PROFILE_DIR,
    UniPrefillConfigError,
    build_config,
    default_drop_layers,
    find_shipped_profile,
    load_profile,
)
from uniprefill_sglang.kernels.reference import score_segment_reference, select_segment_reference
from uniprefill_sglang.selection import DropCandidates, SelectionRule, select_survivors_reference
from uniprefill_sglang.tools.cpu_engine import uniprefill_state

SMOLLM2 = cal.ModelShape("LlamaForCausalLM", 30, 576, 1536, 9, 3, 64, 8192)
FLAGS = dict(top_p=None, keep_ratio=None, block_size=None, sink_tokens=128, last_queries=128,
             drop_layers=None, min_prompt_tokens=0)


def _recorded(n_tokens=700, n_queries=32, layers=(2, 5), seed=0, needle=(300, 310)):
    """Random post-RoPE queries/keys for a few layers; the needle's keys align with the queries."""
    g = torch.Generator().manual_seed(seed)
    queries, keys = {}, {}
    for layer in layers:
        q = torch.randn(n_queries, 6, 16, generator=g)
        k = torch.randn(n_tokens, 2, 16, generator=g)
        k[needle[0]:needle[1]] += 8 * q.mean(0).view(2, 3, 16).mean(1)
        queries[layer], keys[layer] = q, k
    return queries, keys


# ---- offline estimate -----------------------------------------------------------------------


@pytest.mark.parametrize("neighbor_blocks", [0, 3])
def test_a_single_drop_replays_the_plugins_selection_rule(neighbor_blocks):
    queries, keys = _recorded(seed=random.randrange(1 << 30))
    n, nq = 700, 32
    replay = cal.ScheduleReplay(queries, keys, 0.25, sink_tokens=16, last_queries=nq,
                                neighbor_blocks=neighbor_blocks)
    rule = SelectionRule(block_size=16, sink_tokens=16, last_window=nq,
                         neighbor_blocks=neighbor_blocks)
    cands = DropCandidates(queries=queries[2], query_pos=torch.arange(n - nq, n),
                           query_counts=[nq], key_slots=torch.arange(n), key_pos=torch.arange(n),
                           key_counts=[n], prefix_counts=[0], top_p=[], keep_ratio=[0.0])
    plain_replay = cal.ScheduleReplay(queries, keys, 0.25, sink_tokens=16, last_queries=nq)
    for top_p in (0.9, 0.5):  # at 0.5 neighbours nearly always add blocks the top-p cut left
        cands.top_p = [top_p]
        keep_idx = select_survivors_reference(cands, keys[2], 0.25, rule).keep_idx
        assert replay.survivors((2,), top_p, 16).tolist() == keep_idx.tolist()
        kept = set(keep_idx.tolist())
        if top_p == 0.9:
            assert set(range(300, 310)) <= kept  # the aligned needle scores high
        # Neighbour blocks only add, at most two blocks per top block.
        plain = set(plain_replay.survivors((2,), top_p, 16).tolist())
        assert plain <= kept and len(kept - plain) <= 2 * neighbor_blocks * 16


def test_a_later_drop_scores_only_the_survivors_of_the_earlier_one():
    queries, keys = _recorded()
    n, nq = 700, 32
    replay = cal.ScheduleReplay(queries, keys, 0.25, sink_tokens=16, last_queries=nq)
    first = replay.survivors((2,), 0.6, 16)
    both = replay.survivors((2, 5), 0.6, 16)
    # The second drop: softmax over the first drop's survivors only, blocks over them in order.
    scores = score_segment_reference(queries[5], torch.arange(n - nq, n), keys[5][first], first, 0.25)
    expected = first[select_segment_reference(scores, first, 16, 0.6, 0.0, 16, nq)]
    assert both.tolist() == expected.tolist()
    assert set(both.tolist()) < set(first.tolist())
    assert replay.kept_per_stage(cal.Schedule((2, 5), 0.6, 16)) == [n, first.numel(), both.numel()]
    # top-p 1.0 keeps everything, at every drop.
    assert replay.kept_per_stage(cal.Schedule((2, 5), 1.0, 16)) == [n, n, n]
    # A top-p per drop: the second drop selects at its own top-p over the first's survivors.
    later = replay.survivors((2, 5), (0.6, 0.95), 16)
    expected = first[select_segment_reference(scores, first, 16, 0.95, 0.0, 16, nq)]
    assert later.tolist() == expected.tolist() and later.numel() > both.numel()
    assert replay.kept_per_stage(cal.Schedule((2, 5), (1.0, 0.6), 16))[1] == n


def test_later_top_p_candidates_apply_after_the_first_drop_only():
    schedules = cal.candidate_schedules([(4,), (4, 9)], top_ps=(0.99,), block_sizes=(32,),
                                        later_top_ps=(0.9, 0.99))
    assert [s.top_p for s in schedules] == [(0.99,), (0.99,), (0.99, 0.9)]
    assert schedules[-1].name == "layers 4,9 top-p 0.99,0.9 block 32"
    assert schedules[-1].top_p_json() == [0.99, 0.9] and schedules[0].top_p_json() == 0.99


TINY = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256,
                  hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
                  initializer_range=0.2, bos_token_id=1, eos_token_id=2),
    # per-head query and key norms before RoPE; global layers only (a drop scores at those)
    "gemma3": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=256,
                   hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   layer_types=["full_attention", "full_attention"], num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                   sliding_window=16, max_position_embeddings=512, rms_norm_eps=1e-6,
                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 1e4}},
                   initializer_range=0.2, pad_token_id=0, bos_token_id=2, eos_token_id=1),
    # mixtures of experts: the attention a drop scores at is the decoder's; Qwen3-MoE's has
    # per-head query and key norms, Qwen2-MoE's q/k/v biases
    **{family: dict(architectures=[arch], model_type=family, vocab_size=256, hidden_size=64,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
                    rope_theta=10000.0, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
                    num_experts_per_tok=2, **experts)
       for family, arch, experts in (
           ("qwen3_moe", "Qwen3MoeForCausalLM", dict(num_experts=4, moe_intermediate_size=32)),
           ("qwen2_moe", "Qwen2MoeForCausalLM", dict(num_experts=4, moe_intermediate_size=32,
                                                     shared_expert_intermediate_size=64)),
           ("mixtral", "MixtralForCausalLM", dict(num_local_experts=4, intermediate_size=32)))},
}


@pytest.mark.parametrize("family", sorted(TINY))
def test_the_dense_pass_scores_what_the_model_attends(family, tmp_path):
    """The replay's scores from the recorded queries and keys are the attention weights the
    model computes itself (eager attention), summed over the last queries and the heads."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from uniprefill_sglang.tools.model_zoo import random_model

    folder = random_model(tmp_path / family, TINY[family], seed=random.randrange(1 << 30))
    n, nq = 96, 8
    ids = [random.randrange(3, 256) for _ in range(n)]
    dense = cal.DensePass(folder, nq)
    dense.run(ids, max_new_tokens=1, eos_ids=set())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                 attn_implementation="eager")
    with torch.inference_mode():
        attentions = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    positions = torch.arange(n)
    for layer, weights in enumerate(attentions):
        expected = weights[0, :, -nq:].sum(dim=(0, 1))
        got = score_segment_reference(dense.queries[layer], positions[-nq:], dense.keys[layer],
                                      positions, dense.sm_scale)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_needle_survival_needs_every_token_of_one_occurrence():
    spans = [[(10, 13), (40, 42)], [(50, 51)]]
    assert cal.needle_survives(torch.tensor([10, 11, 12, 50]), spans)
    assert cal.needle_survives(torch.tensor([40, 41, 50]), spans)
    assert not cal.needle_survives(torch.tensor([10, 12, 41, 50]), spans)  # both cut
    assert not cal.needle_survives(torch.tensor([10, 11, 12]), spans)       # 2nd answer lost


def test_needle_spans_cover_the_answer_in_the_context_only(smollm2_path):
    from transformers import AutoTokenizer

    from uniprefill_sglang.tools.tasks import make_case

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    for task in cal.NEEDLE_TASKS:
        case = make_case(tok, task, 600, 0.5, 3)
        enc = tok(case.prompt, return_offsets_mapping=True)
        spans = cal.needle_token_spans(case, enc["offset_mapping"])
        assert len(spans) == len(case.answers) and all(spans)
        question_at = case.prompt.rfind(case.question)
        for answer, occurrences in zip(case.answers, spans):
            for a, b in occurrences:
                assert answer.lower() in tok.decode(case.input_ids[a:b]).lower()
                assert enc["offset_mapping"][b - 1][1] <= question_at


def test_a_leave_families_out_split_holds_out_families_and_haystacks(smollm2_path):
    import datetime

    argv = ["--model", smollm2_path, "--lengths", "600", "--tasks", "niah_number",
            "--seeds", "0", "--heldout-seeds", "1", "--heldout-tasks", "niah_multikey,qa",
            "--heldout-haystacks", "prose,essay"]
    setup = cal.prepare_run(cal.parse_args(argv), argv, datetime.datetime.now())
    assert {(c.task, c.haystack) for c in setup.calibration} == {("niah_number", "noise")}
    # A task without a haystack takes the noise filler once, not once per haystack.
    assert sorted((c.task, c.haystack) for c in setup.heldout) == [
        ("niah_multikey", "essay"), ("niah_multikey", "prose"), ("qa", "noise")]
    assert cal.unseen_families(setup.calibration, setup.heldout)
    argv = argv[:argv.index("--heldout-tasks")]  # held out: other seeds of the same families
    same = cal.prepare_run(cal.parse_args(argv), argv, datetime.datetime.now())
    assert not cal.unseen_families(same.calibration, same.heldout)


@pytest.mark.parametrize("seed", range(4))
def test_the_pareto_front_is_what_no_candidate_beats_on_both_axes(seed, tmp_path):
    """`pareto_front` against a plain pairwise check on fresh random candidates (ties
    included), and the plot of it written."""
    rng = random.Random(seed)
    rows = [{"schedule": cal.Schedule((rng.randint(2, 20),), rng.choice([0.98, 0.99]), 32),
             "est_agreement": rng.choice([0.5, 0.75, 0.9, 1.0]),
             "est_flop_ideal": {8192: rng.choice([1.1, 1.3, 1.3, 1.6, 2.0])}}
            for _ in range(rng.randint(1, 30))]

    def beaten(r):
        a, f = r["est_agreement"], r["est_flop_ideal"][8192]
        return any(o["est_agreement"] >= a and o["est_flop_ideal"][8192] >= f
                   and (o["est_agreement"], o["est_flop_ideal"][8192]) != (a, f) for o in rows)

    front = cal.pareto_front(rows, 8192)
    assert sorted(map(id, front)) == sorted(id(r) for r in rows if not beaten(r))
    speeds = [r["est_flop_ideal"][8192] for r in front]
    assert speeds == sorted(speeds)
    # Along the front, more speed never comes with more agreement.
    assert all(a["est_agreement"] >= b["est_agreement"] for a, b in zip(front, front[1:])
               if a["est_flop_ideal"][8192] < b["est_flop_ideal"][8192])
    png = cal.frontier_plot(rows, rows[0], rows[-1], 8192, str(tmp_path / "f.png"), "t")
    assert Path(png).stat().st_size > 0


def test_flop_model():
    n = 8192
    assert cal.prefill_flops([n], (), SMOLLM2) == cal.prefill_flops([n, n, n], (4, 9), SMOLLM2)
    assert cal.flop_ideal_speedup([[n, n]], (5,), SMOLLM2) == pytest.approx(1.0)
    half = cal.flop_ideal_speedup([[n, n // 2]], (5,), SMOLLM2)
    # Layers 0-5's attention and 0-4's MLP see every token, the rest half of them, whose
    # attention costs a quarter: at 8K, where attention dominates this small model, above 2x.
    assert 2.0 < half < 4.0
    assert 1.0 < cal.flop_ideal_speedup([[n, n // 2]], (20,), SMOLLM2) < half  # later saves less
    assert cal.flop_ideal_speedup([[1024, 512]], (5,), SMOLLM2) < half  # shorter saves less


def test_candidate_layer_sets_stay_inside_the_model():
    sets = cal.candidate_layer_sets(30, max_drops=3)
    assert (2,) in sets and len(set(sets)) == len(sets)
    for layers in sets:
        assert list(layers) == sorted(set(layers)) and 0 < layers[0] and layers[-1] < 29
        assert 1 <= len(layers) <= 3


def test_a_hybrid_drops_only_at_its_full_attention_layers():
    assert cal.candidate_layer_sets(18, max_drops=3, full_layers=(5, 11, 17)) == [
        (5,), (5, 11), (11,)]  # Gemma-3-270M: layer 17 is the last, nothing after it to save
    rng = random.Random()
    depth = rng.randint(12, 64)
    full = tuple(sorted(rng.sample(range(depth), rng.randint(1, depth // 2))))
    sets = cal.candidate_layer_sets(depth, max_drops=3, full_layers=full)
    usable = {layer for layer in full if 0 < layer < depth - 1}
    assert len(set(sets)) == len(sets) and {ls[0] for ls in sets} == usable
    for layers in sets:
        assert set(layers) <= usable and list(layers) == sorted(set(layers)) and len(layers) <= 3


def test_the_shape_of_a_hybrid_and_its_default_schedule():
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(num_hidden_layers=18, hidden_size=640, intermediate_size=2048,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                           architectures=["Gemma3ForCausalLM"])
    shape = cal.ModelShape.from_hf_config(cfg)
    assert shape.full_layers == (5, 11, 17)
    assert shape.default_schedule() == cal.Schedule((11,), 0.975, 64)  # the paper's Gemma 3 rule
    assert SMOLLM2.full_layers is None
    assert SMOLLM2.default_schedule() == cal.Schedule((7, 10, 14, 18, 22, 25), 0.99, 64)


@pytest.mark.parametrize("family, depth, layers", [
    ("qwen3_moe", 48, (10, 16, 22, 28, 34, 40)),  # Qwen3-30B-A3B's depth
    ("qwen2_moe", 24, (5, 8, 11, 14, 17, 20)),  # Qwen1.5-MoE-A2.7B's
    ("mixtral", 32, (7, 11, 15, 19, 23, 27)),  # Mixtral-8x7B's: the paper's Llama layers
])
def test_a_mixture_of_experts_searches_every_layer_from_the_llama_rule(family, depth, layers):
    """Every MoE layer attends in full: the search may drop at any layer, and the default is
    the paper's Llama-3.1-8B schedule scaled to the depth."""
    from transformers import AutoConfig

    from uniprefill_sglang import architectures

    cfg = AutoConfig.for_model(**dict(TINY[family], num_hidden_layers=depth))
    entry = architectures.lookup(cfg.architectures)
    assert entry is not None and entry.default_drop_layers is architectures.scaled_reference_layers
    shape = cal.ModelShape.from_hf_config(cfg)
    assert shape.full_layers is None
    assert shape.default_schedule() == cal.Schedule(layers, 0.99, 64)
    assert cal.candidate_layer_sets(depth, full_layers=shape.full_layers) == \
        cal.candidate_layer_sets(depth)


def test_gpt_oss_searches_its_full_attention_layers_from_the_scaled_llama_rule():
    """gpt-oss-20b's depth: drops only at its full-attention (odd) layers; the default is the
    Llama rule scaled to 24 layers, each moved on to the next full-attention layer."""
    from transformers import AutoConfig
    from test_gpt_oss import CONFIG

    kinds = ["sliding_attention", "full_attention"] * 12
    cfg = AutoConfig.for_model(**dict(CONFIG, num_hidden_layers=24, layer_types=kinds))
    shape = cal.ModelShape.from_hf_config(cfg)
    assert shape.full_layers == tuple(range(1, 24, 2))
    assert shape.default_schedule() == cal.Schedule((5, 9, 11, 15, 17, 21), 0.99, 64)
    sets = cal.candidate_layer_sets(24, full_layers=shape.full_layers)
    assert sets and all(l % 2 == 1 for layers in sets for l in layers)


def test_deepseek_searches_every_layer_from_the_scaled_llama_rule():
    """DeepSeek-V2-Lite's depth (27): every MLA layer attends in full, so the search may drop
    at any layer; the default is the Llama rule scaled to the depth."""
    from transformers import AutoConfig
    from test_deepseek_mla import CONFIG

    cfg = AutoConfig.for_model(**dict(CONFIG, num_hidden_layers=27))
    shape = cal.ModelShape.from_hf_config(cfg)
    assert shape.full_layers is None
    assert shape.default_schedule() == cal.Schedule((6, 9, 13, 16, 19, 23), 0.99, 64)
    assert cal.candidate_layer_sets(27, full_layers=None) == cal.candidate_layer_sets(27)


# ---- profiles ---------------------------------------------------------------------------------


def _write_profile(path: Path, layers=(4, 12), top_p=0.995, block=32, arch="LlamaForCausalLM",
                   depth=30, hidden=576) -> str:
    path.write_text(json.dumps({
        "format": cal.PROFILE_FORMAT,
        "model": {"name": "m", "architecture": arch, "num_layers": depth, "hidden_size": hidden},
        "schedule": {"drop_layers": list(layers), "top_p": top_p, "block_size": block}}))
    return str(path)


def test_a_profile_sets_what_no_flag_sets(tmp_path):
    profile = load_profile(_write_profile(tmp_path / "p.json"))
    cfg = build_config(**FLAGS, profile=profile)
    assert (cfg.drop_layers, cfg.top_p, cfg.block_size) == ((4, 12), (0.995,), 32)
    assert cfg.profile == profile.path
    # Explicit flags win, one by one.
    cfg = build_config(**{**FLAGS, "drop_layers": "6", "top_p": 0.9, "block_size": 64},
                       profile=profile)
    assert (cfg.drop_layers, cfg.top_p, cfg.block_size) == ((6,), (0.9,), 64)
    per_drop = load_profile(_write_profile(tmp_path / "per_drop.json", top_p=[0.995, 0.95]))
    assert build_config(**FLAGS, profile=per_drop).top_p == (0.995, 0.95)
    with pytest.raises(UniPrefillConfigError, match="top_p"):
        load_profile(_write_profile(tmp_path / "bad.json", top_p=[0.995, 1.5]))
    cfg = build_config(**{**FLAGS, "keep_ratio": "0.5"}, profile=profile)  # replaces top-p
    assert cfg.keep_ratio == (0.5,) and cfg.drop_layers == (4, 12)
    cfg = build_config(**{**FLAGS, "drop_layers": "none"}, profile=profile)
    assert cfg.drop_layers == ()
    # Without a profile: the defaults.
    cfg = build_config(**FLAGS)
    assert cfg.block_size == DEFAULT_BLOCK_SIZE and cfg.drop_layers is None and cfg.profile is None


def test_a_profile_bound_comes_with_its_top_p(tmp_path):
    """A dropped-mass bound calibrated with the profile's top-p applies with that top-p only;
    a flag's bound wins."""
    path = tmp_path / "bound.json"
    data = json.loads(Path(_write_profile(path)).read_text())
    data["schedule"]["max_dropped_mass"] = 0.0245
    path.write_text(json.dumps(data))
    profile = load_profile(str(path))
    cfg = build_config(**FLAGS, profile=profile)
    assert cfg.max_dropped_mass == 0.0245 and cfg.bound_from_profile
    cfg = build_config(**{**FLAGS, "max_dropped_mass": 0.01}, profile=profile)
    assert cfg.max_dropped_mass == 0.01 and not cfg.bound_from_profile
    for own_selection in ({"top_p": 0.9}, {"keep_ratio": "0.5"}):
        assert build_config(**{**FLAGS, **own_selection}, profile=profile).max_dropped_mass is None
    assert load_profile(_write_profile(tmp_path / "plain.json")).max_dropped_mass is None


@pytest.mark.parametrize("knob,value,default", [("neighbor_blocks", 4, 0),
                                               ("sink_tokens", 64, 128),
                                               ("last_queries", 32, 128)])
def test_a_profile_sets_a_selection_knob_unless_a_flag_does(tmp_path, knob, value, default):
    path = tmp_path / "knob.json"
    data = json.loads(Path(_write_profile(path)).read_text())
    data["schedule"][knob] = value
    path.write_text(json.dumps(data))
    profile = load_profile(str(path))
    unset = {**FLAGS, knob: None}
    assert getattr(build_config(**unset, profile=profile), knob) == value
    flag = default + 1
    assert getattr(build_config(**{**FLAGS, knob: flag}, profile=profile), knob) == flag
    assert getattr(build_config(**unset), knob) == default
    plain = load_profile(_write_profile(tmp_path / "plain.json"))
    assert getattr(plain, knob) is None
    assert getattr(build_config(**unset, profile=plain), knob) == default


def test_shipped_profiles_are_found_by_architecture_depth_and_hidden_size(tmp_path):
    _write_profile(tmp_path / "a.json", depth=30, hidden=576)
    _write_profile(tmp_path / "b.json", layers=(3,), depth=24, hidden=576)
    assert find_shipped_profile(["LlamaForCausalLM"], 30, 576, tmp_path).drop_layers == (4, 12)
    assert find_shipped_profile(["LlamaForCausalLM"], 24, 576, tmp_path).drop_layers == (3,)
    assert find_shipped_profile(["LlamaForCausalLM"], 30, 960, tmp_path) is None
    assert find_shipped_profile(["Qwen2ForCausalLM"], 30, 576, tmp_path) is None


def test_the_shipped_profiles_load():
    paths = sorted(SHIPPED_PROFILE_DIR.glob("*.json"))
    assert paths, "no profile ships with the package"
    for path in paths:
        p = load_profile(str(path))
        assert p.architecture and p.num_layers and p.hidden_size
        assert all(0 < l < p.num_layers for l in p.drop_layers)
        assert all(0 < top_p <= 1 for top_p in p.top_p)
    smollm2 = find_shipped_profile(["LlamaForCausalLM"], 30, 576)
    assert smollm2 is not None and smollm2.drop_layers != default_drop_layers(30)
    gemma = find_shipped_profile(["Gemma3ForCausalLM"], 18, 640)  # Gemma-3-270M
    assert gemma is not None and gemma.drop_layers == (5, 11) and gemma.block_size == 32
    assert gemma.neighbor_blocks == 4 and gemma.max_dropped_mass is None


def test_a_bad_profile_names_the_flag(tmp_path):
    (tmp_path / "bad.json").write_text('{"schedule": {}}')
    with pytest.raises(UniPrefillConfigError, match="--uniprefill-profile"):
        load_profile(str(tmp_path / "bad.json"))
    with pytest.raises(UniPrefillConfigError, match="--uniprefill-profile"):
        load_profile(str(tmp_path / "missing.json"))


def _server_args(argv):
    from launcher_args import launcher_server_args

    return launcher_server_args(argv)


def test_server_args_pick_the_profile(smollm2_path, tmp_path):
    base = ["--model-path", smollm2_path, "--device", "cpu", "--enable-uniprefill"]
    shipped = find_shipped_profile(["LlamaForCausalLM"], 30, 576)
    args = _server_args(base)
    assert args.uniprefill_profile == shipped.path
    assert args.uniprefill_config().drop_layers == shipped.drop_layers
    mine = _write_profile(tmp_path / "p.json", layers=(5,), top_p=0.999)
    cfg = _server_args([*base, "--uniprefill-profile", mine, "--uniprefill-top-p", "0.9"]) \
        .uniprefill_config()
    assert (cfg.drop_layers, cfg.top_p, cfg.block_size) == ((5,), (0.9,), 32)
    cfg = _server_args([*base, "--uniprefill-profile", "none"]).uniprefill_config()
    assert cfg.drop_layers is None and cfg.top_p == (0.99,) and cfg.block_size == DEFAULT_BLOCK_SIZE


# ---- end to end -------------------------------------------------------------------------------


@pytest.mark.engine
@pytest.mark.extended
def test_calibrate_writes_a_profile_an_engine_starts_with(smollm2_path, tmp_path, engine_factory):
    out = tmp_path / "profile.json"
    profile = cal.main([
        "--model", smollm2_path, "--lengths", "1024", "--max-cases", "2",
        "--layer-sets", "3;3,9", "--top-p", "0.99,0.999", "--block-sizes", "32",
        "--confirm", "1", "--target-agreement", "0.5", "--out", str(out), "--no-progress"])
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(profile))
    assert data["model"] == {"name": Path(smollm2_path).name, "architecture": "LlamaForCausalLM",
                             "num_layers": 30, "hidden_size": 576}
    assert data["schedule"]["drop_layers"] in ([3], [3, 9]) and data["schedule"]["block_size"] == 32
    assert not set(data["cases"]["calibration"]["names"]) & set(data["cases"]["heldout"]["names"])
    for split in ("calibration", "heldout"):
        assert data["agreement"][split]["cases"] == 2
    assert data["command"].startswith("python -m uniprefill_sglang.tools.calibrate")
    assert out.with_suffix(".png").stat().st_size > 0
    assert out.with_suffix(".frontier.png").stat().st_size > 0
    front = data["frontier"]["pareto_front"]
    assert front and all(f["drop_layers"] in ([3], [3, 9]) for f in front)

    engine = engine_factory(enable_uniprefill=True, uniprefill_profile=str(out))
    state = uniprefill_state(engine)
    assert state["drop_layers"] == data["schedule"]["drop_layers"]
    assert state["selection"]["profile"] == str(out)
    assert state["selection"]["top_p"] == data["schedule"]["top_p"]
    assert state["selection"]["block_size"] == data["schedule"]["block_size"]
    assert state["drop_layers"] != list(default_drop_layers(30))


@pytest.mark.slow
def test_offline_only_writes_the_replay_and_starts_no_engine(smollm2_path, tmp_path, monkeypatch):
    def no_engine(*args, **kwargs):
        raise AssertionError("--offline-only started an engine")

    monkeypatch.setattr(cal, "start_engine", no_engine)
    out = tmp_path / "replay.json"
    result = cal.main([
        "--model", smollm2_path, "--lengths", "1024", "--max-cases", "2",
        "--layer-sets", "3;3,9", "--top-p", "0.9,0.999", "--block-sizes", "32",
        "--neighbor-blocks", "2", "--offline-only", "--out", str(out), "--no-progress"])
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(result)) and data["neighbor_blocks"] == 2
    names = [f"layers {ls} top-p {p} block 32" for ls in ("3", "3,9") for p in ("0.9", "0.999")]
    assert sorted(c["estimate"]["cases"] > 0 for c in data["candidates"]) == [True] * 4
    # Best estimated saving first; each case says which candidates keep its needle.
    saving = [c["estimate"]["flop_ideal_speedup"]["1024"] for c in data["candidates"]]
    assert saving == sorted(saving, reverse=True)
    assert len(data["cases"]) == 2
    for case in data["cases"]:
        assert set(names) <= set(case["needle_kept"]) and set(names) <= set(case["kept"])
        for name in names:  # top-p 0.999 keeps at least what 0.9 keeps, a later drop no more
            assert case["kept"][name][0] == case["kept"][names[0]][0]
        assert case["kept"][names[1]][-1] >= case["kept"][names[0]][-1]
