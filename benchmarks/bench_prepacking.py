"""Prepacking against padding, length-ordered batches and SGLang, measured as the Prepacking paper did.

Prepacking (Zhao et al., 2024, arXiv:2404.09529; its repository's ``profiling_time_and_memory.py``)
times batches of prompts drawn from a dataset, per batch, in Hugging Face transformers, three ways:
padding each batch to its longest prompt ("full-batching"), batches of consecutive prompts of the
length-sorted dataset ("length-ordered"), and Prepacking. It reports the mean time per batch of
two metrics and the peak GPU memory (``torch.cuda.max_memory_allocated``, weights included) over
the batches. This script does the same on token ids it generates, and adds SGLang.

Methods (one run, same model shape, same prompts):

  hf_padded     HF, random batches, each padded to its longest prompt (left padding, as
                ``generate`` needs).
  hf_lenorder   HF, the pool sorted by length and cut into consecutive batches, padded (left).
  hf_packed     HF, random batches (the same as hf_padded), Prepacking
                (``uniprefill_sglang/tools/prepacking.py``): first-fit-decreasing rows as wide as
                the longest prompt, block-diagonal causal 4D mask, positions restarting per prompt.
  sglang_dense  SGLang's ragged prefill: each batch as one ``engine.generate(input_ids=[...],
                max_new_tokens=1)`` call, UniPrefill off per request.
  sglang_uniprefill  The same engine and batches with UniPrefill on (keep schedule
                ``--keep-ratio``, default 0.5,0.8 with random weights; prompts shorter than
                ``--uniprefill-min-prompt-tokens``, default 1024, run dense).

Metrics (the paper's two):

  prefill  One forward over the batch that builds every prompt's KV cache (``use_cache=True``)
           and the last position's logits. (The paper's prefill profile kept HF's default logits
           at every position; we compute the last position only, as ``generate`` does, so its
           padded memory is larger than ours by batch x width x vocab logits.)
  ttft     Time to first token as the paper defines it. Padded and length-ordered: one forward
           over the left-padded batch keeping the cache, first token = argmax of the last
           position (``generate(max_new_tokens=1)``). Prepacking: packed prefill of every prompt
           but its last token, unpack the KV into the left-padded cache, one step over the last
           tokens, argmax. SGLang: the ``generate`` call (scheduling, prefill, first token), which
           is also the only SGLang time reported (it has no separate prefill figure here).

The tokenisation is not timed (ids are generated); building the padded or packed tensors, the 4D
mask included, is. GPU timings are bracketed by ``torch.cuda.synchronize()``. Each method is
warmed up on the pool's shortest batch, then every batch of the pool is run ``--repeats`` times;
the mean per batch is reported (and the median of the per-pass means). As in the paper, the
CUDA cache is emptied before every batch, so allocation is inside the timed span.

Memory: HF on CUDA: ``torch.cuda.max_memory_allocated`` over each batch, weights included (as the
paper), and the same above the weights. HF on CPU: peak RSS above the RSS before the batch.
SGLang preallocates its memory: weights and a KV pool sized by ``--mem-fraction-static``; the
batch runs inside it or waits (it never fails for memory), so its figure is that pool, from
SGLang's own ``memory_usage``.

Largest batch before OOM (CUDA, the ``--sweep-profile`` only): after the timed batch sizes, one
batch of 2x, 4x, ... prompts of the same profile per HF method and metric until it runs out of
memory or reaches ``--oom-cap`` prompts. hf_lenorder is not in that search: with one batch, the
sorted pool is the padded batch.

Length profiles (``PROFILES``; lengths in tokens, drawn with ``random.Random(seed)``, token ids
uniform in [100, vocab - 100) from ``torch.Generator``). They stand in for the paper's datasets'
shapes; they are not measured from those datasets:

  mmlu      short instruction prompts: lognormal, median 50, sigma 0.9, clipped to [8, 2048]
  wiki256   wiki chunks: 30% headings uniform in [4, 16], else lognormal median 160, sigma 0.7;
            truncated at 256 (as the paper's wikitext256)
  wiki512   the same, truncated at 512
  dialogue  long-tailed dialogue (like hh-rlhf, samsum): lognormal median 220, sigma 1.0,
            clipped to [16, 4000]
  long      long prompts: log-uniform in [1024, 32768]

CPU smoke run (SmolLM2-135M, seconds of HF and one SGLang CPU engine start):

    python benchmarks/bench_prepacking.py --device cpu --profiles mmlu --pool 8 --batch-size 4 \\
        --max-len 64 --out /tmp/prepacking_smoke.json

GPU (one H200; random bf16 weights from config.json, SGLang's dummy weights):

    python benchmarks/bench_prepacking.py --device cuda \\
        --model-path benchmarks/models/sheared-llama-1.3b
    python benchmarks/bench_prepacking.py --device cuda --model-path benchmarks/models/llama-3.1-8b \\
        --profiles long --pool 16 --batch-size 16 --sweep-profile none
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result_header import result_header  # noqa: E402

HF_METHODS = ("hf_padded", "hf_lenorder", "hf_packed")
SG_METHODS = ("sglang_dense", "sglang_uniprefill")
METHODS = HF_METHODS + SG_METHODS
METRICS = ("prefill", "ttft")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def batch_timing(passes: list, num_batches: int, batch_size: int) -> dict:
    """Seconds per batch over repeated passes (`passes[r][i]`: pass r, batch i)."""
    means = [statistics.mean(p) for p in passes]
    return {"num_batches": num_batches, "batch_size": batch_size,
            "mean_s_per_batch": statistics.mean([t for p in passes for t in p]),
            "median_of_pass_means_s": statistics.median(means),
            "pass_means_s": means, "batch_s_first_pass": passes[0]}


# ------------------------------------------------------------------------------- workload


def _clip(x: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(x))))


def _wiki(rng: random.Random, cut: int) -> int:
    if rng.random() < 0.3:
        return rng.randint(4, 16)
    return _clip(rng.lognormvariate(math.log(160), 0.7), 4, cut)


PROFILES = {
    "mmlu": ("short instruction prompts: lognormal median 50, sigma 0.9, clipped to [8, 2048]",
             lambda rng: _clip(rng.lognormvariate(math.log(50), 0.9), 8, 2048)),
    "wiki256": ("wiki chunks: 30% headings U[4,16], else lognormal median 160, sigma 0.7; "
                "truncated at 256", lambda rng: _wiki(rng, 256)),
    "wiki512": ("wiki chunks: 30% headings U[4,16], else lognormal median 160, sigma 0.7; "
                "truncated at 512", lambda rng: _wiki(rng, 512)),
    "dialogue": ("long-tailed dialogue: lognormal median 220, sigma 1.0, clipped to [16, 4000]",
                 lambda rng: _clip(rng.lognormvariate(math.log(220), 1.0), 16, 4000)),
    "long": ("long prompts: log-uniform in [1024, 32768]",
             lambda rng: _clip(math.exp(rng.uniform(math.log(1024), math.log(32768))),
                               1024, 32768)),
}


def make_pool(profile: str, n: int, vocab: int, seed: int, max_len: int | None = None):
    """``n`` prompts (token-id lists) of the profile; deterministic; prefix-stable in ``n``."""
    rng = random.Random(f"{profile}-{seed}")
    lengths = [PROFILES[profile][1](rng) for _ in range(n)]
    if max_len:
        lengths = [max(2, min(max_len, x)) for x in lengths]
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab - 100, (x,), generator=g).tolist() for x in lengths]


def random_batches(pool, b: int, seed: int):
    order = list(range(len(pool)))
    random.Random(seed).shuffle(order)
    return [[pool[i] for i in order[j:j + b]] for j in range(0, len(pool), b)]


def sorted_batches(pool, b: int):
    srt = sorted(pool, key=len)
    return [srt[j:j + b] for j in range(0, len(srt), b)]


def layout(batches) -> dict:
    """Tokens computed by padding and by packing, summed over the batches."""
    from uniprefill_sglang.tools.prepacking import first_fit_decreasing

    real = padded = packed = 0
    for bt in batches:
        lens = [len(p) for p in bt]
        real += sum(lens)
        padded += len(lens) * max(lens)
        bins = first_fit_decreasing(lens, max(lens))
        packed += len(bins) * max(sum(lens[i] for i in b) for b in bins)
    return {"real_tokens": real, "padded_tokens": padded, "packed_tokens": packed,
            "padded_over_real": padded / real, "packed_over_real": packed / real}


# ------------------------------------------------------------------------------- memory probes


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


class RssPeak:
    """Peak RSS of this process above its RSS at entry, in MiB (Linux)."""

    def __enter__(self):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        self.start = _status_kib("VmRSS")
        return self

    def __exit__(self, *exc):
        self.delta_mib = (_status_kib("VmHWM") - self.start) / 1024
        return False


# ------------------------------------------------------------------------------- HF side


def load_hf_model(model_path: str, device: str, dtype: torch.dtype, random_weights: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    if random_weights:
        cfg = AutoConfig.from_pretrained(model_path)
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    else:
        model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype, attn_implementation="sdpa").to(device)
    return model.eval()


def run_hf(model, method: str, metric: str, prompts, device: str, dtype: torch.dtype):
    """Last-position (prefill) or first-step (ttft) logits of one batch."""
    from uniprefill_sglang.tools import prepacking as pp

    if method == "hf_packed":
        if metric == "ttft":
            return pp.ttft_packed(model, prompts, dtype=dtype, device=device)
        batch = pp.build_packed_batch(prompts, dtype=dtype, device=device)
        logits, cache = pp.prefill_packed(model, batch, use_cache=True)
        del cache
        return logits
    if metric == "ttft":
        return pp.ttft_padded(model, prompts, device=device)
    batch = pp.build_padded_batch(prompts, device=device, side="left")
    logits, cache = pp.prefill_padded(model, batch, use_cache=True)
    del cache
    return logits


def _is_oom(e: BaseException) -> bool:
    msg = str(e).lower()
    return (isinstance(e, torch.OutOfMemoryError) or "out of memory" in msg
            or "alloc_failed" in msg)


def measure_hf(model, method, metric, prompts, device, dtype, weights_bytes):
    """One batch: dict(s, peak_mib, above_weights_mib) and the logits; or ({"oom": True}, None)."""
    if device == "cuda":
        torch.cuda.empty_cache()  # as the paper, before every batch
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        oom = False
        try:
            logits = run_hf(model, method, metric, prompts, device, dtype)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - OOM is a result; anything else is re-raised
            if not _is_oom(e):
                raise
            oom = True  # free the memory outside the handler, once the traceback is gone
        if oom:
            gc.collect()
            torch.cuda.empty_cache()
            return {"oom": True}, None
        dt = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated()
        return {"s": dt, "peak_mib": peak / 2**20,
                "above_weights_mib": (peak - base) / 2**20}, logits
    gc.collect()
    with RssPeak() as probe:
        t0 = time.perf_counter()
        logits = run_hf(model, method, metric, prompts, device, dtype)
        dt = time.perf_counter() - t0
    return {"s": dt, "peak_mib": None, "above_weights_mib": probe.delta_mib}, logits


def hf_batches(method: str, pool, b: int, seed: int):
    return sorted_batches(pool, b) if method == "hf_lenorder" else random_batches(pool, b, seed)


def time_hf(model, method, metric, pool, b, args, dtype, weights_bytes, log, keep_logits):
    """Warm-up on one batch, then every batch of the pool ``repeats`` times.

    Returns the entry and, with ``keep_logits``, the first pass's logits (CPU, per batch).
    """
    batches = hf_batches(method, pool, b, args.seed)
    gc.collect()
    # Warm-up on the shortest batch of the pool (the one-time costs, cheaply).
    first, _ = measure_hf(model, method, metric, sorted_batches(pool, b)[0], args.device, dtype,
                          weights_bytes)
    if first.get("oom"):
        return {"oom": True, "oom_at": "warm-up batch"}, None
    passes, peaks, above = [], [], []
    logits = None
    for r in range(args.repeats):
        per_batch = []
        for bi, bt in enumerate(batches):
            m, lg = measure_hf(model, method, metric, bt, args.device, dtype, weights_bytes)
            if m.get("oom"):
                return {"oom": True, "oom_at": f"pass {r} batch {bi}"}, None
            per_batch.append(m["s"])
            peaks.append(m["peak_mib"])
            above.append(m["above_weights_mib"])
            if r == 0:
                assert torch.isfinite(lg).all(), f"{method} {metric}: non-finite logits"
                if keep_logits:
                    logits = (logits or []) + [lg.float().cpu()]
            del lg
        passes.append(per_batch)
    entry = {
        **batch_timing(passes, len(batches), b),
        "peak_mib": max(peaks) if peaks[0] is not None else None,
        "above_weights_mib": max(above),
    }
    log(f"    {method:12s} {metric:7s} B={b:5d}: {entry['mean_s_per_batch'] * 1e3:9.1f} ms/batch, "
        + (f"peak {entry['peak_mib']:9.0f} MiB" if entry["peak_mib"] is not None else "")
        + f" (+{entry['above_weights_mib']:.0f} MiB over weights)")
    return entry, logits


# ------------------------------------------------------------------------------- SGLang side


def start_engine(args, random_weights: bool, max_batch_tokens: int, max_batch: int,
                 max_len: int, model_max_pos: int):
    os.environ.setdefault("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "1")
    common = dict(
        enable_uniprefill=True,
        disable_radix_cache=True,
        skip_tokenizer_init=True,  # token ids in and out; the model folders hold no tokenizer
        uniprefill_min_prompt_tokens=args.uniprefill_min_prompt_tokens,
        # Room for a whole batch in one prefill step, like the HF single forward.
        max_prefill_tokens=max(16384, max_batch_tokens + 64),
        max_running_requests=max(16, max_batch),
        random_seed=0,
        log_level="error",
    )
    if random_weights:
        common["load_format"] = "dummy"
    if args.device == "cpu":
        from uniprefill_sglang.tools.cpu_engine import make_cpu_engine

        return make_cpu_engine(args.model_path, mem_fraction_static=args.mem_fraction_static,
                               chunked_prefill_size=common["max_prefill_tokens"], **common)
    import sglang

    return sglang.Engine(
        model_path=args.model_path,
        dtype="bfloat16",
        attention_backend=args.attention_backend,
        mem_fraction_static=args.mem_fraction_static,
        chunked_prefill_size=-1,
        context_length=max(model_max_pos, max_len + 64),
        cuda_graph_backend_prefill="disabled",
        disable_cuda_graph=True,  # max_new_tokens=1: no decode step to graph; starts faster
        **common,
    )


def sglang_custom(method: str, keep_ratio: str | None) -> dict:
    if method == "sglang_dense":
        return {"uniprefill": False}
    return {"uniprefill_keep_ratio": keep_ratio} if keep_ratio else {}


def run_sglang(engine, prompts, custom: dict):
    return engine.generate(
        input_ids=prompts,
        sampling_params={"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True,
                         "custom_params": custom},
    )


def kept_summary(outs, lengths, min_tokens) -> dict:
    """How many prompts dropped, and the token-weighted kept fraction after the last drop."""
    metas = [(o.get("meta_info") or {}).get("uniprefill", [{}]) for o in outs]
    metas = [m[-1] if isinstance(m, list) and m else (m or {}) for m in metas]
    enabled = [bool(m.get("enabled")) for m in metas]
    kept_last = [m["kept_tokens"][-1] if m.get("kept_tokens") else n
                 for m, n in zip(metas, lengths)]
    return {"num_dropped": sum(enabled), "num_prompts": len(lengths),
            "num_at_least_min": sum(n >= min_tokens for n in lengths),
            "kept_fraction_all": sum(kept_last) / sum(lengths)}


def time_sglang(engine, method, pool, b, args, keep_ratio, log):
    batches = random_batches(pool, b, args.seed)
    custom = sglang_custom(method, keep_ratio)
    run_sglang(engine, sorted_batches(pool, b)[0], custom)  # warm-up: the shortest batch
    passes, kept = [], []
    for r in range(args.repeats):
        per_batch = []
        for bt in batches:
            t = time.perf_counter()
            outs = run_sglang(engine, bt, custom)
            per_batch.append(time.perf_counter() - t)
            if r == 0:
                kept.append(kept_summary(outs, [len(p) for p in bt],
                                         args.uniprefill_min_prompt_tokens))
        passes.append(per_batch)
    entry = {
        **batch_timing(passes, len(batches), b),
        "num_dropped": sum(k["num_dropped"] for k in kept),
        "num_at_least_min_tokens": sum(k["num_at_least_min"] for k in kept),
        "kept_fraction_all_tokens": (sum(k["kept_fraction_all"] * len(bt)
                                         for k, bt in zip(kept, batches)) / len(pool)),
    }
    log(f"    {method:17s} ttft    B={b:5d}: {entry['mean_s_per_batch'] * 1e3:9.1f} ms/batch"
        + (f", {entry['num_dropped']} prompts dropped" if method == "sglang_uniprefill" else ""))
    return entry


# ------------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--model-path", default=None,
                    help="HF folder; default on CPU: SmolLM2-135M-Instruct (model_zoo)")
    ap.add_argument("--random-weights", choices=["auto", "yes", "no"], default="auto",
                    help="auto: yes when the folder holds no weight files (config.json only)")
    ap.add_argument("--profiles", default="mmlu,wiki256,wiki512,dialogue",
                    help=f"comma list of {','.join(PROFILES)}")
    ap.add_argument("--pool", type=int, default=None,
                    help="prompts per profile (the paper: 1000); default 512 on CUDA, 8 on CPU")
    ap.add_argument("--batch-size", type=int, default=None, help="default 64 on CUDA, 4 on CPU")
    ap.add_argument("--sweep-profile", default="mmlu",
                    help="profile timed at every --sweep-sizes and searched for OOM; 'none'")
    ap.add_argument("--sweep-sizes", default="16,32,64,128,256,512",
                    help="batch sizes timed on the sweep profile (at most --pool)")
    ap.add_argument("--oom-cap", type=int, default=32768,
                    help="largest batch tried in the OOM search (CUDA)")
    ap.add_argument("--max-len", type=int, default=None, help="clip prompt lengths (smoke runs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--uniprefill-min-prompt-tokens", type=int, default=1024)
    ap.add_argument("--keep-ratio", default=None,
                    help="UniPrefill keep-ratio schedule; 'none' = top-p. Default: 0.5,0.8 with "
                         "random weights, top-p with real weights")
    ap.add_argument("--attention-backend", default="flashinfer", help="CUDA only")
    ap.add_argument("--mem-fraction-static", type=float, default=None,
                    help="SGLang's; default 0.8 on CUDA, 0.95 on CPU")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    if args.device == "cpu":
        # Before anything imports sglang (SGLang's CPU engine reads it at import).
        from uniprefill_sglang.tools.cpu_engine import activate_cpu_engine_env

        activate_cpu_engine_env()
        if args.model_path is None:
            from uniprefill_sglang.tools.model_zoo import prepare_smollm2

            args.model_path = prepare_smollm2()
    elif args.model_path is None:
        ap.error("--model-path is required with --device cuda")
    for m in [m for m in args.methods.split(",") if m]:
        if m not in METHODS:
            ap.error(f"unknown method {m}")
    for p in [p for p in args.profiles.split(",") if p]:
        if p not in PROFILES:
            ap.error(f"unknown profile {p}")
    return args


class PrepackingRun:
    """One invocation: its settings (from the flags and the model folder), the prompt pools,
    the result (written after every measurement) and the log lines the result keeps."""

    def __init__(self, args):
        self.args = args
        self.methods = [m for m in args.methods.split(",") if m]
        self.profiles = [p for p in args.profiles.split(",") if p]
        self.cuda = args.device == "cuda"
        self.pool_n = args.pool or (512 if self.cuda else 8)
        self.bsz = args.batch_size or (64 if self.cuda else 4)
        self.sweep_profile = args.sweep_profile if args.sweep_profile in self.profiles else None
        sweep_sizes = sorted({int(x) for x in args.sweep_sizes.split(",") if x} | {self.bsz})
        self.sweep_sizes = [b for b in sweep_sizes if b <= self.pool_n]
        folder = Path(args.model_path)
        self.random_weights = {"yes": True, "no": False}.get(args.random_weights)
        if self.random_weights is None:
            self.random_weights = not any(p.name.endswith(WEIGHT_SUFFIXES)
                                          for p in folder.iterdir())
        self.keep_ratio = args.keep_ratio
        if self.keep_ratio is None:
            self.keep_ratio = "0.5,0.8" if self.random_weights else None
        elif self.keep_ratio.lower() == "none":
            self.keep_ratio = None
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        if args.mem_fraction_static is None:
            args.mem_fraction_static = 0.8 if self.cuda else 0.95
        self.cfg = json.loads((folder / "config.json").read_text())
        self.name = folder.name
        self.out_path = Path(args.out or f"benchmarks/results/prepacking/prepacking_{self.name}_"
                             f"{args.device}_{'-'.join(self.profiles)}.json")
        self.log_lines: list[str] = []
        self.pools = {p: make_pool(p, self.pool_n, self.cfg["vocab_size"], args.seed,
                                   args.max_len) for p in self.profiles}
        self.sizes_of = {p: (self.sweep_sizes if p == self.sweep_profile else [self.bsz])
                         for p in self.profiles}
        self.result = self.result_head()

    def result_head(self) -> dict:
        """The result's settings; the profiles' measurements are added as they are made."""
        args, cuda = self.args, self.cuda
        return {
            "header": result_header(model=f"{self.name} shape ("
                                    f"{'random' if self.random_weights else 'real'} "
                                    f"weights, {str(self.dtype).replace('torch.', '')})"),
            "device": args.device,
            "device_name": torch.cuda.get_device_name() if cuda else "cpu",
            "device_memory_gib": (torch.cuda.get_device_properties(0).total_memory / 2**30
                                  if cuda else None),
            "versions": {"torch": torch.__version__,
                         "transformers": __import__("transformers").__version__},
            "model_path": str(args.model_path),
            "model": {k: self.cfg.get(k) for k in (
                "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size", "vocab_size",
                "max_position_embeddings")},
            "random_weights": self.random_weights,
            "dtype": str(self.dtype).replace("torch.", ""),
            "settings": {"pool": self.pool_n, "batch_size": self.bsz,
                         "sweep_profile": self.sweep_profile, "sweep_sizes": self.sweep_sizes,
                         "oom_cap": args.oom_cap, "repeats": args.repeats, "seed": args.seed,
                         "max_len": args.max_len, "methods": self.methods,
                         "metrics": list(METRICS),
                         "uniprefill_min_prompt_tokens": args.uniprefill_min_prompt_tokens,
                         "keep_ratio": self.keep_ratio or "top-p (server default)",
                         "attention_backend": args.attention_backend if cuda else "torch_native",
                         "mem_fraction_static": args.mem_fraction_static},
            "profiles": {},
        }

    def log(self, msg: str) -> None:
        print(msg, flush=True)
        self.log_lines.append(msg)

    def save(self) -> None:
        self.out_path.parent.mkdir(parents=True, exist_ok=True)
        self.result["log"] = self.log_lines
        self.out_path.write_text(json.dumps(self.result, indent=1))


def describe_profiles(run: PrepackingRun) -> None:
    """Each profile's lengths and how padding and packing lay out its batches."""
    for p in run.profiles:
        lens = [len(x) for x in run.pools[p]]
        run.result["profiles"][p] = {
            "distribution": PROFILES[p][0],
            "lengths": {"n": len(lens), "min": min(lens), "max": max(lens),
                        "mean": statistics.mean(lens), "median": statistics.median(lens),
                        "p90": sorted(lens)[int(0.9 * (len(lens) - 1))], "all": lens},
            "layout": {str(b): {"random": layout(random_batches(run.pools[p], b, run.args.seed)),
                                "length_ordered": layout(sorted_batches(run.pools[p], b))}
                       for b in run.sizes_of[p]},
            "hf": {}, "sglang": {}, "oom_search": {}, "checks": {},
        }
        lo = run.result["profiles"][p]["layout"][str(run.bsz)]
        run.log(f"{p}: {len(lens)} prompts, mean {statistics.mean(lens):.0f}, max {max(lens)}; "
                f"B={run.bsz}: padded/real {lo['random']['padded_over_real']:.2f}, "
                f"length-ordered {lo['length_ordered']['padded_over_real']:.2f}, "
                f"packed {lo['random']['packed_over_real']:.2f}")
    run.save()


# ------------------------------------------------------------------------------- main: HF


def hf_side(run: PrepackingRun) -> None:
    """Every HF method and metric on every profile; on CUDA the sweep profile's OOM search."""
    hf_methods = [m for m in run.methods if m in HF_METHODS]
    if not hf_methods:
        return
    t0 = time.perf_counter()
    model = load_hf_model(run.args.model_path, run.args.device, run.dtype, run.random_weights)
    weights_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    run.result["hf_weights_mib"] = weights_bytes / 2**20
    run.log(f"HF model ready in {time.perf_counter() - t0:.1f} s "
            f"({weights_bytes / 2**20:.0f} MiB of weights)")
    for p in run.profiles:
        run.log(f"  [{p}]")
        res = run.result["profiles"][p]
        oomed: set[tuple[str, str]] = set()
        for b in run.sizes_of[p]:
            logits = time_hf_batch_size(run, model, hf_methods, p, b, weights_bytes, oomed)
            if b == run.bsz:
                packed_vs_padded_checks(run, res["checks"], logits)
            del logits
        if run.cuda and p == run.sweep_profile:
            oom_search(run, model, hf_methods, p, weights_bytes, oomed)
            res["largest_batch"] = largest_batches(res)
            run.log(f"    largest batch: {res['largest_batch']}")
            run.save()
    del model
    gc.collect()
    if run.cuda:
        torch.cuda.empty_cache()


def time_hf_batch_size(run: PrepackingRun, model, hf_methods: list, p: str, b: int,
                       weights_bytes: int, oomed: set) -> dict:
    """Each metric of each HF method at batch size `b` (a pair that ran out of memory at a
    smaller size is skipped, and one that runs out now joins `oomed`). At --batch-size: the
    first pass's logits per (method, metric), for the checks."""
    res = run.result["profiles"][p]
    logits = {}
    for metric in METRICS:
        for m in hf_methods:
            key = f"{m}/{metric}"
            if (m, metric) in oomed:
                res["hf"].setdefault(key, {})[str(b)] = {"oom": True, "skipped": "smaller OOMed"}
                continue
            entry, lg = time_hf(model, m, metric, run.pools[p], b, run.args, run.dtype,
                                weights_bytes, run.log, keep_logits=b == run.bsz)
            if entry.get("oom"):
                oomed.add((m, metric))
                run.log(f"    {m:12s} {metric:7s} B={b:5d}: out of memory")
            res["hf"].setdefault(key, {})[str(b)] = entry
            if lg is not None and m != "hf_lenorder":
                logits[(m, metric)] = torch.cat(lg)
            run.save()
    return logits


def packed_vs_padded_checks(run: PrepackingRun, checks: dict, logits: dict) -> None:
    """Prepacking's first tokens and logits against the padded batch's (same batches)."""
    if ("hf_padded", "ttft") not in logits or ("hf_packed", "ttft") not in logits:
        return
    a, c = logits[("hf_packed", "ttft")], logits[("hf_padded", "ttft")]
    checks["ttft_first_token_packed_equals_padded"] = (
        f"{int((a.argmax(-1) == c.argmax(-1)).sum())}/{a.shape[0]}")
    checks["ttft_logits_packed_vs_padded_max_rel_err"] = (
        (a - c).abs().max() / c.abs().max()).item()
    if ("hf_packed", "prefill") in logits and ("hf_padded", "prefill") in logits:
        a, c = logits[("hf_packed", "prefill")], logits[("hf_padded", "prefill")]
        checks["prefill_logits_packed_vs_padded_max_rel_err"] = (
            (a - c).abs().max() / c.abs().max()).item()
    run.log(f"    checks: {checks}")


def oom_search(run: PrepackingRun, model, hf_methods: list, p: str, weights_bytes: int,
               oomed: set) -> None:
    """Largest batch before OOM: one batch of twice the largest timed size, then twice that,
    ... per padded and packed method and metric, until each fails or --oom-cap is passed."""
    res = run.result["profiles"][p]
    b = max(run.sizes_of[p]) * 2
    alive = {(m, metric) for m in hf_methods if m != "hf_lenorder"
             for metric in METRICS} - oomed
    while alive and b <= run.args.oom_cap:
        big = make_pool(p, b, run.cfg["vocab_size"], run.args.seed + 1, run.args.max_len)
        for metric in METRICS:
            for m in ("hf_padded", "hf_packed"):
                if (m, metric) not in alive:
                    continue
                r, lg = measure_hf(model, m, metric, big, run.args.device, run.dtype,
                                   weights_bytes)
                del lg
                r["real_tokens"] = sum(map(len, big))
                r["padded_tokens"] = len(big) * max(map(len, big))
                res["oom_search"].setdefault(f"{m}/{metric}", {})[str(b)] = r
                if r.get("oom"):
                    alive.discard((m, metric))
                    run.log(f"    OOM search {m} {metric} B={b}: out of memory")
                else:
                    run.log(f"    OOM search {m} {metric} B={b}: {r['s']:.3f} s, "
                            f"peak {r['peak_mib']:.0f} MiB")
                run.save()
        del big
        b *= 2


def largest_batches(res: dict) -> dict:
    """Per padded and packed method and metric: the largest batch that fitted and the smallest
    that ran out of memory, over the timed sizes and the OOM search."""
    largest = {}
    for m in ("hf_padded", "hf_packed"):
        for metric in METRICS:
            timed = res["hf"].get(f"{m}/{metric}", {})
            searched = res["oom_search"].get(f"{m}/{metric}", {})
            ok = [int(k) for k, v in timed.items() if not v.get("oom")]
            ok += [int(k) for k, v in searched.items() if not v.get("oom")]
            tried = [int(k) for k in searched] + [int(k) for k in timed]
            largest[f"{m}/{metric}"] = {
                "largest_fitting": max(ok) if ok else None,
                "first_oom": min([t for t in tried if t not in ok], default=None),
            }
    return largest


# ------------------------------------------------------------------------------- main: SGLang


def sglang_side(run: PrepackingRun) -> None:
    """One engine, dense and UniPrefill alternating per batch size."""
    sg_methods = [m for m in run.methods if m in SG_METHODS]
    if not sg_methods:
        return
    max_tokens = max(sum(len(x) for x in bt) for p in run.profiles for b in run.sizes_of[p]
                     for bt in random_batches(run.pools[p], b, run.args.seed))
    max_len = max(len(x) for p in run.profiles for x in run.pools[p])
    t0 = time.perf_counter()
    engine = start_engine(run.args, run.random_weights, max_tokens,
                          max(max(v) for v in run.sizes_of.values()), max_len,
                          run.cfg.get("max_position_embeddings") or 0)
    try:
        state = engine.get_server_info()["internal_states"][0]
        run.result["sglang"] = {"engine_start_s": time.perf_counter() - t0,
                                "memory_usage": state.get("memory_usage"),
                                "max_prefill_tokens": max(16384, max_tokens + 64),
                                "memory_meaning": "weights and the KV pool SGLang preallocates "
                                                  "(its memory_usage, GB); batches run inside "
                                                  "the pool or wait, never OOM"}
        if run.cuda:
            free, total = torch.cuda.mem_get_info()
            run.result["sglang"]["device_used_gib_all_processes"] = (total - free) / 2**30
        run.log(f"SGLang engine ready in {run.result['sglang']['engine_start_s']:.1f} s; "
                f"memory_usage {run.result['sglang']['memory_usage']}")
        run.save()
        for p in run.profiles:
            run.log(f"  [{p}]")
            for b in run.sizes_of[p]:
                for m in sg_methods:
                    entry = time_sglang(engine, m, run.pools[p], b, run.args, run.keep_ratio,
                                        run.log)
                    run.result["profiles"][p]["sglang"].setdefault(m, {})[str(b)] = entry
                    run.save()
    finally:
        engine.shutdown()


def log_table(run: PrepackingRun) -> None:
    """Batch size --batch-size, every profile: mean ms per batch (peak MiB) per method."""
    run.log("")
    run.log(f"{run.result['device_name']}, {run.name}, {run.result['dtype']}, batch {run.bsz}, "
            f"pool {run.pool_n}: mean per batch, ms (peak MiB, weights included)")
    run.log("| profile | metric | " + " | ".join(run.methods) + " |")
    run.log("|---" * (len(run.methods) + 2) + "|")
    for p in run.profiles:
        res = run.result["profiles"][p]
        for metric in METRICS:
            cells = []
            for m in run.methods:
                e = (res["hf"].get(f"{m}/{metric}", {}) if m in HF_METHODS else
                     res["sglang"].get(m, {}) if metric == "ttft" else {}).get(str(run.bsz))
                if not e:
                    cells.append("-")
                elif e.get("oom"):
                    cells.append("OOM")
                else:
                    mem = f" ({e['peak_mib']:.0f})" if e.get("peak_mib") else ""
                    cells.append(f"{e['mean_s_per_batch'] * 1e3:.1f}{mem}")
            run.log(f"| {p} | {metric} | " + " | ".join(cells) + " |")


def main() -> None:
    run = PrepackingRun(parse_args())
    describe_profiles(run)
    hf_side(run)
    sglang_side(run)
    log_table(run)
    run.save()
    run.log(f"wrote {run.out_path}")
    if run.cuda:
        # The engine is shut down and the file written; on the H200 the interpreter's exit
        # then hung for minutes (seen once), so leave without the exit handlers.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
