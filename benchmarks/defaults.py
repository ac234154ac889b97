"""What `--enable-uniprefill` alone costs or saves against stock SGLang, workload by workload.

Each configuration runs in a process of its own (one `sglang.Engine`, SGLang's defaults:
chunked prefill, prefill CUDA graphs, radix cache on; with ``--rounds N``, N processes each,
the configurations taking turns, and a summary of the medians over rounds), over the same
prompts:

* ``stock``: SGLang without the plugin (``SGLANG_PLUGINS=none``: the entry point is not loaded),
  as SGLang configures itself: no backend flag (fa3 on Hopper);
* ``stock_flashinfer``: the same on FlashInfer, the backend ``--enable-uniprefill`` serves on;
* ``defaults``: ``enable_uniprefill=True`` and nothing else;
* ``top_p``: the defaults with ``uniprefill_top_p=0.6``, a top-p that drops on random weights
  (which make top-p 0.99 keep almost everything): the speed of the defaults where a model's
  attention is concentrated, its realised keep in the row;
* ``staged``: the defaults with ``uniprefill_kv_layout="staged"``;
* ``keep``: the defaults with ``uniprefill_keep_ratio="0.5,0.8"`` (random weights make top-p keep
  almost everything, so this row shows the speed a real model's drops buy);
* ``keep_every_step``: ``keep`` with the cost rule off (``uniprefill_min_prompt_tokens=0``), to
  find the step size below which a drop does not pay.

Workloads: 64 prompts of 200-1200 tokens in one call, first after start-up (first call, best
and median of 3); one request at a time at each of ``--lengths`` (time to first token,
``max_new_tokens=1``; the median of ``--repeats`` (5) fresh prompts up to 32K tokens, and the first;
the plugin's rows time the same prompts dense in the same engine, and, as workload ``top1``, run
the longest prompt at top-p 1.0 and dense per request and compare their 16 greedy tokens); 16 prompts of 2K-6K tokens
in one call (median of 3); a cached document of ``--doc-tokens`` with ``--follow-ups``
questions of 100 tokens (each one's latency and their median: two engines of one configuration
differed by up to a third on single follow-ups); decode inter-token latency after an 8K prompt;
``max_total_num_tokens`` at start-up. Prompts are random token ids that differ from the first
token on (no accidental cache hits), the same in every configuration.

    python benchmarks/defaults.py --model-path benchmarks/models/llama-3.1-8b \\
        --configs stock stock_flashinfer defaults top_p keep --out defaults_h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

CONFIGS = {
    "stock": {},
    "stock_flashinfer": {"attention_backend": "flashinfer"},
    "defaults": {"enable_uniprefill": True},
    "staged": {"enable_uniprefill": True, "uniprefill_kv_layout": "staged"},
    "top_p": {"enable_uniprefill": True, "uniprefill_top_p": 0.6},
    "keep": {"enable_uniprefill": True, "uniprefill_keep_ratio": "0.5,0.8"},
    # Block-sparse prefill attention at a fixed density (the stand-in random weights need),
    # alone and over the survivors of keep 0.5,0.8 (backends/block_sparse.py).
    "block_sparse": {"enable_uniprefill": True, "uniprefill_block_sparse_density": 0.1},
    "keep_block_sparse": {"enable_uniprefill": True, "uniprefill_keep_ratio": "0.5,0.8",
                          "uniprefill_block_sparse_density": 0.1},
    # The cost rule off: where a drop stops paying for itself (its break-even).
    "keep_every_step": {"enable_uniprefill": True, "uniprefill_keep_ratio": "0.5,0.8",
                        "uniprefill_min_prompt_tokens": 0},
}
WORKLOADS = ("short", "single", "top1", "mid", "follow", "decode")


def is_stock(name: str) -> bool:
    """A configuration served without the plugin."""
    return not CONFIGS[name].get("enable_uniprefill")


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


def request_stages(meta: dict) -> dict:
    """Where a request's time went, from SGLang's request time stats (`enable_metrics`): ms
    from arrival to its first forward, from there to its prefill's result processed (the
    forward, and under the overlap scheduler the next step's launch), and on to completion."""
    marks = [meta.get(k) for k in ("request_received_ts", "forward_entry_time",
                                   "prefill_finished_time", "request_finished_ts")]
    if any(m is None for m in marks):
        return {}
    names = ("to_forward", "forward_to_result", "result_to_finish")
    return {n: round((b - a) * 1e3, 2) for n, a, b in zip(names, marks, marks[1:])}


def _median(seconds: list) -> float:
    return round(statistics.median(seconds), 4)


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
            "prefix": last.get("prefix"), "prefill_cuda_graph": last.get("prefill_cuda_graph"),
            "block_sparse_density": last.get("block_sparse_density"),
            "finish": out["meta_info"].get("finish_reason")}


def start_engine(name: str, args, lengths: list, cfg: dict):
    """Configuration `name`'s engine: random weights, token ids in and out, a context that
    holds the longest prompt (the model's own unless that is too short)."""
    import sglang

    needed = max(lengths) + 64  # the 16 greedy tokens and the decode probe fit
    context = {} if cfg.get("max_position_embeddings", 0) >= needed else {
        "context_length": needed}
    device = dict(device="cpu", attention_backend="torch_native", dtype="float32",
                  max_total_tokens=4 * max(lengths), disable_cuda_graph=True) \
        if args.device == "cpu" else ({} if args.attention_backend is None
                                      else dict(attention_backend=args.attention_backend))
    return sglang.Engine(model_path=args.model_path, load_format="dummy", random_seed=0,
                         log_level="error", skip_tokenizer_init=True, **context, **device,
                         **CONFIGS[name],
                         **json.loads(args.extra))


def engine_description(name: str, engine) -> dict:
    """What the result row says of the engine before any workload: its flags, memory and what
    SGLang chose."""
    info = engine.get_server_info()
    memory = info["internal_states"][0].get("memory_usage") or {}
    return {"config": name, "flags": CONFIGS[name], "memory_usage_gb": memory,
            "sglang_chose": {k: info.get(k) for k in (
                "chunked_prefill_size", "mem_fraction_static", "attention_backend",
                "prefill_attention_backend", "decode_attention_backend",
                "cuda_graph_backend_prefill", "disable_radix_cache", "uniprefill_kv_layout",
                "uniprefill_prefix_policy", "uniprefill_top_p")},
            "max_total_num_tokens": memory.get("token_capacity")}


class Workloads:
    """One configuration's workloads on its engine. Every prompt is drawn from one seeded
    generator in a fixed order, also for the workloads left out, so each configuration gets the
    same prompts; `result` is written to `partial` after each workload."""

    ONE_TOKEN = {"temperature": 0.0, "max_new_tokens": 1}

    def __init__(self, engine, result: dict, args, vocab: int, lengths: list):
        self.engine, self.result, self.args = engine, result, args
        self.vocab, self.lengths = vocab, lengths
        self.rng = random.Random(args.seed)
        self.dense_rng = random.Random(args.seed + 1)
        self.todo = set(args.workloads.split(","))
        self.plugin = not is_stock(result["config"])

    def flush(self) -> None:
        from uniprefill_sglang.tools.cpu_engine import flush_cache

        flush_cache(self.engine)

    def between_singles(self) -> None:
        """`--between-singles flush` empties the radix cache and with it torch's CUDA cache
        (SGLang's flush_cache does both), so a step that runs eagerly allocates its activations
        anew in every sample, which a serving process does only once; `none` leaves both."""
        if self.args.between_singles == "flush":
            self.flush()

    def ids(self, n: int) -> list:
        return _ids(self.rng, n, self.vocab)

    def plugin_state(self) -> dict:
        return self.engine.get_server_info()["internal_states"][0].get("uniprefill") or {}

    def note_allocator(self, workload: str) -> None:
        """The plugin's count of CUDA allocator retries in the scheduler after `workload` (a
        retry releases torch's cached blocks and costs the step that met it milliseconds)."""
        state = self.plugin_state()
        if "device_alloc_retries" in state:
            self.result.setdefault("device_alloc_retries", {})[workload] = state[
                "device_alloc_retries"]

    def save(self) -> None:
        with open(self.args.partial, "w") as f:
            json.dump(self.result, f, indent=1)

    def run(self) -> dict:
        # The short batch comes first: its first call is the first work after start-up.
        n_short, n_mid = [int(x) for x in self.args.batch_sizes.split(",")]
        self.short_batch([self.ids(self.rng.randint(200, 1200)) for _ in range(n_short)])
        self.singles()
        top = min(6144, max(self.lengths))
        self.mid_batch([self.ids(self.rng.randint(top // 3, top)) for _ in range(n_mid)])
        self.follow_ups()
        self.decode(self.ids(min(8192, max(self.lengths))))
        self.save()
        return self.result

    def short_batch(self, prompts: list) -> None:
        times = []
        for _ in range(3 if "short" in self.todo else 0):
            seconds, _ = _timed(self.engine, prompts, self.ONE_TOKEN)
            times.append(round(seconds, 4))
            self.flush()
        if times:
            self.result["short_batch"] = {"first_s": times[0], "best_s": min(times),
                                          "median_s": _median(times)}

    def singles(self) -> None:
        """Each length's prompts, one at a time: `--repeats` fresh prompts up to 32K tokens
        (`--long-repeats` above), their median and the first. The plugin's rows also time each
        prompt dense in the same engine (UniPrefill off per request): the engine's own share of a
        difference."""
        self.result["single"] = {}
        for n in self.lengths if "single" in self.todo else []:
            prompts = [self.ids(n) for _ in range(
                self.args.repeats if n <= 32768 else self.args.long_repeats)]
            times, dense_times, rejoins, stages, allocs = [], [], [], [], []
            for prompt in prompts:
                seconds, out = _timed(self.engine, prompt, self.ONE_TOKEN)
                times.append(round(seconds, 4))
                stages.append(request_stages(out.get("meta_info", {})))
                if self.plugin:  # the memory its parked rows' rejoin took, if they rejoined
                    state = self.plugin_state()
                    rejoins.append(state.get("last_rejoin"))
                    allocs.append(state.get("device_allocs"))
                self.between_singles()
                if self.plugin and len(prompts) > 1 and self.args.dense_same_engine == "on":
                    # Under --between-singles none the cache holds `prompt`: a fresh one of
                    # the same length, from a generator of its own (the others' prompts stay).
                    again = prompt if self.args.between_singles == "flush" else _ids(
                        self.dense_rng, n, self.vocab)
                    seconds, _ = _timed(self.engine, again, {**self.ONE_TOKEN, "custom_params": {
                        "uniprefill": False}})
                    dense_times.append(round(seconds, 4))
                    self.between_singles()
                # Saved as it goes: a long prompt's row is worth keeping if a later one is cut.
                self.result["single"][str(n)] = {"all_s": times, "dense_same_engine_all_s":
                                                 dense_times, "partial": True, **_meta(out)}
                self.save()
            row = {"ttft_s": _median(times), "first_s": times[0], "all_s": times, **_meta(out)}
            if any(rejoins):
                row["last_rejoin"] = rejoins
            if any(stages):
                row["request_stages_ms"] = stages
            if any(a is not None for a in allocs):  # torch's device allocations so far
                row["device_allocs_after_each"] = allocs
            if dense_times:
                row["dense_same_engine_s"] = _median(dense_times)
                row["dense_same_engine_all_s"] = dense_times
            if self.plugin and n == max(self.lengths) and "top1" in self.todo:
                row["top_p_1"] = self.top_p_1_against_dense(prompts[-1])
            self.result["single"][str(n)] = row
            self.note_allocator(f"single_{n}")
            self.save()

    def top_p_1_against_dense(self, prompt: list) -> dict:
        """16 greedy tokens at UniPrefill top-p 1.0, and whether dense gives the same."""
        greedy = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
        self.flush()
        seconds, top1 = _timed(self.engine, prompt, {**greedy, "custom_params": {
            "uniprefill_top_p": 1.0}})
        self.flush()
        _, dense = _timed(self.engine, prompt, {**greedy, "custom_params": {"uniprefill": False}})
        return {"seconds_16_tokens": round(seconds, 4), **_meta(top1),
                "equal_to_dense": top1["output_ids"] == dense["output_ids"]}

    def mid_batch(self, prompts: list) -> None:
        if "mid" in self.todo:
            times = []
            for _ in range(3):
                seconds, _ = _timed(self.engine, prompts, self.ONE_TOKEN)
                times.append(round(seconds, 4))
                self.flush()
            self.result["mid_batch"] = {"seconds": _median(times), "first_s": times[0],
                                        "all_s": times}
            self.note_allocator("mid_batch")
            self.save()

    def follow_ups(self) -> None:
        self.result["follow_ups"] = {}
        doc_lens = [int(x) for x in self.args.doc_tokens.split(",")]
        for doc_len in doc_lens if "follow" in self.todo else []:
            doc = self.ids(doc_len)
            first, first_out = _timed(self.engine, doc + self.ids(100), self.ONE_TOKEN)
            follow = []
            for _ in range(self.args.follow_ups):
                seconds, out = _timed(self.engine, doc + self.ids(100), self.ONE_TOKEN)
                follow.append({"seconds": round(seconds, 4),
                               "cached_tokens": out["meta_info"].get("cached_tokens"),
                               **_meta(out)})
                if request_stages(out["meta_info"]):
                    follow[-1]["request_stages_ms"] = request_stages(out["meta_info"])
            self.result["follow_ups"][str(doc_len)] = {
                "first_s": round(first, 4), "first": _meta(first_out), "follow": follow,
                "median_s": _median([f["seconds"] for f in follow])}
            self.flush()
            self.note_allocator(f"follow_{doc_len}")
            self.save()

    def decode(self, prompt: list) -> None:
        """Inter-token latency: 65 tokens less the first one's time, over 64. The prompt runs
        once before either is timed: where decode is the only workload its first prefill would
        pay the first-request costs and shrink the difference."""
        if "decode" not in self.todo:
            return
        _timed(self.engine, prompt, self.ONE_TOKEN)
        self.flush()
        t_first, _ = _timed(self.engine, prompt, self.ONE_TOKEN)
        self.flush()
        t_all, _ = _timed(self.engine, prompt, {"temperature": 0.0, "max_new_tokens": 65,
                                                "ignore_eos": True})
        self.result["decode_itl_ms"] = round((t_all - t_first) / 64 * 1000, 3)


def run_config(name: str, args) -> dict:
    """One configuration's workloads (called in a process whose plugins match `name`)."""
    if args.device == "cpu":  # a smoke run of this script on SGLang's CPU engine
        from uniprefill_sglang.tools.cpu_engine import activate_cpu_engine_env

        activate_cpu_engine_env()
    cfg = json.load(open(os.path.join(args.model_path, "config.json")))
    lengths = [int(x) for x in args.lengths.split(",")]
    engine = start_engine(name, args, lengths, cfg)
    try:
        return Workloads(engine, engine_description(name, engine), args, cfg["vocab_size"],
                         lengths).run()
    finally:
        engine.shutdown()


def summarize_rounds(rows: list) -> dict:
    """Per configuration, the median over its rounds of each round's figure: single-request
    TTFT per length and the follow-ups' median per document length (seconds)."""
    summary = {}
    for name in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == name]
        out = summary[name] = {"rounds": len(mine)}
        for key, field in (("single", "ttft_s"), ("follow_ups", "median_s")):
            per_len = {}
            for r in mine:
                for length, v in (r.get(key) or {}).items():
                    per_len.setdefault(length, []).append(v[field])
            if per_len:
                out[key] = {n: {"median_s": _median(v), "rounds_s": v}
                            for n, v in per_len.items()}
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--lengths", default="8192,32768,131000")
    ap.add_argument("--doc-tokens", default="32768,65536")
    ap.add_argument("--follow-ups", type=int, default=8, help="follow-up questions per document")
    ap.add_argument("--rounds", type=int, default=1,
                    help="engine processes per configuration, interleaved (see summary)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="fresh prompts per length up to 32K tokens (median reported)")
    ap.add_argument("--long-repeats", type=int, default=1,
                    help="fresh prompts per length above 32K; more than one times each dense "
                         "in the same engine too (the first pays the first-use compilation)")
    ap.add_argument("--between-singles", choices=("flush", "none"), default="none",
                    help="between single requests: nothing (none, as a server runs: prompts "
                         "differ, nothing is reused) or SGLang's flush_cache, which also "
                         "empties torch's CUDA cache (flush, as runs before 2026-12-04 did)")
    ap.add_argument("--attention-backend", default=None,
                    help="every row's backend (default: none named, SGLang picks; the "
                         "stock_flashinfer row names FlashInfer)")
    ap.add_argument("--dense-same-engine", choices=("on", "off"), default="on",
                    help="the plugin's rows also time each prompt dense in their own engine "
                         "(off: the stock rows are the only dense ones)")
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
    # Rounds interleave the configurations, each round a fresh engine process per configuration:
    # host speed differs between engine processes by up to 1.7x on follow-ups (benchmarks/
    # README.md), so one process per configuration measures the process as much as the flags.
    for round_no, name in [(r, n) for r in range(args.rounds) for n in args.configs]:
        partial = f"{args.out}.{name}.{round_no}.partial.json"
        env = dict(os.environ)
        if is_stock(name):
            env["SGLANG_PLUGINS"] = "none"
        mine = {**vars(args), **json.loads(args.per_config).get(name, {})}
        cmd = [sys.executable, os.path.abspath(__file__), "--model-path", args.model_path,
               "--lengths", mine["lengths"], "--doc-tokens", args.doc_tokens,
               "--workloads", mine["workloads"], "--follow-ups", str(args.follow_ups),
               "--repeats", str(args.repeats), "--long-repeats", str(args.long_repeats),
               "--between-singles", args.between_singles,
               *(["--attention-backend", args.attention_backend] if args.attention_backend
                 else []), "--dense-same-engine", args.dense_same_engine, "--seed", str(args.seed),
               "--batch-sizes", args.batch_sizes, "--extra", args.extra, "--device", args.device,
               "--out", args.out, "--one-config", name, "--partial", partial]
        code = subprocess.call(cmd, env=env)
        row = json.load(open(partial)) if os.path.exists(partial) else {"config": name}
        row["exit_code"], row["round"] = code, round_no
        out["rows"].append(row)
        out["summary"] = summarize_rounds(out["rows"])
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
