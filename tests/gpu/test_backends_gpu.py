"""UniPrefill on SGLang's FlashInfer and Triton backends, against torch_native on the GPU.

Skipped without CUDA. Run in a pytest process of its own:

    pytest tests/gpu/test_backends_gpu.py -x -q

The model is built at test time in a temporary folder (nothing is downloaded, no weights live in
the repo): a 6-layer Llama (hidden 1024, head_dim 128, GQA 8/2, so the shipped FlashInfer JIT
cache applies), a word-level tokenizer made with `tokenizers`, and seeded weights written as
safetensors. SGLang's `load_format="dummy"` is not used: its uniform(-1e-3, 1e-3) weights make
every attention contribution vanish below bf16 resolution in the residual stream, so any
attention view (right or wrong) would give the same tokens. Instead the weights are chosen so
that results are exact across kernels yet sensitive to which KV each layer sees:

* q_proj = k_proj = 0: every attention row is an exact causal mean of V. The UniPrefill block
  scores are then equal on every backend (selection is deterministic), and FlashInfer / Triton
  compute the mean in fp32 (no tile-order noise worth a token).
* embeddings live in the first half of the hidden dims, attention / MLP outputs write the
  second half, and lm_head reads only the second half: the logits come from the means of V
  over the KV each layer holds, so a wrong per-stage view changes the tokens.

Each engine configuration runs in a subprocess of its own, all of them concurrently (engine
start-up dominates the wall time), and writes its results as JSON; the tests compare them
(engine_harness.py; UNIPREFILL_GPU_TEST_LOG_DIR keeps the engines' logs). A workload stuck for WORKLOAD_TIMEOUT_S dumps the Python stacks of the engine and
its scheduler (SIGABRT + PYTHONFAULTHANDLER) into the log.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_harness import (  # noqa: E402
    EngineResults,
    cuda_device_count,
    log_dir_or,
    run_engines,
    idle_state,
    selected_engines,
)

VOCAB = 1024
HIDDEN = 1024
EMB_DIMS = 512  # embeddings: dims [0, 512); attention / MLP outputs: dims [512, 1024)
LAYERS = 6
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 128
INTERMEDIATE = 1024
DROP_LAYERS = "1,3"  # stages: layers 0-1, 2-3, 4-5

COMMON_ENGINE_KWARGS = dict(
    enable_uniprefill=True,
    uniprefill_min_prompt_tokens=0,  # correctness on short prompts: no cost rule
    uniprefill_keep_ratio=0.5,
    uniprefill_drop_layers=DROP_LAYERS,
    enable_mixed_chunk=True,
    dtype="bfloat16",
    context_length=4096,
    max_total_tokens=65536,
    max_running_requests=16,
    chunked_prefill_size=8192,
    cuda_graph_max_bs_decode=8,
    cuda_graph_max_bs_prefill=1024,  # token buckets up to 1024: the 700-1000 token prompts fit
    mem_fraction_static=0.5,
    random_seed=0,
    log_level="info",
)
ENGINES = {
    "torch_native": dict(attention_backend="torch_native"),  # the reference (no CUDA graphs)
    "flashinfer": dict(attention_backend="flashinfer"),  # decode + prefill CUDA graphs on
    "flashinfer_nograph": dict(attention_backend="flashinfer", disable_cuda_graph=True),
    "triton": dict(attention_backend="triton"),  # decode + prefill CUDA graphs on
    # Upstream's paged-only FlashInfer prefill (as under deterministic inference): the adapter's
    # fallback of one paged view per stage instead of ragged survivors + paged prefix.
    "flashinfer_paged": dict(attention_backend="flashinfer"),
    # The shared KV layout (the default under top-p): a sparse cached prefix read through views
    # inside the breakable prefill graph.
    "flashinfer_shared": dict(attention_backend="flashinfer", uniprefill_kv_layout="shared"),
    # Per-stage decode-graph lists of 1,024 entries: a decode batch of two or more prompts
    # outgrows them and decodes eagerly, a single request replays its graph.
    "flashinfer_small_lists": dict(attention_backend="flashinfer"),
    # FA3 prefill (backends/fa3.py) with FlashInfer decode, as server_args.py sets it, on both
    # KV layouts; and the backends SGLang picks itself (fa3 on Hopper).
    "fa3": dict(attention_backend="fa3"),
    "fa3_shared": dict(attention_backend="fa3", uniprefill_kv_layout="shared"),
    "sglang_default": dict(),
}
ENGINE_ENV = {"flashinfer_paged": {"SGLANG_FLASHINFER_USE_PAGED": "1"},
              "flashinfer_small_lists": {"UNIPREFILL_DECODE_GRAPH_ENTRIES": "1024"}}
GPU_BACKENDS = ["flashinfer", "flashinfer_nograph", "triton", "flashinfer_paged",
                "flashinfer_shared", "flashinfer_small_lists", "fa3", "fa3_shared",
                "sglang_default"]
GRAPH_BACKENDS = ["flashinfer", "triton", "flashinfer_paged", "flashinfer_shared",
                  "flashinfer_small_lists", "fa3", "fa3_shared"]
META = "uniprefill"
TIMEOUT_S = 360  # all engines, start-up included
WORKLOAD_TIMEOUT_S = 120


# ---- the model ---------------------------------------------------------------------------------
def build_model(folder: Path, seed: int = 0, qk_std: float = 0.0, max_positions: int = 4096) -> str:
    """qk_std > 0: random q/k projections instead of zeros, so attention (and the UniPrefill
    scores) depend on the tokens' content; kernels then agree only within bf16 noise."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "vocab_size": VOCAB,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1))

    g = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0):
        return torch.randn(*shape, generator=g) * std

    E, H = EMB_DIMS, HIDDEN
    w = {}
    emb = torch.zeros(VOCAB, H)
    e = randn(VOCAB, E)
    emb[:, :E] = e - e.mean(0)
    w["model.embed_tokens.weight"] = emb
    lm = torch.zeros(VOCAB, H)
    lm[:, E:] = randn(VOCAB, H - E, std=0.1)
    w["lm_head.weight"] = lm
    w["model.norm.weight"] = torch.ones(H)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(H)
        w[p + "post_attention_layernorm.weight"] = torch.ones(H)
        for name, rows in (("q_proj", HEADS * HEAD_DIM), ("k_proj", KV_HEADS * HEAD_DIM)):
            w[p + f"self_attn.{name}.weight"] = (
                randn(rows, H, std=qk_std) if qk_std else torch.zeros(rows, H))
        v = randn(KV_HEADS * HEAD_DIM, H, std=1 / math.sqrt(E))
        v[:, E:] *= 0.2  # V mostly token-specific, partly carrying earlier layers' outputs
        w[p + "self_attn.v_proj.weight"] = v
        o = torch.zeros(H, HEADS * HEAD_DIM)
        gain = 0.5 if i < 2 else 8.0  # the layers after the drops weigh most in the logits
        o[E:] = randn(H - E, HEADS * HEAD_DIM, std=gain / math.sqrt(HEADS * HEAD_DIM))
        w[p + "self_attn.o_proj.weight"] = o
        w[p + "mlp.gate_proj.weight"] = randn(INTERMEDIATE, H, std=1 / math.sqrt(H))
        w[p + "mlp.up_proj.weight"] = randn(INTERMEDIATE, H, std=1 / math.sqrt(H))
        down = torch.zeros(H, INTERMEDIATE)
        down[E:] = randn(H - E, INTERMEDIATE, std=0.5 / math.sqrt(INTERMEDIATE))
        w[p + "mlp.down_proj.weight"] = down
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in w.items()},
              str(folder / "model.safetensors"))

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "t0", "bos_token": "t1", "eos_token": "t2", "pad_token": "t0",
        "model_max_length": max_positions,
    }))
    (folder / "special_tokens_map.json").write_text(json.dumps({
        "unk_token": "t0", "bos_token": "t1", "eos_token": "t2", "pad_token": "t0",
    }))
    return str(folder)


# ---- the workload (identical for every engine) -------------------------------------------------
def _prompt(seed: int, n: int) -> list:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
BATCH = [_prompt(1, 700), _prompt(2, 900), _prompt(3, 1000), _prompt(4, 1500), _prompt(5, 40)]
SHORT = _prompt(54, 40)  # its greedy continuation has no near-tie (top-2 gap > 0.7)
DOC = _prompt(7, 1000)
QUESTIONS = [_prompt(8, 60), _prompt(9, 60)]


def _record(out) -> dict:
    meta = out["meta_info"]
    return {
        "output_ids": list(out["output_ids"]),
        "prompt_tokens": meta.get("prompt_tokens"),
        "cached_tokens": meta.get("cached_tokens"),
        "uniprefill": meta.get(META),
    }


def _flush(engine) -> None:
    """flush_cache refuses while a finished request is still being retired: retry."""
    for _ in range(200):
        out = engine.flush_cache()
        if getattr(out, "success", True):
            return
        time.sleep(0.05)
    raise RuntimeError("flush_cache kept failing")


def run_scenarios(engine) -> dict:
    res = {"errors": {}}
    try:
        _run_scenarios(engine, res)
    except Exception:  # keep what ran; the tests report the rest
        import traceback

        res["errors"]["workload"] = traceback.format_exc()[-3000:]
        print(res["errors"]["workload"], flush=True)
    return res


def _run_scenarios(engine, res: dict) -> None:
    print("workload: start", flush=True)
    # A batch of long prompts (dropping) and a short one (dense): prefill together, then decode.
    res["batch"] = [_record(o) for o in engine.generate(input_ids=BATCH, sampling_params=GREEDY)]
    _flush(engine)
    print("workload: batch done", flush=True)
    # Single requests: one that drops but fits a prefill CUDA-graph bucket, a dense short one.
    res["solo"] = _record(engine.generate(input_ids=BATCH[1], sampling_params=GREEDY))
    _flush(engine)
    res["short"] = _record(engine.generate(input_ids=SHORT, sampling_params=GREEDY))
    _flush(engine)
    # Keep ratio 1.0 (enabled, nothing dropped) against the request switched off.
    res["ratio_one"] = _record(engine.generate(
        input_ids=BATCH[0],
        sampling_params=dict(GREEDY, custom_params={"uniprefill_keep_ratio": 1.0})))
    _flush(engine)
    res["disabled"] = _record(engine.generate(
        input_ids=BATCH[0], sampling_params=dict(GREEDY, custom_params={"uniprefill": False})))
    _flush(engine)
    # Radix reuse: the second request's cached prefix holds sparse KV.
    res["radix"] = [
        _record(engine.generate(input_ids=DOC + q, sampling_params=GREEDY)) for q in QUESTIONS
    ]
    _flush(engine)
    print("workload: single requests done", flush=True)
    # Mixed batch: a long prefill arrives while a short request decodes.
    decode_params = dict(GREEDY, max_new_tokens=32)
    res["alone_short"] = _record(engine.generate(input_ids=SHORT, sampling_params=decode_params))
    _flush(engine)
    res["alone_long"] = _record(engine.generate(input_ids=BATCH[2], sampling_params=GREEDY))
    _flush(engine)

    async def together():
        stream = await engine.async_generate(input_ids=SHORT, sampling_params=decode_params,
                                             stream=True)
        chunks = [await stream.__anext__()]  # the short request is decoding now
        long_task = asyncio.ensure_future(
            engine.async_generate(input_ids=BATCH[2], sampling_params=GREEDY))
        async for chunk in stream:
            chunks.append(chunk)
        return chunks, await long_task

    chunks, long_out = engine.loop.run_until_complete(together())  # the engine's own loop
    short_ids = list(chunks[-1]["output_ids"])
    if len(short_ids) < decode_params["max_new_tokens"]:  # incremental streaming output
        short_ids = [t for c in chunks for t in c["output_ids"]]
    res["mixed_short"] = dict(_record(chunks[-1]), output_ids=short_ids)
    res["mixed_long"] = _record(long_out)
    _flush(engine)
    res["state"] = idle_state(engine)


def run_engine(name: str, model_dir: str, out_path: str) -> None:
    """Subprocess entry point: start one engine, run the workload, write the results."""
    from importlib.metadata import entry_points

    import sglang

    print("engine", name, sys.executable, "plugins:",
          [ep.value for ep in entry_points(group="sglang.srt.plugins")], flush=True)
    # A stuck workload dumps the Python stacks of this process and of the engine's children
    # (PYTHONFAULTHANDLER makes SIGABRT print them) instead of just timing out.
    os.environ["PYTHONFAULTHANDLER"] = "1"
    os.environ.update(ENGINE_ENV.get(name, {}))  # before the engine's processes start
    port = 31000 + 50 * list(ENGINES).index(name)
    engine = sglang.Engine(model_path=model_dir, port=port, **COMMON_ENGINE_KWARGS,
                           **ENGINES[name])
    done = threading.Event()

    def watchdog():
        if done.wait(WORKLOAD_TIMEOUT_S):
            return
        import faulthandler
        import signal

        import psutil

        print(f"WATCHDOG: workload of {name} stuck for {WORKLOAD_TIMEOUT_S} s", flush=True)
        faulthandler.dump_traceback(all_threads=True)
        for child in psutil.Process().children(recursive=True):
            try:
                os.kill(child.pid, signal.SIGABRT)
            except OSError:
                pass
        time.sleep(5)
        os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        t0 = time.time()
        res = run_scenarios(engine)
        done.set()
        res["workload_s"] = time.time() - t0
    finally:
        engine.shutdown()
    Path(out_path).write_text(json.dumps(res))


# ---- pytest side -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def results():
    if cuda_device_count() < 1:
        pytest.skip("CUDA not available")
    with tempfile.TemporaryDirectory(prefix="uniprefill-gpu-") as tmp:
        tmp = Path(tmp)
        model_dir = build_model(tmp / "model")
        names, skipped = selected_engines(ENGINES)
        out, failed = run_engines(__file__, names, model_dir, tmp, log_dir_or(tmp), TIMEOUT_S,
                                  prefix="engine_")
        print("workload s: %s" % {n: round(r["workload_s"], 1) for n, r in out.items()})
        yield EngineResults(out, failed, skipped)


def _outputs(res: dict) -> dict:
    """Every request of the workload, by a stable name."""
    flat = {f"batch{i}": r for i, r in enumerate(res["batch"])}
    flat.update({f"radix{i}": r for i, r in enumerate(res["radix"])})
    for key in ("solo", "short", "ratio_one", "disabled", "alone_short", "alone_long",
                "mixed_short", "mixed_long"):
        flat[key] = res[key]
    return flat


def _kept(rec) -> list:
    entries = rec["uniprefill"]
    assert entries, rec
    return entries[0]["kept_tokens"]


def _first_meta(rec):
    return (rec["uniprefill"] or [None])[0]


def test_reference_drops_tokens(results):
    ref = results["torch_native"]
    for rec in ref["batch"][:4]:
        kept = _kept(rec)
        assert kept[0] == rec["prompt_tokens"]
        assert len(kept) == 3 and kept[0] > kept[1] > kept[2], kept
    assert _kept(ref["batch"][4]) == [40, 40, 40]  # the short request runs dense
    assert ref["radix"][1]["cached_tokens"] >= len(DOC), ref["radix"][1]


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_matches_torch_native(results, backend):
    """Same kept counts and cached prefixes as the reference; same tokens.

    torch_native's masked SDPA rounds softmax weights to bf16 (up to 2^-9 relative), the GPU
    kernels keep them exact: a near-tie could in principle flip one later token, so the
    continuation of at most one request may diverge, never its first token.
    """
    ref, got = _outputs(results["torch_native"]), _outputs(results[backend])
    diverged = []
    for name, r in ref.items():
        g = got[name]
        assert g["prompt_tokens"] == r["prompt_tokens"], name
        if name not in ("mixed_short", "mixed_long"):  # batch composition depends on timing
            assert g["cached_tokens"] == r["cached_tokens"], (name, g, r)
        rm, gm = _first_meta(r), _first_meta(g)
        if rm is not None and (rm["enabled"] or gm is not None):
            assert gm is not None and gm["kept_tokens"] == rm["kept_tokens"], (name, g, r)
        assert g["output_ids"][0] == r["output_ids"][0], (name, g["output_ids"], r["output_ids"])
        if g["output_ids"] != r["output_ids"]:
            diverged.append((name, g["output_ids"], r["output_ids"]))
    assert len(diverged) <= 1, diverged


def test_flashinfer_and_triton_agree(results):
    a, b = _outputs(results["flashinfer"]), _outputs(results["triton"])
    for name in a:
        assert a[name]["output_ids"] == b[name]["output_ids"], name


def test_cuda_graphs_on_off_identical(results):
    on, off = _outputs(results["flashinfer"]), _outputs(results["flashinfer_nograph"])
    for name in on:
        assert on[name]["output_ids"] == off[name]["output_ids"], name
        a, b = _first_meta(on[name]), _first_meta(off[name])
        if a is not None and b is not None:
            assert a["kept_tokens"] == b["kept_tokens"], name


@pytest.mark.parametrize("backend", ["torch_native"] + GPU_BACKENDS)
def test_keep_ratio_one_equals_dense(results, backend):
    res = results[backend]
    kept = _kept(res["ratio_one"])
    assert kept == [len(BATCH[0])] * 3, kept
    meta = _first_meta(res["disabled"])  # served by the prefill CUDA graph on graph engines
    assert meta is None or meta["enabled"] is False
    assert res["ratio_one"]["output_ids"] == res["disabled"]["output_ids"]


@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
def test_prefill_graph_batch_reports_uniprefill_meta(results, backend):
    """A dense batch replayed by the prefill CUDA graph still reports its decisions
    (patches/cuda_graphs.py keeps `customized_info` through the runner's output trim)."""
    meta = _first_meta(results[backend]["short"])
    assert meta is not None and meta["enabled"] is False and meta["kept_tokens"] == [40]


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_prefill_graph_runs_every_step_that_moves_no_row(results, backend):
    """The prefill CUDA graph replays every step whose drop layers have nothing to do, under
    either KV layout: a dense short prompt, and a follow-up over a cached document that was
    dropped from (its later layers read the sparse prefix through per-stage views, planned in
    the graph's eager attention breaks). A step that drops runs eagerly. Outputs are compared
    with torch_native and with the graph-less engine in test_matches_torch_native."""
    res = results[backend]
    assert _first_meta(res["short"])["prefill_cuda_graph"] is True
    assert _first_meta(res["solo"])["prefill_cuda_graph"] is False  # it drops (fits a bucket)
    follow_up = res["radix"][1]
    assert follow_up["cached_tokens"] >= len(DOC)
    assert _first_meta(follow_up)["prefill_cuda_graph"] is True
    assert "prefill_cuda_graph" not in _first_meta(results["flashinfer_nograph"]["short"])


@pytest.mark.parametrize("backend", ["torch_native"] + GPU_BACKENDS)
def test_mixed_batch_matches_each_alone(results, backend):
    # The long prompt arrives while the short request decodes (64 steps): with
    # enable_mixed_chunk its prefill runs in a MIXED batch next to that decode. SGLang does not
    # report the batch composition per request, so only the outcome is checked here.
    res = results[backend]
    assert _kept(res["mixed_long"]) == _kept(res["alone_long"])
    assert res["mixed_long"]["output_ids"] == res["alone_long"]["output_ids"]
    assert res["mixed_short"]["output_ids"] == res["alone_short"]["output_ids"]


@pytest.mark.parametrize("backend", ["torch_native"] + GPU_BACKENDS)
def test_decode_after_drop_and_radix_reuse(results, backend):
    res = results[backend]
    first, second = res["radix"]
    assert _kept(first)[-1] < _kept(first)[0]  # the document was dropped from
    assert second["cached_tokens"] >= len(DOC)
    # 60 new tokens, and nothing to re-select (no prefix checkpoint by default): the follow-up
    # runs as stock SGLang, saying why.
    assert _kept(second) == [len(QUESTIONS[1])]
    assert second["uniprefill"][0]["reason"] == "prompt under the minimum length"
    assert all(len(r["output_ids"]) == GREEDY["max_new_tokens"] for r in res["batch"])


@pytest.mark.parametrize("backend", [b for b in GPU_BACKENDS if b.startswith("flashinfer")])
def test_flashinfer_views_made_at_start_up(results, backend):
    """Every FlashInfer wrapper the workload's views ran (extend views of each kind the
    configuration uses, eager decode views) was made at start-up, none in a request's path:
    each holds 8 MiB of device and 8 MiB of pinned host workspace to allocate."""
    assert results[backend]["state"]["views_allocated_late"] == 0


def test_decode_batches_past_the_graph_lists_run_eagerly_alike(results):
    """The per-stage decode-graph lists are sized to the KV pool (backends/common.py
    `decode_graph_entries`); a batch holding more entries decodes eagerly, with the graphs'
    tokens."""
    small, full = results["flashinfer_small_lists"], results["flashinfer"]
    assert small["state"]["eager_decode_overflows"] > 0
    assert full["state"]["eager_decode_overflows"] == 0
    a, b = _outputs(small), _outputs(full)
    for name in a:
        assert a[name]["output_ids"] == b[name]["output_ids"], name


if __name__ == "__main__":
    run_engine(*sys.argv[1:4])
