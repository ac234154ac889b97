"""Gemma 3 under a drop on SGLang's CPU engine (torch_native, Triton) against a float64 reference.

The model is a reduced Gemma 3 (`Gemma3ForCausalLM`, 8 layers: sliding window 16 except the
global layers 1, 3 and 6) with seeded random weights, written by transformers. UniPrefill drops
at the global layers 3 and 6: layer 1 (global) runs before the first drop on every token, the
sliding layers 4, 5 and 7 and the global layer 6 after it on the survivors, at their original
positions. The oracle is `tests/gemma3_reference.py` (plain torch,
float64), itself checked against transformers' Gemma 3 in float64: with nothing dropped, and,
under a drop, against transformers' own decoder layers run on the survivors.

On the engine (torch_native, and Triton through Triton's interpreter; chunked prefill at 128
tokens, the staged KV layout), with a forced keep ratio
(the selection made by the engine, its kept positions fingerprinted by `UNIPREFILL_REPORT_KEPT`;
every step's logits read by `LogitsProbe`):
* each drop keeps the positions the reference selects in float64 from its own queries and keys;
* the 12 greedy tokens are the reference's, and every step's logits are within a relative
  bound of the reference's (float32 against float64): a prompt longer than a chunk (its first
  chunk parks at the first drop layer and rejoins), one shorter (one step), and the two batched;
* top-p 1.0 keeps every token and answers token for token as dense, which answers as the
  reference does with nothing dropped.
Prompts are fresh random tokens each run, drawn so that float32 cannot decide otherwise than
float64: no selection cut or greedy choice within 1e-4 (relative) of a tie.
"""

from __future__ import annotations

import contextlib
import os
import random

import pytest
import torch

from uniprefill_sglang import kernels
import gemma3_reference as ref
from uniprefill_sglang.context import Survivors
from uniprefill_sglang.tools.cpu_engine import (
    flush_cache,
    idle_state,
    make_cpu_engine,
    triton_interpreter,
)

LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention",
               "sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
CONFIG = dict(
    architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=512,
    hidden_size=128, intermediate_size=256, num_hidden_layers=len(LAYER_TYPES),
    layer_types=LAYER_TYPES, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    query_pre_attn_scalar=32, sliding_window=16, hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=4096, rms_norm_eps=1e-6,
    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    attention_bias=False, tie_word_embeddings=True, initializer_range=0.2,
    pad_token_id=0, bos_token_id=2, eos_token_id=1)
DROP_LAYERS = (3, 6)
RULE = dict(block_size=16, sink_tokens=16, last_queries=16)
KEEP_RATIO = 0.4
NEW_TOKENS = 12
CHUNK = 128
ENGINE = dict(skip_tokenizer_init=True, context_length=2048, max_total_tokens=4096,
              log_level="warning", enable_uniprefill=True,
              uniprefill_drop_layers=",".join(map(str, DROP_LAYERS)),
              uniprefill_block_size=RULE["block_size"],
              uniprefill_sink_tokens=RULE["sink_tokens"],
              uniprefill_last_queries=RULE["last_queries"],
              uniprefill_kv_layout="staged", chunked_prefill_size=CHUNK,
              enable_custom_logit_processor=True, disable_overlap_schedule=True)
# Triton's decode kernel splits each sequence in parts run as programs of their own: one part
# keeps the interpreter quick (the number of splits is upstream's business, tested upstream).
BACKEND_KWARGS = {"torch_native": {}, "triton": {"triton_attention_num_kv_splits": 1}}
# float32 engine against the float64 reference: max |difference| / max |reference logit|.
LOGITS_RTOL = 1e-4
TIE_MARGIN = 1e-4


def _forced_drops():
    return [ref.Drop(layer, keep_ratio=KEEP_RATIO, **RULE) for layer in DROP_LAYERS]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The reduced Gemma 3: transformers' initialisation (seeded), then every RMSNorm weight
    drawn too (transformers starts them at 0, a norm of scale 1 + w) and small embeddings, so
    that the attention layers, not the token's own embedding, decide the next token (Gemma 3
    ties the LM head to the embeddings)."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    from uniprefill_sglang.tools.model_zoo import random_model

    folder = random_model(tmp_path_factory.mktemp("gemma3_tiny"), CONFIG, seed=0)
    path = os.path.join(folder, "model.safetensors")
    weights = load_file(path)
    gen = torch.Generator().manual_seed(1)
    for name in sorted(weights):
        if "norm" in name:
            weights[name] = torch.randn(weights[name].shape, generator=gen) * 0.3
        elif name.endswith("embed_tokens.weight"):
            weights[name] = torch.randn(weights[name].shape, generator=gen) * 0.02
    save_file(weights, path, metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def model(model_dir):
    return ref.Gemma3.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float64, attn_implementation="eager").eval()


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    err = float((got.to(torch.float64) - want).abs().max() / want.abs().max())
    assert err == err, "NaN in the logits"
    return err


def _prompt(rng: random.Random, n: int):
    return [rng.randrange(3, CONFIG["vocab_size"]) for _ in range(n)]


# ---- the reference against transformers --------------------------------------------------------
@pytest.mark.slow  # builds the model with transformers
def test_reference_is_transformers_gemma3_with_nothing_dropped(model, hf_model):
    """Prefill and greedy decode with every token kept: every step's logits are transformers'
    (float64; transformers computes RoPE's angles in float32, hence the bound)."""
    rng = random.Random(torch.seed())
    prompt = _prompt(rng, rng.randrange(60, 200))
    gen = ref.generate(model, prompt, max_new_tokens=6)
    with torch.no_grad():
        want = hf_model(torch.tensor([prompt + gen.tokens[:-1]])).logits[0, len(prompt) - 1:]
    for step, logits in enumerate(gen.logits):
        assert _rel_err(logits, want[step]) < 1e-5, step
    assert [len(kv.positions) for kv in gen.kv] == [len(prompt) + 5] * len(LAYER_TYPES)


def _transformers_on_survivors(hf, prompt, kept_by_layer):
    """Prefill through transformers' own Gemma 3 layers, the rows after each drop layer left
    out (the layer's MLP is row-wise: gathering after it equals gathering after its attention),
    RoPE and the masks on the survivors' original positions. The last token's logits."""
    m = hf.model
    positions = torch.arange(len(prompt))
    h = m.embed_tokens(torch.tensor([prompt]))
    for i, layer in enumerate(m.layers):
        kind = hf.config.layer_types[i]
        cos_sin = m.rotary_emb(h, positions[None], layer_type=kind)
        window = hf.config.sliding_window if kind == ref.SLIDING else None
        mask = ref.visible(positions, positions, window)
        bias = torch.zeros(mask.shape, dtype=h.dtype).masked_fill(~mask, torch.finfo(h.dtype).min)
        h = layer(h, position_embeddings=cos_sin, attention_mask=bias[None, None],
                  position_ids=positions[None])
        h = h[0] if isinstance(h, tuple) else h
        if i in kept_by_layer:
            keep = torch.isin(positions, torch.tensor(kept_by_layer[i]))
            h, positions = h[:, keep], positions[keep]
    return hf.lm_head(m.norm(h))[0, -1]


@pytest.mark.slow
def test_reference_drop_is_transformers_layers_on_the_survivors(model, hf_model):
    rng = random.Random(torch.seed())
    prompt = _prompt(rng, rng.randrange(100, 200))
    gen = ref.generate(model, prompt, _forced_drops(), max_new_tokens=1)
    assert len(gen.kept[0]) < len(prompt) and len(gen.kept[1]) < len(gen.kept[0])
    assert set(gen.kept[1]) <= set(gen.kept[0]) and gen.kept[1][-1] == len(prompt) - 1
    with torch.no_grad():
        want = _transformers_on_survivors(hf_model, prompt, dict(zip(DROP_LAYERS, gen.kept)))
    assert _rel_err(gen.logits[0], want) < 1e-5
    # The later layers hold KV for the survivors only.
    held = [len(kv.positions) for kv in gen.kv]
    assert held == [len(prompt)] * 4 + [len(gen.kept[0])] * 3 + [len(gen.kept[1])]


# ---- the engine --------------------------------------------------------------------------------
def _cut_margin(scores: torch.Tensor, block_size: int, keep_ratio: float) -> float:
    """How far the keep-ratio cut is from a tie: the gap between the last kept block's score
    and the first left out, relative to the top block's."""
    blocks = torch.sort(kernels.block_scores_reference(scores, block_size), descending=True).values
    k = kernels.num_blocks_for_ratio(keep_ratio, blocks.numel())
    if k >= blocks.numel():
        return float("inf")
    return float((blocks[k - 1] - blocks[k]) / blocks[0])


def _greedy_margin(logits) -> float:
    top = torch.stack([torch.topk(l, 2).values for l in logits])
    return float(((top[:, 0] - top[:, 1]) / top[:, 0].abs()).min())


def _clear_prompt(model, rng, n):
    """A fresh random prompt of n tokens whose forced selection and greedy answers (dense and
    dropped) are each decided by more than TIE_MARGIN, with the reference's answers."""
    for _ in range(50):
        prompt = _prompt(rng, n)
        dense = ref.generate(model, prompt, max_new_tokens=NEW_TOKENS)
        forced = ref.generate(model, prompt, _forced_drops(), max_new_tokens=NEW_TOKENS)
        margins = [_cut_margin(s, RULE["block_size"], KEEP_RATIO) for s in forced.scores]
        margins += [_greedy_margin(dense.logits), _greedy_margin(forced.logits)]
        if min(margins) > TIE_MARGIN:
            return prompt, dense, forced
    raise AssertionError("no prompt without a near-tie in 50 draws")


@contextlib.contextmanager
def _environment(**values):
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module",
                params=["torch_native", pytest.param("triton", marks=pytest.mark.extended)])
def runs(request, model_dir, model, tmp_path_factory):
    """The workload on one engine per attention backend (Triton's kernels run through Triton's
    interpreter; its sliding-window layers after a drop run `kernels.positional_attention`)."""
    rng = random.Random(torch.seed())
    # A prompt longer than a chunk (prefilled in two steps), one shorter.
    cases = [_clear_prompt(model, rng, n) for n in (rng.randrange(CHUNK + 32, 200),
                                                    rng.randrange(96, CHUNK))]
    probes = tmp_path_factory.mktemp("logits")
    with _environment(UNIPREFILL_REPORT_KEPT="1", UNIPREFILL_CHECK_KV_LENS="1"), \
            triton_interpreter():
        engine = make_cpu_engine(model_dir, attention_backend=request.param,
                                 **ENGINE, **BACKEND_KWARGS[request.param])
    from uniprefill_sglang.tools.logits_probe import PARAM, LogitsProbe, read_logits

    def generate(name, prompts, custom):
        flush_cache(engine)  # no request reads another's cached prompt
        folders = [probes / f"{name}{i}" for i in range(len(prompts))]
        params = []
        for folder in folders:
            folder.mkdir()
            # The reference generates through EOS: so does the engine.
            params.append({"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True,
                           "custom_params": dict(custom, **{PARAM: str(folder)})})
        outs = engine.generate(input_ids=prompts, sampling_params=params,
                               custom_logit_processor=[LogitsProbe.to_str()] * len(prompts))
        for out, folder in zip(outs, folders):
            out["logits"] = read_logits(folder)
        return outs

    out = {"cases": cases}
    try:
        first = [cases[0][0]]
        out["dense"] = generate("dense", first, {"uniprefill": False})[0]
        out["full"] = generate("full", first, {"uniprefill_top_p": 1.0})[0]
        out["forced"] = generate("forced", first, {"uniprefill_keep_ratio": KEEP_RATIO})[0]
        out["short"] = generate("short", [cases[1][0]], {"uniprefill_keep_ratio": KEEP_RATIO})[0]
        out["batch"] = generate("batch", [c[0] for c in cases],
                                {"uniprefill_keep_ratio": KEEP_RATIO})
        out["state"] = idle_state(engine)
    finally:
        engine.shutdown()
    return out


def _digest(positions) -> int:
    """The fingerprint `kept_digest` reports for a request that kept `positions`."""
    return Survivors(positions=torch.tensor(positions), lens=[len(positions)]).position_digest()[0]


def _meta(out) -> dict:
    return out["meta_info"]["uniprefill"][-1]


def _check_against(out, want: ref.Generation, kept=None):
    """The engine's answer is the reference's: same kept positions (fingerprints), tokens and,
    at every step, logits within LOGITS_RTOL."""
    meta = _meta(out)
    if kept is not None:
        assert meta["enabled"] and meta["reason"] is None, str(meta)
        assert meta["kept_tokens"][1:] == [len(k) for k in kept], meta
        assert meta["kept_digest"] == [_digest(k) for k in kept], meta
    assert out["output_ids"] == want.tokens
    assert len(out["logits"]) == len(want.logits) == NEW_TOKENS
    errors = [_rel_err(got, w) for got, w in zip(out["logits"], want.logits)]
    assert max(errors) < LOGITS_RTOL, errors


@pytest.mark.engine
def test_dense_engine_is_the_reference(runs):
    prompt, dense, _ = runs["cases"][0]
    assert _meta(runs["dense"])["reason"] == "disabled by the request"
    _check_against(runs["dense"], dense)


@pytest.mark.engine
def test_top_p_one_keeps_everything_and_answers_as_dense(runs):
    prompt = runs["cases"][0][0]
    meta = _meta(runs["full"])
    assert meta["enabled"] and meta["kept_tokens"] == [len(prompt)] * (len(DROP_LAYERS) + 1)
    assert runs["full"]["output_ids"] == runs["dense"]["output_ids"]


@pytest.mark.engine
@pytest.mark.parametrize("name, case", [("forced", 0), ("short", 1)])
def test_forced_keep_answers_as_the_reference(runs, name, case):
    """The prompt longer than a chunk (earlier chunk parked) and the one shorter."""
    _, _, forced = runs["cases"][case]
    _check_against(runs[name], forced, forced.kept)


@pytest.mark.engine
def test_forced_keep_batched_answers_as_the_reference(runs):
    for out, (_, _, forced) in zip(runs["batch"], runs["cases"]):
        _check_against(out, forced, forced.kept)
    state = runs["state"]
    assert state["drop_layers"] == list(DROP_LAYERS) and state["kv_layout"] == "staged"
    assert state["kv_pool_problems"] == [] and state["parked_requests"] == 0
