"""Per-stage KV pools under load: how many long requests a server holds at once, and what it buys.

UniPrefill's later layers hold KV only for the tokens that survive to them. With the `shared`
KV layout every layer still has a slot for every token (dropped tokens' slots sit unused in the
later layers); with `staged` the layers after each drop layer have a pool of their own, sized
by the expected keep profile, so a long request takes less KV memory and more requests fit. This
script measures that on one GPU, one stock `python -m sglang.launch_server` per mode, run one
after another, each started with the same flags:

* `dense`: UniPrefill off (no `--enable-uniprefill`);
* `shared`: `--enable-uniprefill --uniprefill-keep-ratio 0.5,0.8 --uniprefill-kv-layout shared`;
* `staged`: the same with `--uniprefill-kv-layout staged` (and `--uniprefill-stage-kv-fraction`
  when `--stage-kv-fraction` is given; the server's default is derived from the keep ratios).

Both UniPrefill servers get `--uniprefill-prefix-policy reuse-sparse`, under which no per-slot
prefix checkpoint memory is taken from the KV pool. The radix cache stays on (the layouts must
work with it), but nothing is reused: the cache is flushed before every measurement,
bench_serving's warm-up request (a copy of the first measured prompt) is off, and each
concurrency point's `--seed` is chosen so that no two of its prompts start with the same token
(random-ids prompts are runs of consecutive ids from a random start). The served requests'
cached tokens (bench_serving's `--cache-report`) are recorded to show it: they should be 0.
Model: a `config.json` folder with random weights (`--load-format dummy`) and the word-level
tokenizer of synthetic_model.py; a fixed keep ratio, as top-p keeps nearly everything on random
weights. Prefill CUDA graphs are off for every mode (SGLang starts ~40 s sooner; 8K-token
prefill chunks gain nothing from them), decode CUDA graphs on.

Per mode, in this order:

1. **Memory probe** (`--memory-probe-len`, 0: skip): after a cache flush, one request with a
   unique 128K-token prompt and 8 new tokens; once it has finished, its KV still sits in the
   radix cache, and each KV pool's free slots are read from `/server_info`
   (`internal_states[0]["uniprefill"]["kv_pools"]`: per stage its layers, slots, free slots
   and K+V bytes per slot). Slots held = free before - free after, per stage; bytes = slots x
   bytes per slot. A dense server reports no pools: its slots are the request's prompt plus
   generated tokens less one (every token has a slot in every layer), its bytes per slot
   2 x layers x KV heads x head_dim x dtype size (128 KiB for Llama-3.1-8B in bf16). The table
   gives each layout's bytes as a fraction of dense's and how many such requests, once
   prefilled, the pools hold (the scarcest pool decides).
2. **Serving**, per `--concurrency` C: `python -m sglang.bench_serving --backend sglang
   --dataset-name random-ids --tokenize-prompt --random-input-len L --random-output-len O
   --random-range-ratio 1 --num-prompts N --max-concurrency C --request-rate inf` with
   N = max(4, ceil(`--prompts-per-concurrency` x C)). Meanwhile a thread reads `/v1/loads`
   (the scheduler's published load snapshot: running and waiting requests; no call into the
   scheduler) and `/server_info` (the stage pools' free slots) every `--poll-interval` s. The
   row keeps bench_serving's TTFT and ITL (mean / median / p99), output and request throughput
   and duration, and the running requests' maximum and their mean over the run's steady part:
   from the first sample with at least 90% of the run's maximum running to the last sample at
   which the server still had C - 1 requests (running + waiting; the one in prefill is in
   neither) before the drain.

Results go to one JSON (`--out`), merged with what is there: a mode's rows are replaced point
by point (by concurrency), its memory probe only when measured again, so the modes (or a mode's
concurrency points) can run in separate invocations, as the GPU's 10-minute command limit
needs. A file measured with other settings (lengths, keep ratio, memory fraction, ...) is
refused unless `--replace`. `benchmarks/plot_stage_kv.py` draws it.

    python benchmarks/stage_kv_serving.py --modes staged --deadline-s 560 \\
        --out benchmarks/results/stage_kv/stage_kv_h200.json
    python benchmarks/stage_kv_serving.py --dry-run        # print every command, start nothing

`--cpu` runs the same flow on SGLang's CPU engine (a smoke test of this script on a small real
model, e.g. SmolLM2 with `--load-format auto --input-len 1024 --memory-probe-len 2048`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import requests

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from bench_serving_runs import (  # noqa: E402
    METRICS,
    bench_serving_command,
    kept_fraction,
    run_bench_serving,
)
from result_header import result_header  # noqa: E402
from synthetic_model import prepare  # noqa: E402

from uniprefill_sglang.tools import server_process as sp  # noqa: E402

MODES = ("dense", "shared", "staged")
DEFAULT_MODEL = "benchmarks/models/llama-3.1-8b"
BENCH_METRICS = METRICS + ("total_input_tokens", "total_output_tokens", "concurrency",
                           "max_concurrent_requests")
# Settings that make two invocations' numbers comparable; a results file holds one set (the
# prompts per point may differ: each row records its own).
SETUP_KEYS = ("model", "load_format", "input_len", "output_len", "keep_ratio", "prefix_policy",
              "attention_backend", "mem_fraction_static", "context_length",
              "chunked_prefill_size", "max_running_requests",
              "cuda_graph_max_bs_decode", "prefill_cuda_graph", "extra_server_args", "cpu")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4,
               "fp8_e4m3": 1, "fp8_e5m2": 1}
# A mode is not begun with less time than this left before --deadline-s (start-up is ~2 min).
MIN_MODE_S = 150
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - T0:5.0f}s] {msg}", flush=True)


# --- command lines ----------------------------------------------------------------------------


def mode_flags(mode: str, args) -> list:
    if mode == "dense":
        return []
    flags = ["--enable-uniprefill", "--uniprefill-keep-ratio", args.keep_ratio,
             "--uniprefill-prefix-policy", args.prefix_policy, "--uniprefill-kv-layout", mode]
    if mode == "staged" and args.stage_kv_fraction:
        flags += ["--uniprefill-stage-kv-fraction", args.stage_kv_fraction]
    return flags


def common_flags(args) -> list:
    flags = ["--context-length", str(args.context_length), "--random-seed", "0"]
    if args.load_format:
        flags += ["--load-format", args.load_format]
    if not args.cpu:
        flags += ["--attention-backend", args.attention_backend,
                  "--mem-fraction-static", str(args.mem_fraction_static),
                  "--cuda-graph-max-bs-decode", str(args.cuda_graph_max_bs_decode)]
        if not args.prefill_cuda_graph:
            flags.append("--disable-prefill-cuda-graph")
    if args.max_running_requests:
        flags += ["--max-running-requests", str(args.max_running_requests)]
    if args.chunked_prefill_size:
        flags += ["--chunked-prefill-size", str(args.chunked_prefill_size)]
    return flags + shlex.split(args.extra_server_args)


def server_cmd(mode: str, args, model: str, port: int) -> list:
    return sp.server_command(model, port, *common_flags(args), *mode_flags(mode, args),
                             cpu=args.cpu, uniprefill=False)


def server_env(args) -> dict:
    # The probe's 128K prompt plus its new tokens exceed Llama-3.1's 131072 positions.
    return sp.launch_env(args.cpu, str(REPO), SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN="1")


def num_prompts(conc: int, per_conc: float) -> int:
    return max(4, math.ceil(per_conc * conc))


def bench_prompt_starts(seed: int, n: int, input_len: int, output_len: int, vocab: int) -> list:
    """The first token of each prompt `sglang.bench_serving --dataset-name random-ids
    --random-range-ratio 1 --seed seed` sends (SGLang 0.5.17: numpy's global generator seeded,
    the input and the output lengths drawn, then one offset per prompt; prompt i is the run
    offset_i + i, offset_i + i + 1, ... mod vocab)."""
    import numpy as np

    rs = np.random.RandomState(seed)
    rs.randint(input_len, input_len + 1, size=n)
    rs.randint(output_len, output_len + 1, size=n)
    offsets = rs.randint(0, vocab, size=n)
    return [int((offsets[i] + i) % vocab) for i in range(n)]


def unique_seed(base: int, n: int, input_len: int, output_len: int, vocab: int) -> int:
    """The first seed from `base` whose prompts all start with different tokens."""
    for seed in range(base, base + 1000):
        if len(set(bench_prompt_starts(seed, n, input_len, output_len, vocab))) == n:
            return seed
    raise RuntimeError(f"no seed in [{base}, {base + 1000}) gives {n} distinct first tokens")


def bench_cmd(url: str, model: str, conc: int, args, vocab: int, out_file: Path) -> tuple:
    n = num_prompts(conc, args.prompts_per_concurrency)
    seed = unique_seed(1000 * conc, n, args.input_len, args.output_len, vocab)
    cmd = bench_serving_command(url, model, args.input_len, args.output_len, n, conc, seed,
                                out_file, extra=("--warmup-requests", "0", "--cache-report"))
    return cmd, n, seed


# --- server state -----------------------------------------------------------------------------


def server_info(url: str) -> dict:
    # It waits for the scheduler, which may be in a long prefill.
    return sp.server_info(url, timeout=60.0)


def pool_view(info: dict) -> dict:
    """What this script reads of `/server_info`: SGLang's pool size and memory, and, on a
    UniPrefill server, its KV accounting with the per-stage pools (absent: a dense server)."""
    state = (info.get("internal_states") or [{}])[0]
    up = state.get("uniprefill") or {}
    return {"max_total_num_tokens": info.get("max_total_num_tokens"),
            "memory_usage": state.get("memory_usage"),
            "max_running_requests": state.get("effective_max_running_requests_per_dp"),
            "uniprefill": {k: v for k, v in up.items() if k != "kv_pool_problems"} or None,
            "kv_pool_problems": up.get("kv_pool_problems")}


def kv_pools(view: dict) -> Optional[list]:
    return ((view.get("uniprefill") or {}).get("kv_pools")) or None


def loads(url: str) -> dict:
    body = requests.get(url + "/v1/loads", params={"include": "core"}, timeout=10).json()
    return body["loads"][0]


def wait_idle(url: str, timeout_s: float = 60.0) -> dict:
    """Poll until nothing runs or waits (and a UniPrefill server says idle); the last view."""
    deadline = time.monotonic() + timeout_s
    while True:
        load = loads(url)
        view = pool_view(server_info(url))
        idle = (view["uniprefill"] or {}).get("idle", True)
        if (idle and not load["num_running_reqs"] and not load["num_waiting_reqs"]) \
                or time.monotonic() > deadline:
            return view
        time.sleep(0.25)


class Poller:
    """Samples the server every `interval` s, in two threads so that a slow `/server_info` (it
    waits for the scheduler, which may be in a long prefill) delays no load sample:
    `/v1/loads` (running and waiting requests, from the scheduler's published snapshot) and
    `/server_info` (free slots per KV pool; SGLang's available and evictable slots)."""

    def __init__(self, url: str, interval: float):
        self.url, self.interval = url, interval
        self.loads: list = []  # [t, running, waiting]
        self.pools: list = []  # [t, [free per stage] or None, available, evictable]
        self.errors = 0
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(f,), daemon=True)
                         for f in (self._sample_loads, self._sample_pools)]

    def __enter__(self) -> "Poller":
        self.t0 = time.monotonic()
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def _sample_loads(self, t: float) -> None:
        load = loads(self.url)
        self.loads.append([t, load["num_running_reqs"], load["num_waiting_reqs"]])

    def _sample_pools(self, t: float) -> None:
        up = pool_view(server_info(self.url))["uniprefill"] or {}
        pools = up.get("kv_pools")
        self.pools.append([t, [p["free"] for p in pools] if pools else None,
                           up.get("available_kv_tokens"), up.get("evictable_kv_tokens")])

    def _loop(self, sample) -> None:
        while not self._stop.is_set():
            t = time.monotonic() - self.t0
            try:
                sample(round(t, 2))
            except Exception:  # a slow or refused poll loses a sample, not the run
                self.errors += 1
            # the next multiple of the interval (no burst of catch-up samples after a slow one)
            wait = self.interval * (math.floor((time.monotonic() - self.t0) / self.interval) + 1)
            self._stop.wait(max(0.0, wait - (time.monotonic() - self.t0)))


def running_stats(samples: list, conc: int) -> dict:
    """Max running requests, and their mean over the steady part (see the docstring)."""
    active = [s for s in samples if s[1] + s[2] > 0]
    if not active:
        return {"max_running": 0, "mean_running": None, "samples": len(samples)}
    peak = max(s[1] for s in active)
    start = next(s[0] for s in active if s[1] >= 0.9 * peak)
    full = [s[0] for s in active if s[1] + s[2] >= conc - 1]
    end = full[-1] if full and full[-1] >= start else active[-1][0]
    steady = [s for s in active if start <= s[0] <= end]
    return {"max_running": peak,
            "mean_running": round(sum(s[1] for s in steady) / len(steady), 2),
            "mean_running_active": round(sum(s[1] for s in active) / len(active), 2),
            "max_waiting": max(s[2] for s in active), "steady_s": [start, end],
            "steady_samples": len(steady), "samples": len(samples)}


def columns(loads: list, pools: list) -> dict:
    """The poller's samples, one list per quantity (compact in the results file)."""
    frees = [p[1] for p in pools]
    stages = max((len(f) for f in frees if f), default=0)
    return {"loads": {"t": [s[0] for s in loads], "running": [s[1] for s in loads],
                      "waiting": [s[2] for s in loads]},
            "pools": {"t": [p[0] for p in pools], "available": [p[2] for p in pools],
                      "evictable": [p[3] for p in pools],
                      "free": [[f[k] if f else None for f in frees] for k in range(stages)]}}


def pool_stats(samples: list, sizes: Optional[list]) -> Optional[dict]:
    """Per stage pool, its fewest free slots during the run (the rest: running requests' KV
    and what the radix cache keeps of finished ones)."""
    frees = [s[1] for s in samples if s[1]]
    if not frees or not sizes or len(frees[0]) != len(sizes):
        return None
    min_free = [min(f[k] for f in frees) for k in range(len(sizes))]
    return {"size": sizes, "min_free": min_free,
            "peak_held_fraction": [round(1 - m / s, 4) if s else None
                                   for m, s in zip(min_free, sizes)]}


# --- the memory probe -------------------------------------------------------------------------


def dense_bytes_per_slot(cfg: dict, info: dict) -> int:
    """K+V bytes of one token across all layers when every layer holds every token."""
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    dtype = next((d for d in (info.get("kv_cache_dtype"), info.get("dtype"),
                              cfg.get("torch_dtype")) if d and d != "auto"), "bfloat16")
    return 2 * cfg["num_hidden_layers"] * heads * head_dim * DTYPE_BYTES[str(dtype)]


def prompt_ids(n: int, vocab: int, rng: random.Random, first: int) -> list:
    """Random ids; `first` is a token no other prompt of this script starts with."""
    return [first] + [rng.randrange(1000, vocab - 1) for _ in range(n - 1)]


def generate(url: str, ids: list, new_tokens: int, timeout: float) -> dict:
    r = requests.post(url + "/generate", timeout=timeout, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0,
                                              "ignore_eos": True}})
    r.raise_for_status()
    return r.json()["meta_info"]


def memory_probe(url: str, args, cfg: dict, info: dict, rng: random.Random) -> dict:
    sp.flush_cache(url)
    before = wait_idle(url)
    t0 = time.monotonic()
    meta = generate(url, prompt_ids(args.memory_probe_len, cfg["vocab_size"], rng, first=3),
                    args.memory_probe_new_tokens, args.request_timeout)
    seconds = time.monotonic() - t0
    after = wait_idle(url)
    generated = int(meta["completion_tokens"])
    kept = [e.get("kept_tokens") for e in meta.get("uniprefill") or []]
    pools_before, pools_after = kv_pools(before), kv_pools(after)
    if pools_before and pools_after and len(pools_before) == len(pools_after):
        source = "kv_pools: free slots before - after"
        stages = [dict(stage=a["stage"], layers=a["layers"], size=a["size"],
                       free_before=b["free"], free_after=a["free"],
                       slots_held=b["free"] - a["free"], bytes_per_slot=a["bytes_per_slot"])
                  for b, a in zip(pools_before, pools_after)]
    else:
        dense_slot = dense_bytes_per_slot(cfg, info)
        up_b, up_a = before["uniprefill"], after["uniprefill"]
        if up_b and up_a and "available_kv_tokens" in up_a:
            source = "available_kv_tokens before - after"
            held = up_b["available_kv_tokens"] - up_a["available_kv_tokens"]
        else:
            source = "computed: prompt + generated - 1 tokens, one slot each in every layer"
            held = int(meta["prompt_tokens"]) + generated - 1
        stages = [dict(stage=0, layers=cfg["num_hidden_layers"],
                       size=after["max_total_num_tokens"], slots_held=held,
                       bytes_per_slot=dense_slot)]
    for s in stages:
        s["bytes"] = s["slots_held"] * s["bytes_per_slot"]
    fits = [s["size"] // s["slots_held"] for s in stages if s["slots_held"] > 0 and s["size"]]
    return {"prompt_tokens": int(meta["prompt_tokens"]), "generated_tokens": generated,
            "cached_tokens": meta.get("cached_tokens"), "kept_tokens": kept[-1] if kept else None,
            "seconds": round(seconds, 2), "source": source, "stages": stages,
            "total_bytes": sum(s["bytes"] for s in stages),
            "requests_that_fit": min(fits) if fits else None,
            "kv_pool_problems": after.get("kv_pool_problems"),
            "max_total_num_tokens": after["max_total_num_tokens"]}


# --- a concurrency point ----------------------------------------------------------------------


def run_point(url: str, model: str, mode: str, conc: int, args, vocab: int, log_dir: Path,
              timeout: float) -> dict:
    out_file = log_dir / f"bench_{mode}_{args.input_len}_{conc}.jsonl"
    out_file.unlink(missing_ok=True)
    cmd, n, seed = bench_cmd(url, model, conc, args, vocab, out_file)
    sp.flush_cache(url)
    before = wait_idle(url)
    log(f"[{mode}] C={conc}: {n} prompts of {args.input_len} tokens, {args.output_len} out, "
        f"seed {seed}")
    with Poller(url, args.poll_interval) as poller:
        result = run_bench_serving(cmd, out_file, log_dir / f"bench_{mode}.log", timeout)
    after = pool_view(server_info(url))
    row = {k: result.get(k) for k in BENCH_METRICS}
    cache = result.get("cache_report") or {}
    kept = kept_fraction(before["uniprefill"] or {}, after["uniprefill"] or {})
    pools = kv_pools(before)
    row.update(concurrency=conc, num_prompts=n, seed=seed,
               cached_tokens=cache.get("total_cached_tokens"),
               kept_fraction=None if kept is None else round(kept, 4),
               running=running_stats(poller.loads, conc),
               pools=pool_stats(poller.pools, [p["size"] for p in pools] if pools else None),
               poll_errors=poller.errors,
               samples=columns(poller.loads, poller.pools))
    r = row["running"]
    log(f"[{mode}] C={conc}: running max {r['max_running']} mean {_f(r['mean_running'])}, "
        f"output {_f(row['output_throughput'], '.0f')} tok/s, "
        f"{_f(row['request_throughput'], '.3f')} req/s, mean TTFT "
        f"{_f(row['mean_ttft_ms'], '.2f', 1e3)} s, mean ITL {_f(row['mean_itl_ms'], '.1f')} ms, "
        f"{_f(row['duration'], '.0f')} s, cached tokens {row['cached_tokens']}")
    if row["cached_tokens"]:
        log(f"[{mode}] C={conc}: WARNING {row['cached_tokens']} prompt tokens came from the cache")
    return row


# --- the results file -------------------------------------------------------------------------


def setup_of(args) -> dict:
    return {"model": args.model_path, "load_format": args.load_format,
            "input_len": args.input_len, "output_len": args.output_len,
            "prompts_per_concurrency": args.prompts_per_concurrency,
            "keep_ratio": args.keep_ratio, "prefix_policy": args.prefix_policy,
            "attention_backend": None if args.cpu else args.attention_backend,
            "mem_fraction_static": None if args.cpu else args.mem_fraction_static,
            "context_length": args.context_length,
            "chunked_prefill_size": args.chunked_prefill_size,
            "max_running_requests": args.max_running_requests,
            "cuda_graph_max_bs_decode": None if args.cpu else args.cuda_graph_max_bs_decode,
            "prefill_cuda_graph": args.prefill_cuda_graph,
            "extra_server_args": args.extra_server_args, "cpu": args.cpu,
            "radix_cache": "on; flushed before every measurement; every prompt starts with its "
                           "own token, so nothing is reused (cached_tokens per row)",
            "prefix_policy_note": f"--uniprefill-prefix-policy {args.prefix_policy} on both "
                                  "UniPrefill servers: no per-slot prefix checkpoint memory is "
                                  "taken from the KV pool (the prompts are unique anyway)"}


def load_results(path: Path, setup: dict, replace: bool) -> dict:
    if replace or not path.exists():
        return {"setup": setup, "modes": {}}
    results = json.loads(path.read_text())
    old = results.get("setup", {})
    diff = {k: (old.get(k), setup.get(k)) for k in SETUP_KEYS if old.get(k) != setup.get(k)}
    if diff:
        raise SystemExit(f"{path} was measured with other settings (file, now): {diff}; "
                         "use --replace to start a new file, or another --out")
    return results


def derive(results: dict) -> None:
    """The memory table and the summary rows, from every mode in the file."""
    modes = results["modes"]
    probes = {m: d["memory_probe"] for m, d in modes.items() if d.get("memory_probe")}
    dense = probes.get("dense", {}).get("total_bytes")
    results["memory_table"] = [
        {"mode": m, "prompt_tokens": p["prompt_tokens"], "kept_tokens": p["kept_tokens"],
         "slots_held": [s["slots_held"] for s in p["stages"]],
         "bytes": [s["bytes"] for s in p["stages"]], "total_bytes": p["total_bytes"],
         "total_gib": round(p["total_bytes"] / 2**30, 3),
         "fraction_of_dense": round(p["total_bytes"] / dense, 4) if dense else None,
         "pool_slots": [s["size"] for s in p["stages"]],
         "requests_that_fit": p["requests_that_fit"], "source": p["source"]}
        for m, p in sorted(probes.items(), key=lambda kv: MODES.index(kv[0]))]
    results["summary"] = [
        {"mode": m, "concurrency": row["concurrency"],
         "max_running": row["running"]["max_running"],
         "mean_running": row["running"]["mean_running"],
         **{k: row.get(k) for k in ("output_throughput", "request_throughput", "mean_ttft_ms",
                                    "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms",
                                    "median_itl_ms", "p99_itl_ms", "duration", "cached_tokens",
                                    "kept_fraction")}}
        for m in MODES if m in modes
        for _, row in sorted(modes[m].get("runs", {}).items(), key=lambda kv: int(kv[0]))
        if "error" not in row]


def _one_line(match) -> str:
    """A JSON list of plain values on one line; anything else (text in brackets) unchanged."""
    try:
        return json.dumps(json.loads(match.group(0)))
    except ValueError:
        return match.group(0)


def save_results(path: Path, results: dict, header: dict) -> None:
    derive(results)
    results["header"] = header
    ordered = {k: results[k] for k in ("header", "setup", "memory_table", "summary", "modes")}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    # Lists of plain values on one line each (the poller's samples would take thousands).
    text = re.sub(r"\[[^\[\]{}\"]*\]", _one_line, json.dumps(ordered, indent=1))
    tmp.write_text(text)
    os.replace(tmp, path)


def _f(x, spec: str = "", scale: float = 1.0) -> str:
    return "-" if x is None else format(x / scale if scale != 1.0 else x, spec)


def print_tables(results: dict) -> None:
    print("\n| mode | KV held by one request (GiB) | of dense | slots held per stage | "
          "requests the pools hold |\n|---|---|---|---|---|")
    for r in results["memory_table"]:
        print(f"| {r['mode']} | {_f(r['total_gib'], '.2f')} | {_f(r['fraction_of_dense'])} | "
              f"{r['slots_held']} | {_f(r['requests_that_fit'])} |")
    print("\n| mode | C | running max / mean | output tok/s | req/s | TTFT s mean / median / "
          "p99 | ITL ms mean / median / p99 | cached |\n|---|---|---|---|---|---|---|---|")
    for r in results["summary"]:
        ttft = " / ".join(_f(r[k], ".2f", 1e3) for k in ("mean_ttft_ms", "median_ttft_ms",
                                                          "p99_ttft_ms"))
        itl = " / ".join(_f(r[k], ".1f") for k in ("mean_itl_ms", "median_itl_ms", "p99_itl_ms"))
        print(f"| {r['mode']} | {r['concurrency']} | {r['max_running']} / "
              f"{_f(r['mean_running'])} | {_f(r['output_throughput'], '.0f')} | "
              f"{_f(r['request_throughput'], '.3f')} | {ttft} | {itl} | {_f(r['cached_tokens'])} |")


# --- one mode ---------------------------------------------------------------------------------


def run_mode(mode: str, args, model: str, cfg: dict, results: dict, header: dict,
             log_dir: Path, remaining) -> None:
    port = args.port or sp.free_port()
    cmd = server_cmd(mode, args, model, port)
    entry = results["modes"].setdefault(mode, {"runs": {}})
    entry.pop("error", None)
    entry.update(server_command=shlex.join(cmd), flags=mode_flags(mode, args))
    entry.setdefault("headers", []).append(header)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log(f"[{mode}] starting: {shlex.join(cmd)}")
    with sp.ServerProcess(cmd, log_dir / f"server_{mode}_{stamp}.log", server_env(args)) as server:
        startup = server.wait_healthy(min(args.start_timeout, remaining()))
        info = server_info(server.url)
        view = pool_view(info)
        entry["server"] = {
            "startup_s": round(startup, 1), "log": str(server.log_path),
            "max_total_num_tokens": view["max_total_num_tokens"],
            "max_running_requests": view["max_running_requests"],
            "chunked_prefill_size": info.get("chunked_prefill_size"),
            "attention_backend": info.get("attention_backend"),
            "kv_layout": (view["uniprefill"] or {}).get("kv_layout"),
            "kv_pools": kv_pools(view), "memory_usage": view["memory_usage"]}
        kv_gib = (view["memory_usage"] or {}).get("kvcache")
        if kv_gib and view["max_total_num_tokens"]:  # SGLang's own count, all KV buffers
            entry["server"]["kv_bytes_per_full_slot"] = round(
                kv_gib * 2**30 / view["max_total_num_tokens"])
        log(f"[{mode}] ready after {startup:.0f} s: {view['max_total_num_tokens']} KV slots, "
            f"pools {[(p['layers'], p['size']) for p in kv_pools(view) or []]}")
        rng = random.Random(0)
        if args.memory_probe_len:
            log(f"[{mode}] memory probe: {args.memory_probe_len} tokens, "
                f"{args.memory_probe_new_tokens} new")
            probe = memory_probe(server.url, args, cfg, info, rng)
            probe.update(date=header["date"], commit=header["commit"])
            entry["memory_probe"] = probe
            save_results(args.out, results, header)
            log(f"[{mode}] memory probe: {probe['total_bytes'] / 2**30:.2f} GiB of KV held "
                f"({probe['source']}), slots per stage "
                f"{[s['slots_held'] for s in probe['stages']]}, kept {probe['kept_tokens']}, "
                f"{probe['seconds']:.1f} s; the pools hold {probe['requests_that_fit']} such")
        elif not args.only_memory:  # the first request pays for kernel compilation; not timed
            log(f"[{mode}] warm-up: one {args.input_len}-token request")
            generate(server.url, prompt_ids(args.input_len, cfg["vocab_size"], rng, first=5), 8,
                     args.request_timeout)
        if args.only_memory:
            return
        for conc in args.concurrency:
            left = remaining() - args.stop_margin_s
            if left < 30:
                log(f"[{mode}] C={conc}: skipped, {remaining():.0f} s left before the deadline")
                continue
            try:
                row = run_point(server.url, model, mode, conc, args, cfg["vocab_size"], log_dir,
                                min(args.bench_timeout, left))
            except Exception as e:  # keep the other points
                log(f"[{mode}] C={conc} failed: {e!r}")
                row = {"concurrency": conc, "error": repr(e)}
                if not server.alive():
                    row["server_log_tail"] = server.log_tail(40)
            row.update(date=header["date"], commit=header["commit"])
            entry["runs"][str(conc)] = row
            save_results(args.out, results, header)
            if not server.alive():
                log(f"[{mode}] the server died:\n{server.log_tail(40)}")
                break
        log(f"[{mode}] stopping the server")


# --- main -------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, run in this order")
    ap.add_argument("--concurrency", default="8,16,32")
    ap.add_argument("--input-len", type=int, default=65536)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--prompts-per-concurrency", type=float, default=1.5,
                    help="N = max(4, ceil(this x C)) prompts per concurrency point")
    ap.add_argument("--memory-probe-len", type=int, default=131072, help="0: no memory probe")
    ap.add_argument("--memory-probe-new-tokens", type=int, default=8)
    ap.add_argument("--only-memory", action="store_true", help="the memory probe only")
    ap.add_argument("--model-path", default=DEFAULT_MODEL,
                    help="a folder with config.json (a tokenizer is added if it has none)")
    ap.add_argument("--load-format", default="dummy", help="'': the launcher's default")
    ap.add_argument("--keep-ratio", default="0.5,0.8")
    ap.add_argument("--stage-kv-fraction", help="--uniprefill-stage-kv-fraction for staged "
                    "(unset: the server's default, from the keep ratios)")
    ap.add_argument("--prefix-policy", default="reuse-sparse")
    ap.add_argument("--attention-backend", default="flashinfer")
    ap.add_argument("--mem-fraction-static", type=float, default=0.85)
    ap.add_argument("--context-length", type=int, default=131200,
                    help="the same for every mode and invocation (it sizes SGLang's request "
                         "pool); must hold the probe and input + output")
    ap.add_argument("--max-running-requests", type=int)
    ap.add_argument("--chunked-prefill-size", type=int, help="unset: SGLang's default")
    ap.add_argument("--cuda-graph-max-bs-decode", type=int, default=64)
    ap.add_argument("--prefill-cuda-graph", action="store_true",
                    help="keep SGLang's prefill CUDA graphs (off by default: faster start)")
    ap.add_argument("--extra-server-args", default="", help="more launcher flags, every mode")
    ap.add_argument("--cpu", action="store_true", help="SGLang's CPU engine (smoke test)")
    ap.add_argument("--port", type=int, default=0, help="0: a free port")
    ap.add_argument("--poll-interval", type=float, default=0.5)
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--bench-timeout", type=float, default=1800)
    ap.add_argument("--deadline-s", type=float, default=0,
                    help="seconds from the start after which nothing new begins and a running "
                         "bench_serving is stopped (0: none); the GPU's command limit is 600")
    ap.add_argument("--stop-margin-s", type=float, default=40,
                    help="time kept before the deadline to stop the server and write the file")
    ap.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "uniprefill-models"),
                    help="where a model folder without a tokenizer gets one")
    ap.add_argument("--log-dir", help="server and bench_serving logs (default: --out's name "
                                      "without .json, plus _logs)")
    ap.add_argument("--out", help="results JSON (merged with what is there)")
    ap.add_argument("--replace", action="store_true", help="start --out anew")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, start nothing")
    args = ap.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        ap.error(f"unknown modes {bad}; choose from {', '.join(MODES)}")
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    if not args.dry_run and not args.out:
        ap.error("--out is required (or --dry-run)")
    need = max(args.input_len + args.output_len,
               args.memory_probe_len + args.memory_probe_new_tokens)
    if need > args.context_length:
        ap.error(f"--context-length {args.context_length} < {need} tokens a request needs")
    # As given (the results file compares it between invocations), read from here or the repo.
    args.model_src = Path(args.model_path)
    if not args.model_src.exists() and (REPO / args.model_path).exists():
        args.model_src = REPO / args.model_path
    return args


def model_folder(args, create: bool) -> str:
    src = args.model_src
    if (src / "tokenizer.json").exists() or (src / "tokenizer_config.json").exists():
        return str(src)
    dst = Path(args.model_dir) / src.resolve().name
    return prepare(str(src), str(dst)) if create else str(dst)


def dry_run(args, model: str, cfg: dict) -> None:
    print(f"# model folder: {model} (from {args.model_src})")
    print(f"# server environment: SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1"
          f"{' plus the CPU engine variables' if args.cpu else ''}")
    url = f"http://{sp.HOST}:{args.port or 30000}"
    for mode in args.modes:
        print(f"\n# --- {mode}")
        print(shlex.join(server_cmd(mode, args, model, args.port or 30000)))
        if args.memory_probe_len:
            print(f"# memory probe: POST {url}/generate, {args.memory_probe_len} random ids, "
                  f"max_new_tokens {args.memory_probe_new_tokens}; pools from {url}/server_info")
        elif not args.only_memory:
            print(f"# warm-up: POST {url}/generate, {args.input_len} ids, max_new_tokens 8")
        if args.only_memory:
            continue
        for conc in args.concurrency:
            out = Path("<log-dir>") / f"bench_{mode}_{args.input_len}_{conc}.jsonl"
            cmd, _, _ = bench_cmd(url, model, conc, args, cfg["vocab_size"], out)
            print(f"# C={conc}: POST {url}/flush_cache, then (polling {url}/v1/loads and "
                  f"{url}/server_info every {args.poll_interval} s)")
            print(shlex.join(cmd))


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = json.loads((args.model_src / "config.json").read_text())
    if args.dry_run:
        dry_run(args, model_folder(args, create=False), cfg)
        return 0
    args.out = Path(args.out)
    log_dir = Path(args.log_dir) if args.log_dir else args.out.with_name(args.out.stem + "_logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    model = model_folder(args, create=True)
    name = Path(args.model_path).name
    header = result_header(
        model=args.model_path if args.load_format != "dummy" else f"{name} shape, random weights",
        note=f"the latest invocation (modes {','.join(args.modes)}, concurrency "
             f"{args.concurrency}); each mode lists its invocations under modes.<mode>.headers")
    results = load_results(args.out, setup_of(args), args.replace)
    deadline = T0 + args.deadline_s if args.deadline_s else float("inf")

    def remaining() -> float:
        return deadline - time.monotonic()

    log(f"modes {args.modes}, concurrency {args.concurrency}, {args.input_len} in / "
        f"{args.output_len} out; results {args.out}, logs {log_dir}")
    failed = False
    for mode in args.modes:
        if remaining() < MIN_MODE_S + args.stop_margin_s:
            log(f"[{mode}] skipped: {remaining():.0f} s left before the deadline")
            failed = True
            continue
        try:
            run_mode(mode, args, model, cfg, results, header, log_dir, remaining)
        except Exception as e:
            log(f"[{mode}] failed: {e!r}")
            results["modes"].setdefault(mode, {"runs": {}})["error"] = repr(e)
            failed = True
        save_results(args.out, results, header)
    print_tables(results)
    log(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
