"""Where a decode step's time goes: a dense and a UniPrefill request of one length, one engine.

Measures the decode ITL of a request after its drops against a dense request of the same length
(bench_prefill's Runner, one engine, dense = UniPrefill switched off per request), then records
a few decode steps of each with SGLang's torch profiler (CPU + GPU activities, Python stacks)
and summarises each trace:

* wall time per step (between CUDA-graph launches) and GPU kernel time per step: a step whose
  wall time exceeds its kernel time waits on the host;
* synchronising CUDA runtime calls per step, with the Python frames that made them (a sync in
  step preparation stops the overlap scheduler from preparing step n+1 while step n runs);
* host time per step inside `uniprefill_sglang` functions.

    python benchmarks/profile_decode.py --model-path benchmarks/models/llama-3.1-8b \\
        --length 32768 --out-dir /tmp/decode_profile
"""

from __future__ import annotations

import argparse
import asyncio
import collections
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

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cudaMemcpy")  # cudaMemcpy (not ...Async) blocks the host too
STEP_MARK = "cudaGraphLaunch"


async def _profiled_decode(engine, runner, length, custom, warm_tokens, steps, out_dir):
    """Stream one request; once it decodes, profile `steps` scheduler steps."""
    from sglang.srt.managers.io_struct import ProfileReq

    params = {"max_new_tokens": warm_tokens + steps + 32, "temperature": 0.0,
              "ignore_eos": True, "custom_params": custom}
    stream = await engine.async_generate(input_ids=runner.ids(length), sampling_params=params,
                                         stream=True)
    n = 0
    async for _ in stream:
        n += 1
        if n == warm_tokens:
            await engine.tokenizer_manager.start_profile(ProfileReq(
                output_dir=str(out_dir), activities=["CPU", "GPU"], with_stack=True,
                record_shapes=False, num_steps=steps))


def summarize(trace_path: str) -> dict:
    with gzip.open(trace_path, "rt") if trace_path.endswith(".gz") else open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    marks = sorted(e["ts"] for e in events if e["name"] == STEP_MARK)
    if len(marks) < 3:
        return {"trace": os.path.basename(trace_path), "error": f"{len(marks)} graph launches"}
    t0, t1 = marks[0], marks[-1]
    steps = len(marks) - 1
    inside = [e for e in events if t0 <= e["ts"] < t1]
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in inside if e.get("cat") == "kernel")
    busy, end = 0.0, t0
    for a, b in kernels:  # union of kernel intervals
        if b > end:
            busy += b - max(a, end)
            end = b
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
    ours = collections.Counter()
    for evs in python.values():
        for e in evs:
            if "uniprefill_sglang" in e["name"]:
                ours[e["name"]] += e["dur"]
    return {
        "trace": os.path.basename(trace_path),
        "steps": steps,
        "wall_ms_per_step": (t1 - t0) / steps / 1e3,
        "gpu_busy_ms_per_step": busy / steps / 1e3,
        "syncs_per_step": len(syncs) / steps,
        "sync_ms_per_step": sum(e["dur"] for e in syncs) / steps / 1e3,
        "sync_sites": [{"count": c, "ms_total": site_us[s] / 1e3, "site": s}
                       for s, c in by_site.most_common(12)],
        "uniprefill_host_ms_per_step": {k: v / steps / 1e3 for k, v in ours.most_common(15)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--keep-ratio", default="0.5,0.8")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--profile-steps", type=int, default=20)
    ap.add_argument("--attention-backend", default="flashinfer")
    ap.add_argument("--mem-fraction-static", type=float, default=0.8)
    ap.add_argument("--chunked-prefill-size", default="default")
    ap.add_argument("--out-dir", required=True)
    args = ap.parse_args()
    args.tp_size, args.drop_layers, args.device = 1, None, "cuda"
    os.environ.setdefault("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "1")
    import sglang

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.load(open(f"{args.model_path}/config.json"))
    kwargs = engine_kwargs_for(args, [args.length + args.decode_tokens + args.profile_steps + 64])
    engine = sglang.Engine(**kwargs)
    runner = Runner(engine, cfg["vocab_size"], kwargs["context_length"])
    modes = {"dense": {"uniprefill": False}, "uniprefill": {"uniprefill_keep_ratio": args.keep_ratio}}
    result = {"length": args.length, "keep_ratio": args.keep_ratio, "itl_ms": {}, "profile": {}}
    try:
        for custom in modes.values():  # warm-up
            runner.batch(args.length, custom, 1, decode_tokens=4)
        for _ in range(2):  # alternate, so drift hits both alike
            for name, custom in modes.items():
                _, metas, _, own = runner.batch(args.length, custom, 1,
                                                decode_tokens=args.decode_tokens)
                result["itl_ms"].setdefault(name, []).extend(g * 1e3 for g in own)
                result.setdefault("kept", {})[name] = metas[0].get("kept_tokens")
        for name in modes:
            itl = result["itl_ms"][name]
            result["itl_ms"][name] = {"mean": statistics.mean(itl), "median": statistics.median(itl)}
            print(f"{name}: decode ITL mean {result['itl_ms'][name]['mean']:.2f} ms, median "
                  f"{result['itl_ms'][name]['median']:.2f} ms", flush=True)
        for name, custom in modes.items():
            before = set(glob.glob(str(out / "*.trace.json*")))
            engine.loop.run_until_complete(_profiled_decode(
                engine, runner, args.length, custom, 16, args.profile_steps, out))
            for _ in range(120):  # the scheduler writes the trace after the last step
                new = set(glob.glob(str(out / "*.trace.json*"))) - before
                if new:
                    time.sleep(2)
                    break
                time.sleep(1)
            for path in sorted(new):
                summary = summarize(path)
                os.rename(path, out / f"{name}.trace.json.gz")
                result["profile"][name] = summary
                print(json.dumps({name: summary}, indent=1), flush=True)
    finally:
        (out / "summary.json").write_text(json.dumps(result, indent=1))
        engine.shutdown()


if __name__ == "__main__":
    main()
