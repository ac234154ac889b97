"""What `--enable-uniprefill` alone costs or saves against stock SGLang, workload by workload.

Each configuration runs in a process of its own (one `sglang.Engine`, SGLang's defaults:
chunked prefill, prefill CUDA graphs, radix cache on), over the same prompts:

* ``stock``: SGLang without the plugin (``SGLANG_PLUGINS=none``: the entry point is not loaded);
* ``defaults``: ``enable_uniprefill=True`` and nothing else;
* ``staged``: the defaults with ``uniprefill_kv_layout="staged"``;
* ``keep``: the defaults with ``uniprefill_keep_ratio="0.5,0.8"`` (random weights make top-p keep
  almost everything, so this row shows the speed a real model's drops buy);
* ``keep_every_step``: ``keep`` with the cost rule off (``uniprefill_min_prompt_tokens=0``), to
  find the step size below which a drop does not pay.

Workloads: 64 prompts of 200-1200 tokens in one call, first after start-up (first call and best
of 3); one request at each of ``--lengths`` (time to first token, ``max_new_tokens=1``; the
plugin's rows also run the longest prompt at top-p 1.0 and dense per request, and compare their
16 greedy tokens); 16 prompts of 2K-6K tokens in one call; a cached document of ``--doc-tokens`` with 3 follow-up
questions of 100 tokens (each follow-up's latency); decode inter-token latency after an 8K
prompt; ``max_total_num_tokens`` at start-up. Prompts are random token ids that differ from the
first token on (no accidental cache hits), the same in every configuration.

    python benchmarks/defaults.py --model-path benchmarks/models/llama-3.1-8b \\
        --configs stock defaults keep --out defaults_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

CONFIGS = {
    "stock": {},
    "defaults": {"enable_uniprefill": True},
    "staged": {"enable_uniprefill": True, "uniprefill_kv_layout": "staged"},
    "keep": {"enable_uniprefill": True, "uniprefill_keep_ratio": "0.5,0.8"},
    # The cost rule off: where a drop stops paying for itself (its break-even).
    "keep_every_step": {"enable_uniprefill": True, "uniprefill_keep_ratio": "0.5,0.8",
                        "uniprefill_min_prompt_tokens": 0},
}
WORKLOADS = ("short", "single", "mid", "follow", "decode")


def _ids(rng: random.Random, n: int, vocab: int) -> list:
    return [rng.randrange(10, vocab - 10) for _ in range(n)]


def _timed(engine, prompts, params):
    """(seconds, output); a request that failed gives its error as the output."""
    start = time.perf_counter()
    try:
        out = engine.generate(input_ids=prompts, sampling_params=params)
    except Exception as error:  # sglang.Engine raises what a client would get as an error
        out = {"error": f"{type(error).__name__}: {error}"[:500], "meta_info": {},
               "output_ids": None}
    return time.perf_counter() - start, out


def _meta(out) -> dict:
    if not isinstance(out, dict):  # a batch: its first request's
        out = out[0]
    if "error" in out:
        return {"error": out["error"]}
    entries = out["meta_info"].get("uniprefill") or []
    if not entries:
        return {}
    last = entries[-1]
    return {"reason": last.get("reason"), "kept_tokens": last.get("kept_tokens"),
            "prefix": last.get("prefix"), "finish": out["meta_info"].get("finish_reason")}


def run_config(name: str, args) -> dict:
    """One configuration's workloads (called in a process whose plugins match `name`)."""
    if args.device == "cpu":  # a smoke run of this script on SGLang's CPU engine
        from uniprefill_sglang.tools.cpu_engine import activate_cpu_engine_env

        activate_cpu_engine_env()
    import sglang

    from uniprefill_sglang.tools.cpu_engine import flush_cache as flush

    cfg = json.load(open(os.path.join(args.model_path, "config.json")))
    vocab = cfg["vocab_size"]
    lengths = [int(x) for x in args.lengths.split(",")]
    # The model's own context length unless the longest prompt needs more.
    needed = max(lengths) + 64  # the 16 greedy tokens and the decode probe fit
    context = {} if cfg.get("max_position_embeddings", 0) >= needed else {
        "context_length": needed}
    device = dict(device="cpu", attention_backend="torch_native", dtype="float32",
                  max_total_tokens=4 * max(lengths), disable_cuda_graph=True) \
        if args.device == "cpu" else dict(attention_backend=args.attention_backend)
    engine = sglang.Engine(model_path=args.model_path, load_format="dummy", random_seed=0,
                           log_level="error", skip_tokenizer_init=True, **context, **device,
                           **CONFIGS[name],
                           **json.loads(args.extra))
    info = engine.get_server_info()
    memory = info["internal_states"][0].get("memory_usage") or {}
    result = {"config": name, "flags": CONFIGS[name], "memory_usage_gb": memory,
              "sglang_chose": {k: info.get(k) for k in (
                  "chunked_prefill_size", "mem_fraction_static", "attention_backend",
                  "cuda_graph_backend_prefill", "disable_radix_cache", "uniprefill_kv_layout",
                  "uniprefill_prefix_policy", "uniprefill_top_p")},
              "max_total_num_tokens": memory.get("token_capacity")}
    rng = random.Random(args.seed)
    one = {"temperature": 0.0, "max_new_tokens": 1}
    plugin = name != "stock"

    def save():
        with open(args.partial, "w") as f:
            json.dump(result, f, indent=1)

    # The short batch comes first: its first call is the first work after start-up.
    n_short, n_mid = [int(x) for x in args.batch_sizes.split(",")]
    todo = set(args.workloads.split(","))
    short = [_ids(rng, rng.randint(200, 1200), vocab) for _ in range(n_short)]
    times = []
    for _ in range(3 if "short" in todo else 0):
        seconds, _ = _timed(engine, short, one)
        times.append(round(seconds, 4))
        flush(engine)
    if times:
        result["short_batch"] = {"first_s": times[0], "best_s": min(times)}
    result["single"] = {}
    for n in lengths if "single" in todo else []:
        prompt = _ids(rng, n, vocab)
        seconds, out = _timed(engine, prompt, one)
        row = {"ttft_s": round(seconds, 4), **_meta(out)}
        if plugin and n == max(lengths):
            greedy = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
            flush(engine)
            seconds, top1 = _timed(engine, prompt, {**greedy, "custom_params": {
                "uniprefill_top_p": 1.0}})
            flush(engine)
            _, dense = _timed(engine, prompt, {**greedy, "custom_params": {"uniprefill": False}})
            row["top_p_1"] = {"seconds_16_tokens": round(seconds, 4), **_meta(top1),
                              "equal_to_dense": top1["output_ids"] == dense["output_ids"]}
        result["single"][str(n)] = row
        flush(engine)
        save()
    top = min(6144, max(lengths))
    mid = [_ids(rng, rng.randint(top // 3, top), vocab) for _ in range(n_mid)]
    if "mid" in todo:
        seconds, _ = _timed(engine, mid, one)
        result["mid_batch"] = {"seconds": round(seconds, 4)}
        flush(engine)
        save()
    result["follow_ups"] = {}
    for doc_len in [int(x) for x in args.doc_tokens.split(",")] if "follow" in todo else []:
        doc = _ids(rng, doc_len, vocab)
        first, _ = _timed(engine, doc + _ids(rng, 100, vocab), one)
        follow = []
        for _ in range(3):
            seconds, out = _timed(engine, doc + _ids(rng, 100, vocab), one)
            follow.append({"seconds": round(seconds, 4),
                           "cached_tokens": out["meta_info"].get("cached_tokens"),
                           **_meta(out)})
        result["follow_ups"][str(doc_len)] = {"first_s": round(first, 4), "follow": follow}
        flush(engine)
        save()
    prompt = _ids(rng, min(8192, max(lengths)), vocab)
    if "decode" not in todo:
        save()
        engine.shutdown()
        return result
    t_first, _ = _timed(engine, prompt, one)
    flush(engine)
    t_all, _ = _timed(engine, prompt, {"temperature": 0.0, "max_new_tokens": 65,
                                       "ignore_eos": True})
    result["decode_itl_ms"] = round((t_all - t_first) / 64 * 1000, 3)
    save()
    engine.shutdown()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--lengths", default="8192,32768,131000")
    ap.add_argument("--doc-tokens", default="32768,65536")
    ap.add_argument("--attention-backend", default="flashinfer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-sizes", default="64,16",
                    help="prompts in the short (200-1200 tokens) and 2K-6K batches")
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help=f"comma-separated, of {', '.join(WORKLOADS)}")
    ap.add_argument("--per-config", default="{}",
                    help='JSON: per configuration, arguments that replace these, e.g. '
                         '{"keep_every_step": {"lengths": "512,1024", "workloads": "single"}}')
    ap.add_argument("--extra", default="{}", help="JSON: more Engine arguments, every row")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run on SGLang's CPU engine")
    ap.add_argument("--out", required=True)
    ap.add_argument("--one-config", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--partial", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one_config:  # a child process: one configuration
        run_config(args.one_config, args)
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from result_header import result_header

    out = {"header": result_header(), "rows": []}
    for name in args.configs:
        partial = f"{args.out}.{name}.partial.json"
        env = dict(os.environ)
        if name == "stock":
            env["SGLANG_PLUGINS"] = "none"
        mine = {**vars(args), **json.loads(args.per_config).get(name, {})}
        cmd = [sys.executable, os.path.abspath(__file__), "--model-path", args.model_path,
               "--lengths", mine["lengths"], "--doc-tokens", args.doc_tokens,
               "--workloads", mine["workloads"],
               "--attention-backend", args.attention_backend, "--seed", str(args.seed),
               "--batch-sizes", args.batch_sizes, "--extra", args.extra, "--device", args.device,
               "--out", args.out, "--one-config", name, "--partial", partial]
        code = subprocess.call(cmd, env=env)
        row = json.load(open(partial)) if os.path.exists(partial) else {"config": name}
        row["exit_code"] = code
        out["rows"].append(row)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
