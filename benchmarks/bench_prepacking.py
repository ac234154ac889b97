"""Prepacking comparison: prefill one batch of very unequal prompts four ways, same model, one run.

Methods (all produce each prompt's next-token logits; nothing is decoded beyond that):

  hf_padded     Hugging Face transformers, right padding to the longest prompt, 2D mask.
  hf_packed     The same HF model, Prepacking (Zhao et al., 2024): prompts bin-packed into rows by
                first-fit decreasing (row capacity = the longest prompt), block-diagonal causal
                4D mask, positions restarting per prompt
                (``uniprefill_sglang/tools/prepacking.py``).
  sglang_dense  SGLang's ragged (varlen) prefill: all prompts sent at once as one
                ``engine.generate(input_ids=[...], max_new_tokens=1)`` call, UniPrefill off per
                request (``custom_params={"uniprefill": False}``).
  sglang_uniprefill  The same engine and call with UniPrefill on; prompts shorter than
                ``--uniprefill-min-prompt-tokens`` (default 1024) run dense, the long ones drop.

Workload (``make_workload``): ``--num-prompts`` lengths drawn log-uniformly between
``--min-len`` and ``--max-len`` (``L = round(exp(U(ln min, ln max)))``, so every octave holds
about the same number of prompts: 32..4096 gives a mean of ~(4096-32)/ln 128 = 838 tokens and a
long tail), with a fixed ``--seed``; token ids uniform in ``[100, vocab - 100)``. The same prompts
go to every method.

Timing: each method is warmed up once (on the ``--warmup-prompts`` shortest prompts of the
workload; default all of them), then the whole batch is run ``--repeats`` times and the median wall time is
reported. The HF methods are timed from token-id lists to the logits (building the padded or
packed tensors, the 4D mask included, counts); the SGLang methods from ``generate`` call to
return (IPC, scheduling and one sampling step included). The HF methods run first, in
alternating order; the HF model is then freed and the SGLang engine started, and the two SGLang
methods alternate too. On GPU every HF timing is bracketed by ``torch.cuda.synchronize()``.

Memory (what each number is):

  * HF on CUDA: ``torch.cuda.max_memory_allocated()`` during one batch minus the memory allocated
    before it (weights), i.e. the activation peak of the batch; weights reported separately.
  * HF on CPU: the peak resident set size of this process during one batch minus its RSS just
    before (``VmHWM`` after resetting it through ``/proc/self/clear_refs``, and ``malloc_trim``
    before each batch so that freed heap is returned first), i.e. activation and mask memory
    that the batch touched. Weights were resident already and are not in it.
  * SGLang on CPU: the same peak-RSS delta, measured on the scheduler process (where the model
    runs). The KV pool is preallocated at start; SGLang's own figures for it
    (``memory_usage``: weights, KV cache in GB, token capacity) are reported beside it. Pool
    pages first written during the batch would count in the delta.
  * SGLang on CUDA: the scheduler is another process, so its allocator cannot be queried from
    here. Reported: SGLang's ``memory_usage`` (weights and the preallocated KV pool) and the
    device memory in use (``cudaMemGetInfo``, all processes) before the engine starts, after it
    started and after each method's runs; the rise after a method's runs is the activation
    memory its caching allocator reserved (monotone: the second method only shows growth beyond
    the first).

Correctness side checks (reported, not timed): the packed and padded logits of each prompt agree
(max relative error); with real weights, SGLang's greedy token for each prompt (dense) against
the HF argmax.

CPU (SGLang's CPU engine, SmolLM2-135M-Instruct, fp32):

    python benchmarks/bench_prepacking.py --device cpu --num-prompts 8 --repeats 2 --warmup-prompts 3

GPU (one H200, Llama-3.1-8B shape, random weights: HF bf16 from config.json, SGLang dummy):

    python benchmarks/bench_prepacking.py --device cuda --model-path benchmarks/models/llama-3.1-8b

Writes ``benchmarks/results/prepacking_<device>.json`` (``--out``) and prints a table.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from result_header import result_header

METHODS = ("hf_padded", "hf_packed", "sglang_dense", "sglang_uniprefill")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


# ------------------------------------------------------------------------------- workload


def make_workload(num_prompts: int, min_len: int, max_len: int, vocab: int, seed: int):
    """Log-uniform lengths in [min_len, max_len], uniform random token ids; deterministic."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(num_prompts, generator=g, dtype=torch.float64)
    logs = math.log(min_len) + u * (math.log(max_len) - math.log(min_len))
    lengths = [min(max_len, max(min_len, round(math.exp(x)))) for x in logs.tolist()]
    prompts = [torch.randint(100, vocab - 100, (n,), generator=g).tolist() for n in lengths]
    return prompts


# ------------------------------------------------------------------------------- memory probes


def _status_kib(pid: int | str, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _reset_peak_rss(pid: int | str) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


class RssPeak:
    """Peak RSS above the starting RSS of a process, in MiB, over a ``with`` block."""

    def __init__(self, pid: int | str = "self"):
        self.pid = pid
        self.delta_mib = None

    def __enter__(self):
        if self.pid == "self":
            _malloc_trim()
        _reset_peak_rss(self.pid)
        self.start = _status_kib(self.pid, "VmRSS")
        return self

    def __exit__(self, *exc):
        self.delta_mib = (_status_kib(self.pid, "VmHWM") - self.start) / 1024
        return False


def _scheduler_pid() -> int | None:
    import psutil

    procs = psutil.Process().children(recursive=True)
    for p in procs:
        try:
            if "scheduler" in " ".join(p.cmdline()) or "scheduler" in p.name():
                return p.pid
        except psutil.Error:
            continue
    return None


def _device_used_gib() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


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
            model_path, dtype=dtype, attn_implementation="sdpa"
        ).to(device)
    return model.eval()


def run_hf(model, method: str, prompts, device: str, dtype: torch.dtype):
    from uniprefill_sglang.tools import prepacking as pp

    if method == "hf_padded":
        batch = pp.build_padded_batch(prompts, device=device)
        return pp.run_padded(model, batch)
    batch = pp.build_packed_batch(prompts, dtype=dtype, device=device)
    return pp.run_packed(model, batch)


def measure_hf(model, method, prompts, device, dtype):
    """One timed, memory-probed batch: (seconds, activation MiB, logits, CPU seconds or None).

    CPU seconds (CPU only): user + system time of this process over the batch, all threads.
    On a shared machine it is steadier than wall time (time spent waiting for a core is not in it).
    """
    if device == "cuda":
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        logits = run_hf(model, method, prompts, device, dtype)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        mib = (torch.cuda.max_memory_allocated() - base) / 2**20
        return dt, mib, logits, None
    gc.collect()
    with RssPeak() as peak:
        c0 = time.process_time()
        t0 = time.perf_counter()
        logits = run_hf(model, method, prompts, device, dtype)
        dt = time.perf_counter() - t0
        cpu = time.process_time() - c0
    return dt, peak.delta_mib, logits, cpu


# ------------------------------------------------------------------------------- SGLang side


def start_engine(args, random_weights: bool, total_tokens: int, n: int):
    common = dict(
        enable_uniprefill=True,
        disable_radix_cache=True,
        skip_tokenizer_init=True,  # token ids in and out; the GPU folder has no tokenizer
        uniprefill_min_prompt_tokens=args.uniprefill_min_prompt_tokens,
        # Room for the whole batch in one prefill step, like the HF single forward.
        max_prefill_tokens=max(8192, total_tokens + 64),
        max_running_requests=max(16, n),
        random_seed=0,
        log_level="error",
    )
    if random_weights:
        common["load_format"] = "dummy"
    if args.device == "cpu":
        from uniprefill_sglang.tools.cpu_engine import make_cpu_engine

        # On the CPU SGLang sizes the KV pool from free host RAM (shared with whatever else
        # runs); a high fraction keeps the pool at max_total_tokens (32768) whenever RAM allows.
        # The chunk size must cover the batch too (the CPU default, 8192, would split it).
        return make_cpu_engine(args.model_path, mem_fraction_static=args.mem_fraction_static,
                               chunked_prefill_size=common["max_prefill_tokens"], **common)
    import sglang

    return sglang.Engine(
        model_path=args.model_path,
        dtype="bfloat16",
        attention_backend=args.attention_backend,
        mem_fraction_static=args.mem_fraction_static,
        chunked_prefill_size=-1,  # prompts are at most --max-len tokens: never chunk
        context_length=args.max_len + 64,
        cuda_graph_backend_prefill="disabled",
        **common,
    )


def sglang_custom(method: str, keep_ratio: str | None) -> dict:
    if method == "sglang_dense":
        return {"uniprefill": False}
    return {"uniprefill_keep_ratio": keep_ratio} if keep_ratio else {}


def run_sglang(engine, prompts, custom: dict):
    outs = engine.generate(
        input_ids=prompts,
        sampling_params={"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True,
                         "custom_params": custom},
    )
    return outs


def kept_summary(outs, lengths, min_tokens):
    """Token-weighted kept fraction per stage over the long prompts, and over all prompts."""
    metas = [o["meta_info"].get("uniprefill", [{}])[-1] for o in outs]
    kept = [m.get("kept_tokens") for m in metas]
    enabled = [bool(m.get("enabled")) for m in metas]
    reasons = sorted({str(m.get("reason")) for m in metas if not m.get("enabled")})
    stages = max((len(k) for k in kept if k), default=0)

    def frac(idx):
        tot = sum(lengths[i] for i in idx)
        if not tot or not stages:
            return None
        return [sum((kept[i][s] if kept[i] and s < len(kept[i]) else lengths[i]) for i in idx) / tot
                for s in range(stages)]

    long_idx = [i for i, n in enumerate(lengths) if n >= min_tokens]
    return {
        "num_enabled": sum(enabled),
        "num_long": len(long_idx),
        "dense_reasons": reasons,
        "kept_fraction_per_stage_long": frac([i for i in long_idx if enabled[i]]),
        "kept_fraction_per_stage_all": frac(list(range(len(lengths)))),
        "kept_tokens": kept,
    }


# ------------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--model-path", default=None,
                    help="HF folder; default on CPU: SmolLM2-135M-Instruct (model_zoo)")
    ap.add_argument("--random-weights", choices=["auto", "yes", "no"], default="auto",
                    help="auto: yes when the folder holds no weight files (config.json only)")
    ap.add_argument("--num-prompts", type=int, default=None, help="default: 8 on CPU, 64 on CUDA")
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup-prompts", type=int, default=None,
                    help="warm up on the K shortest prompts only (default: the whole batch)")
    ap.add_argument("--uniprefill-min-prompt-tokens", type=int, default=1024)
    ap.add_argument("--keep-ratio", default=None,
                    help="UniPrefill per-request keep-ratio schedule, e.g. 0.5,0.8; 'none' = the "
                         "server's top-p (0.99). Default: none with real weights, 0.5,0.8 with "
                         "random weights (top-p keeps almost everything on random weights)")
    ap.add_argument("--attention-backend", default="flashinfer", help="CUDA only")
    ap.add_argument("--mem-fraction-static", type=float, default=None,
                    help="SGLang's; default 0.8 on CUDA (room for the freed HF model's cache), "
                         "0.95 on CPU")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    if args.device == "cpu":
        # Before anything imports sglang (the HF half does not, the engine start does).
        from uniprefill_sglang.tools.cpu_engine import activate_cpu_engine_env

        activate_cpu_engine_env()
        if args.model_path is None:
            from uniprefill_sglang.tools.model_zoo import prepare_smollm2

            args.model_path = prepare_smollm2()
    elif args.model_path is None:
        ap.error("--model-path is required with --device cuda")
    methods = [m for m in args.methods.split(",") if m]
    for m in methods:
        if m not in METHODS:
            ap.error(f"unknown method {m}")
    n = args.num_prompts or (8 if args.device == "cpu" else 64)
    folder = Path(args.model_path)
    random_weights = {"yes": True, "no": False}.get(args.random_weights)
    if random_weights is None:
        random_weights = not any(p.name.endswith(WEIGHT_SUFFIXES) for p in folder.iterdir())
    keep_ratio = args.keep_ratio
    if keep_ratio is None:
        keep_ratio = "0.5,0.8" if random_weights else None
    elif keep_ratio.lower() == "none":
        keep_ratio = None
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    if args.mem_fraction_static is None:
        args.mem_fraction_static = 0.8 if args.device == "cuda" else 0.95
    out_path = args.out or f"benchmarks/results/prepacking_{args.device}.json"

    cfg = json.loads((folder / "config.json").read_text())
    prompts = make_workload(n, args.min_len, args.max_len, cfg["vocab_size"], args.seed)
    lengths = [len(p) for p in prompts]
    # Warm-up batch: the K shortest prompts (a warm-up only has to pay the one-time costs).
    warm = sorted(prompts, key=len)[: args.warmup_prompts] if args.warmup_prompts else prompts

    from uniprefill_sglang.tools.prepacking import build_packed_batch, build_padded_batch

    packed_probe = build_packed_batch(prompts, dtype=torch.float32, device="meta")
    padded_probe = build_padded_batch(prompts)
    layout = {
        "real_tokens": sum(lengths),
        "padded_batch_tokens": padded_probe.input_ids.numel(),
        "padding_waste": padded_probe.padded_tokens / sum(lengths),
        "packed_rows": packed_probe.num_rows,
        "packed_width": packed_probe.width,
        "packed_capacity": packed_probe.capacity,
        "packed_batch_tokens": packed_probe.num_rows * packed_probe.width,
        "packed_fill_ratio": packed_probe.fill_ratio,
        "packed_waste": (packed_probe.num_rows * packed_probe.width - sum(lengths)) / sum(lengths),
    }
    del packed_probe, padded_probe

    result = {
        "header": result_header(model=str(args.model_path)),
        "date": datetime.date.today().isoformat(),
        "device": args.device,
        "device_name": (torch.cuda.get_device_name() if args.device == "cuda"
                        else platform.processor() or platform.machine()),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "model_path": str(args.model_path),
        "model": {k: cfg.get(k) for k in ("hidden_size", "num_hidden_layers",
                                          "num_attention_heads", "num_key_value_heads",
                                          "intermediate_size", "vocab_size")},
        "random_weights": random_weights,
        "dtype": str(dtype).replace("torch.", ""),
        "workload": {"num_prompts": n, "distribution": "log-uniform", "min_len": args.min_len,
                     "max_len": args.max_len, "seed": args.seed, "lengths": lengths,
                     "token_ids": "uniform in [100, vocab-100)"},
        "layout": layout,
        "repeats": args.repeats,
        "warmup_prompt_lengths": [len(p) for p in warm],
        "uniprefill": {"min_prompt_tokens": args.uniprefill_min_prompt_tokens,
                       "selection": (f"keep_ratio {keep_ratio} (per request)" if keep_ratio
                                     else "top-p (server default 0.99)")},
        "methods": {},
        "checks": {},
        "loadavg_1min_at_start": os.getloadavg()[0],
    }

    def save():
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(result, indent=1))

    print(f"workload: {n} prompts, lengths {sorted(lengths)}; real {layout['real_tokens']}, "
          f"padded {layout['padded_batch_tokens']}, packed {layout['packed_rows']} rows x "
          f"{layout['packed_width']}", flush=True)

    # ---- Hugging Face: padded and packed, alternating, one model.
    hf_methods = [m for m in methods if m.startswith("hf_")]
    hf_logits = {}
    if hf_methods:
        t0 = time.perf_counter()
        model = load_hf_model(args.model_path, args.device, dtype, random_weights)
        weights_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        print(f"HF model ready in {time.perf_counter() - t0:.1f} s ({weights_mib:.0f} MiB)",
              flush=True)
        times = {m: [] for m in hf_methods}
        mems = {m: [] for m in hf_methods}
        cpus = {m: [] for m in hf_methods}
        for m in hf_methods:
            dt = measure_hf(model, m, warm, args.device, dtype)[0]
            print(f"  warm-up {m}: {dt:.2f} s", flush=True)
        for r in range(args.repeats):
            order = hf_methods if r % 2 == 0 else hf_methods[::-1]
            for m in order:
                dt, mib, logits, cpu = measure_hf(model, m, prompts, args.device, dtype)
                times[m].append(dt)
                mems[m].append(mib)
                cpus[m].append(cpu)
                if r == 0:
                    assert torch.isfinite(logits).all(), f"{m}: non-finite logits"
                    hf_logits[m] = logits.float().cpu()
                print(f"  {m} repeat {r}: {dt:.2f} s, peak +{mib:.0f} MiB, "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
        for m in hf_methods:
            result["methods"][m] = {
                "median_s": statistics.median(times[m]), "times_s": times[m],
                "peak_mib": max(mems[m]), "peak_mib_all": mems[m],
                "peak_meaning": ("torch.cuda.max_memory_allocated above the pre-batch allocation"
                                 if args.device == "cuda" else
                                 "peak RSS (VmHWM) above the pre-batch RSS, this process"),
                "weights_mib": weights_mib,
            }
            if args.device == "cpu":
                result["methods"][m]["cpu_s_median"] = statistics.median(cpus[m])
                result["methods"][m]["cpu_s"] = cpus[m]
        if len(hf_logits) == 2:
            a, b = hf_logits["hf_packed"], hf_logits["hf_padded"]
            result["checks"]["packed_vs_padded_max_rel_err"] = (
                (a - b).abs().max() / b.abs().max()).item()
        save()
        del model
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        _malloc_trim()

    # ---- SGLang: one engine, dense and UniPrefill alternating.
    sg_methods = [m for m in methods if m.startswith("sglang_")]
    if sg_methods:
        used_before = _device_used_gib() if args.device == "cuda" else None
        t0 = time.perf_counter()
        engine = start_engine(args, random_weights, sum(lengths), n)
        start_s = time.perf_counter() - t0
        try:
            state = engine.get_server_info()["internal_states"][0]
            mem_usage = state.get("memory_usage")
            sched = {"engine_start_s": start_s, "memory_usage": mem_usage,
                     "drop_layers": state.get("uniprefill", {}).get("drop_layers")}
            if args.device == "cuda":
                sched["device_used_gib_before_engine"] = used_before
                sched["device_used_gib_after_start"] = _device_used_gib()
            print(f"SGLang engine ready in {start_s:.1f} s; memory_usage {mem_usage}", flush=True)
            cap = (mem_usage or {}).get("token_capacity")
            if cap is not None and cap < sum(lengths):
                print(f"WARNING: KV pool holds {cap} tokens < {sum(lengths)} in the batch: "
                      "SGLang will prefill it in several steps", flush=True)
            result["sglang"] = sched
            pid = _scheduler_pid() if args.device == "cpu" else None
            for m in sg_methods:
                t = time.perf_counter()
                run_sglang(engine, warm, sglang_custom(m, keep_ratio))
                print(f"  warm-up {m}: {time.perf_counter() - t:.2f} s", flush=True)
            times = {m: [] for m in sg_methods}
            mems = {m: [] for m in sg_methods}
            cpus = {m: [] for m in sg_methods}
            last = {}
            sched_proc = None
            if pid:
                import psutil

                sched_proc = psutil.Process(pid)
            for r in range(args.repeats):
                order = sg_methods if r % 2 == 0 else sg_methods[::-1]
                for m in order:
                    probe = RssPeak(pid) if pid else None
                    if probe:
                        probe.__enter__()
                    c0 = sum(sched_proc.cpu_times()[:2]) if sched_proc else None
                    t = time.perf_counter()
                    outs = run_sglang(engine, prompts, sglang_custom(m, keep_ratio))
                    dt = time.perf_counter() - t
                    if sched_proc:
                        cpus[m].append(sum(sched_proc.cpu_times()[:2]) - c0)
                    if probe:
                        probe.__exit__(None, None, None)
                        mems[m].append(probe.delta_mib)
                    times[m].append(dt)
                    last[m] = outs
                    if args.device == "cuda":
                        mems[m].append(_device_used_gib())
                    print(f"  {m} repeat {r}: {dt:.2f} s"
                          + (f", peak +{mems[m][-1]:.0f} MiB" if probe else "")
                          + f", load {os.getloadavg()[0]:.1f}", flush=True)
            for m in sg_methods:
                entry = {"median_s": statistics.median(times[m]), "times_s": times[m]}
                if args.device == "cpu":
                    entry["peak_mib"] = max(mems[m]) if mems[m] else None
                    entry["peak_mib_all"] = mems[m]
                    entry["peak_meaning"] = ("peak RSS (VmHWM) above the pre-batch RSS, SGLang "
                                             "scheduler process (KV pool preallocated, not in it)")
                    if cpus[m]:
                        entry["cpu_s_median"] = statistics.median(cpus[m])
                        entry["cpu_s"] = cpus[m]
                        entry["cpu_meaning"] = "user + system time of the scheduler process"
                else:
                    entry["device_used_gib_after_runs"] = mems[m]
                    entry["peak_meaning"] = ("device memory in use (cudaMemGetInfo, all "
                                             "processes) after this method's runs; compare with "
                                             "sglang.device_used_gib_after_start")
                entry["kept"] = kept_summary(last[m], lengths, args.uniprefill_min_prompt_tokens)
                result["methods"][m] = entry
            if "sglang_dense" in last and "hf_packed" in hf_logits and not random_weights:
                sg_tok = [o["output_ids"][0] for o in last["sglang_dense"]]
                hf_tok = hf_logits["hf_packed"].argmax(-1).tolist()
                result["checks"]["sglang_dense_token_equals_hf_argmax"] = (
                    f"{sum(a == b for a, b in zip(sg_tok, hf_tok))}/{len(sg_tok)}")
        finally:
            engine.shutdown()
        save()

    # ---- table
    print()
    print(f"{result['device_name']}, {result['dtype']}, {n} prompts ({layout['real_tokens']} "
          f"tokens), padding waste {layout['padding_waste']:.2f}, packed {layout['packed_rows']} "
          f"rows, fill {layout['packed_fill_ratio']:.1%}")
    print("| method | median s | vs padded | CPU s | peak memory | note |")
    print("|---|---|---|---|---|---|")
    base = result["methods"].get("hf_padded", {}).get("median_s")
    for m in methods:
        e = result["methods"].get(m)
        if not e:
            continue
        speed = f"{base / e['median_s']:.2f}x" if base else "-"
        if "peak_mib" in e and e["peak_mib"] is not None:
            mem = f"+{e['peak_mib']:.0f} MiB"
        elif "device_used_gib_after_runs" in e:
            mem = f"{e['device_used_gib_after_runs'][-1]:.1f} GiB in use"
        else:
            mem = "-"
        note = ""
        if m == "sglang_uniprefill":
            k = e["kept"]
            fr = k["kept_fraction_per_stage_long"]
            note = (f"{k['num_enabled']}/{n} prompts dropped; long prompts keep "
                    f"{fr[-1]:.0%} after the last drop" if fr else "no prompt dropped")
        cpu = f"{e['cpu_s_median']:.1f}" if e.get("cpu_s_median") is not None else "-"
        print(f"| {m} | {e['median_s']:.2f} | {speed} | {cpu} | {mem} | {note} |")
    for k, v in result["checks"].items():
        print(f"{k}: {v}")
    result["loadavg_1min_at_end"] = os.getloadavg()[0]
    save()
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
