"""Where a step's time goes: a dense and a UniPrefill request of one length, one engine.

Runs a dense request (UniPrefill switched off per request) and a UniPrefill request of the same
length in one engine (bench_prefill's Runner), records steps of each with SGLang's torch
profiler (CPU + GPU activities, Python stacks) and summarises each trace:

* `--phase decode` (default): the decode ITL of both requests, then N decode steps of each;
  wall time per step (between CUDA-graph launches) against GPU kernel time per step (a step
  whose wall time exceeds its kernel time waits on the host);
* `--phase prefill`: the prefill step of both (SGLang's default chunking unless
  `--chunked-prefill-size -1`), with the time between its first kernel and its last, kernel time
  by kind (attention, GEMM, UniPrefill scoring / selection, other) and the GPU idle time;
* `--phase followup`: a cached document of `--length` tokens, then 100-token follow-ups over it
  (the radix cache and SGLang's prefill CUDA graphs on, UniPrefill's defaults unless
  `--keep-ratio` is given): each follow-up's latency, then one follow-up step recorded and
  summarised as a prefill; the dense mode's document and follow-ups run with UniPrefill off, so
  its cached KV is complete;
* all: synchronising CUDA runtime calls with the Python frames that made them (a sync in step
  preparation stops the overlap scheduler from preparing the next step while this one runs; in
  a prefill it idles the GPU until the host launches again), and host time spent in
  `uniprefill_sglang` functions.

    python benchmarks/profile_steps.py --model-path benchmarks/models/llama-3.1-8b \\
        --length 32768 --out-dir /tmp/decode_profile
    python benchmarks/profile_steps.py --model-path benchmarks/models/llama-3.1-8b \\
        --phase prefill --length 8192 --chunked-prefill-size -1 --out-dir /tmp/prefill_profile
    python benchmarks/profile_steps.py --model-path benchmarks/models/llama-3.1-8b \\
        --phase followup --length 32768 --keep-ratio default --out-dir /tmp/followup_profile
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import gzip
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_prefill import Runner, engine_kwargs_for  # noqa: E402
from defaults import request_stages  # noqa: E402
from result_header import result_header  # noqa: E402

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cudaMemcpy")  # cudaMemcpy (not ...Async) blocks the host too
STEP_MARK = "cudaGraphLaunch"  # one per decode step (decode CUDA graphs)
KERNEL_KINDS = (  # first match wins
    ("uniprefill", ("_score_", "_select_kernel")),
    ("attention", ("flashinfer::Batch", "PrefillWith", "DecodeWith", "MergeStates", "fmha",
                   "flash_fwd", "_fwd_kernel")),
    ("gemm", ("nvjet", "gemm", "Gemm", "cutlass", "splitKreduce", "cublas")),
)


def kernel_kind(name: str) -> str:
    for kind, needles in KERNEL_KINDS:
        if any(n in name for n in needles):
            return kind
    return "other"


def _profile_req(out_dir: Path, steps: int, gpu: bool = True, stacks: bool = True):
    from sglang.srt.managers.io_struct import ProfileReq

    return ProfileReq(output_dir=str(out_dir), activities=["CPU", "GPU"] if gpu else ["CPU"],
                      with_stack=stacks, record_shapes=False, num_steps=steps)


async def _profiled_decode(engine, runner, length, custom, steps, out_dir, gpu,
                           warm_tokens=16):
    """Stream one request; once it decodes, profile `steps` scheduler steps."""
    params = {"max_new_tokens": warm_tokens + steps + 32, "temperature": 0.0,
              "ignore_eos": True, "custom_params": custom}
    stream = await engine.async_generate(input_ids=runner.ids(length), sampling_params=params,
                                         stream=True)
    n = 0
    async for _ in stream:
        n += 1
        if n == warm_tokens:
            await engine.tokenizer_manager.start_profile(_profile_req(out_dir, steps, gpu))


async def _profiled_prefill(engine, runner, length, custom, steps, out_dir, gpu):
    """Profile the next `steps` scheduler steps: the prefill of one request (and its chunks)."""
    await engine.tokenizer_manager.start_profile(_profile_req(out_dir, steps, gpu))
    await engine.async_generate(input_ids=runner.ids(length), sampling_params={
        "max_new_tokens": 1, "temperature": 0.0, "custom_params": custom})


FOLLOW_UP_TOKENS = 100


async def _profiled_followup(engine, runner, length, custom, steps, out_dir, gpu, stacks=True):
    """Profile one follow-up step over the document `runner.doc` cached for these knobs."""
    await engine.tokenizer_manager.start_profile(_profile_req(out_dir, steps, gpu, stacks))
    # One token more than the profiled steps: the step after the last one stops the profiler.
    await engine.async_generate(input_ids=runner.doc[custom_key(custom)] + runner.ids(
        FOLLOW_UP_TOKENS), sampling_params={"max_new_tokens": steps + 1, "temperature": 0.0,
                                            "custom_params": custom})


def custom_key(custom: dict) -> str:
    return json.dumps(custom, sort_keys=True)


def _measure_followups(runner, args, modes, result) -> None:
    """Per mode: its own document (cached by the first request), then 3 timed follow-ups."""
    runner.doc = {}
    for name, custom in modes.items():
        doc = runner.doc[custom_key(custom)] = runner.ids(args.length)
        params = {"max_new_tokens": 1, "temperature": 0.0, "custom_params": custom}
        runner.engine.generate(input_ids=doc, sampling_params=params)
        times, metas, stages = [], [], []
        for _ in range(4):  # the first one warms this mode's path
            start = time.perf_counter()
            out = runner.engine.generate(input_ids=doc + runner.ids(FOLLOW_UP_TOKENS),
                                         sampling_params=params)
            times.append(time.perf_counter() - start)
            metas.append((out["meta_info"].get("uniprefill") or [{}])[-1])
            stages.append(request_stages(out["meta_info"]))
        result["ttft_s"][name] = times
        result["kept"][name] = metas[-1]
        if any(stages):
            result.setdefault("request_stages_ms", {})[name] = stages
            print(f"{name}: request stages (ms) {stages[1:]}", flush=True)
        print(f"{name}: follow-ups {[round(t * 1e3, 1) for t in times]} ms, {metas[-1]}",
              flush=True)


def summarize(trace_path: str, phase: str = "decode") -> dict:
    with gzip.open(trace_path, "rt") if trace_path.endswith(".gz") else open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    kernels_all = [e for e in events if e.get("cat") == "kernel"]
    if phase == "decode":
        marks = sorted(e["ts"] for e in events if e["name"] == STEP_MARK)
        if len(marks) < 3:
            return {"trace": os.path.basename(trace_path), "error": f"{len(marks)} graph launches"}
        t0, t1, steps = marks[0], marks[-1], len(marks) - 1
    else:  # the whole recorded prefill: first kernel start to last kernel end
        if not kernels_all:
            return {"trace": os.path.basename(trace_path), "error": "no kernels"}
        t0 = min(e["ts"] for e in kernels_all)
        t1 = max(e["ts"] + e["dur"] for e in kernels_all)
        steps = 1
    inside = [e for e in events if t0 <= e["ts"] < t1]
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in inside if e.get("cat") == "kernel")
    busy, end = 0.0, t0
    for a, b in kernels:  # union of kernel intervals
        if b > end:
            busy += b - max(a, end)
            end = b
    by_kind = collections.Counter()
    for e in inside:
        if e.get("cat") == "kernel":
            by_kind[kernel_kind(e["name"])] += e["dur"]
    python = collections.defaultdict(list)
    for e in inside:
        if e.get("cat") == "python_function":
            python[(e["pid"], e["tid"])].append(e)

    def frames(e):
        enclosing = [p for p in python[(e["pid"], e["tid"])]
                     if p["ts"] <= e["ts"] and p["ts"] + p["dur"] >= e["ts"] + e["dur"]]
        enclosing.sort(key=lambda p: p["ts"])
        return [p["name"] for p in enclosing]

    syncs = [e for e in inside if e.get("cat") == "cuda_runtime" and e["name"] in SYNC_CALLS]
    by_site = collections.Counter()
    site_us = collections.Counter()
    for e in syncs[:400]:
        stack = [f for f in frames(e) if not f.startswith("torch/") and "/torch/" not in f][-6:]
        site = " <- ".join(reversed(stack)) or "(no python frame)"
        by_site[site] += 1
        site_us[site] += e["dur"]
    ours, host = collections.Counter(), collections.Counter()
    for evs in python.values():
        for e in evs:
            if "uniprefill_sglang" in e["name"]:
                ours[e["name"]] += e["dur"]
            if "sglang/srt/" in e["name"] or "uniprefill_sglang" in e["name"]:
                host[e["name"]] += e["dur"]  # inclusive: nested frames count in each
    per_step = 1e3 * steps  # us -> ms per step
    return {
        "trace": os.path.basename(trace_path),
        "phase": phase,
        "steps": steps,
        "wall_ms_per_step": (t1 - t0) / per_step,
        "gpu_busy_ms_per_step": busy / per_step,
        "gpu_idle_ms_per_step": (t1 - t0 - busy) / per_step,
        "kernel_ms_per_step_by_kind": {k: v / per_step for k, v in by_kind.most_common()},
        "syncs_per_step": len(syncs) / steps,
        "sync_ms_per_step": sum(e["dur"] for e in syncs) / per_step,
        "sync_sites": [{"count": c, "ms_total": site_us[s] / 1e3, "site": s}
                       for s, c in by_site.most_common(12)],
        "uniprefill_host_ms_per_step": {k: v / per_step for k, v in ours.most_common(15)},
        # The same for every engine frame, so that a stock trace compares with the plugin's.
        "engine_host_ms_per_step": {k: v / per_step for k, v in host.most_common(40)},
        "graph_launches_per_step": sum(
            e["name"] == STEP_MARK for e in inside) / steps,
    }


def _measure_itl(runner, args, modes, result) -> None:
    for _ in range(2):  # alternate, so drift hits both alike
        for name, custom in modes.items():
            _, metas, _, own = runner.batch(args.length, custom, 1,
                                            decode_tokens=args.decode_tokens)
            result["itl_ms"].setdefault(name, []).extend(g * 1e3 for g in own)
            result["kept"][name] = metas[0].get("kept_tokens")
    for name in modes:
        itl = result["itl_ms"][name]
        result["itl_ms"][name] = {"mean": statistics.mean(itl), "median": statistics.median(itl)}
        print(f"{name}: decode ITL mean {result['itl_ms'][name]['mean']:.2f} ms, median "
              f"{result['itl_ms'][name]['median']:.2f} ms", flush=True)


def _measure_ttft(runner, args, modes, result) -> None:
    """Each mode's median TTFT over three fresh prompts, the modes taking turns."""
    times = {name: [] for name in modes}
    for _ in range(3):
        for name, custom in modes.items():
            seconds, metas, _, _ = runner.batch(args.length, custom, 1)
            times[name].append(seconds[0])
            result["kept"][name] = metas[0].get("kept_tokens")
    for name, values in times.items():
        result["ttft_s"][name] = median = statistics.median(values)
        print(f"{name}: TTFT {median:.3f} s (of {values}), kept per stage "
              f"{result['kept'][name]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--phase", choices=("decode", "prefill", "followup"), default="decode")
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--keep-ratio", default="0.5,0.8",
                    help="'default': the server's defaults (top-p)")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--profile-steps", type=int, default=None,
                    help="steps to record (default: 20 decode steps, or the prefill's chunks)")
    ap.add_argument("--attention-backend", default="flashinfer")
    ap.add_argument("--mem-fraction-static", type=float, default=0.8)
    ap.add_argument("--chunked-prefill-size", default="default")
    ap.add_argument("--device", default="cuda",
                    help="'cpu': a smoke run of the script on SGLang's CPU engine (no GPU figures)")
    ap.add_argument("--as-served", action="store_true",
                    help="the radix cache and SGLang's prefill CUDA graphs on in every phase, as "
                         "`--enable-uniprefill` alone serves (always so in the followup phase)")
    ap.add_argument("--stock", action="store_true",
                    help="SGLang without the plugin (SGLANG_PLUGINS=none), one mode: the "
                         "reference the plugin's engine is compared with")
    ap.add_argument("--extra", default="{}",
                    help='JSON: more Engine arguments, e.g. {"enable_metrics": true} (request '
                         'stages in the followup phase) or {"disable_overlap_schedule": true}')
    ap.add_argument("--no-stacks", action="store_true",
                    help="followup phase: record no Python stacks (host timing close to an "
                         "unprofiled step; syncs keep their waits, lose their call sites)")
    ap.add_argument("--out-dir", required=True)
    args = ap.parse_args()
    args.tp_size, args.drop_layers = 1, None
    if args.device == "cpu":
        from uniprefill_sglang.tools.cpu_engine import activate_cpu_engine_env

        activate_cpu_engine_env()
    os.environ.setdefault("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "1")
    if args.stock:
        os.environ["SGLANG_PLUGINS"] = "none"
    import sglang

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.load(open(f"{args.model_path}/config.json"))
    kwargs = engine_kwargs_for(args, [args.length + args.decode_tokens + 128])
    as_served = args.phase == "followup" or args.as_served
    extra = json.loads(args.extra)
    if as_served:  # the radix cache and prefill graphs on
        kwargs.pop("cuda_graph_backend_prefill")
        kwargs["disable_radix_cache"] = False
    if args.stock:
        kwargs.pop("enable_uniprefill")
    kwargs.update(extra)
    engine = sglang.Engine(**kwargs)
    chunk = engine.get_server_info().get("chunked_prefill_size") or -1
    steps = args.profile_steps or (
        20 if args.phase == "decode" else 1 if args.phase == "followup"
        else max(1, -(-args.length // chunk) if chunk > 0 else 1))
    runner = Runner(engine, cfg["vocab_size"], kwargs["context_length"])
    uniprefill = {} if args.keep_ratio == "default" else {"uniprefill_keep_ratio": args.keep_ratio}
    modes = {"stock": {}} if args.stock else {"dense": {"uniprefill": False},
                                                "uniprefill": uniprefill}
    result = {"header": result_header(model=args.model_path), "phase": args.phase,
              "length": args.length, "keep_ratio": args.keep_ratio,
              "chunked_prefill_size": chunk, "profile_steps": steps,
              "as_served": as_served, "extra_engine_args": extra,
              "itl_ms": {}, "ttft_s": {}, "kept": {}, "profile": {}}
    try:
        for custom in modes.values():  # warm-up
            runner.batch(args.length, custom, 1, decode_tokens=4)
        measure = {"decode": _measure_itl, "prefill": _measure_ttft,
                   "followup": _measure_followups}[args.phase]
        measure(runner, args, modes, result)
        for name, custom in modes.items():
            before = set(glob.glob(str(out / "*.trace.json*")))
            profiled = {"decode": _profiled_decode, "prefill": _profiled_prefill,
                        "followup": functools.partial(_profiled_followup,
                                                      stacks=not args.no_stacks)}[args.phase]
            engine.loop.run_until_complete(
                profiled(engine, runner, args.length, custom, steps, out, args.device == "cuda"))
            new = set()
            for _ in range(120):  # the scheduler writes the trace after the last step
                new = set(glob.glob(str(out / "*.trace.json*"))) - before
                if new:
                    time.sleep(2)
                    break
                time.sleep(1)
            for path in sorted(new):
                summary = summarize(path, "decode" if args.phase == "decode" else "prefill")
                os.rename(path, out / f"{args.phase}_{name}.trace.json.gz")
                result["profile"][name] = summary
                print(json.dumps({name: summary}, indent=1), flush=True)
    finally:
        (out / "summary.json").write_text(json.dumps(result, indent=1))
        engine.shutdown()


if __name__ == "__main__":
    main()
