"""Serving TTFT through `sglang.bench_serving`: dense SGLang vs UniPrefill, same machine, same load.

Starts two stock `python -m sglang.launch_server` processes on the same random-weight model
folder (`--load-format dummy`; a word-level tokenizer is written next to the config, see
synthetic_model.py): one dense, one with `--enable-uniprefill` and a fixed keep-ratio schedule
(random weights make top-p keep nearly everything). Both use the same attention backend and
SGLang's default chunked prefill, with the radix cache off (bench_serving's warm-up request
would otherwise be a cached prefix of the first measured one). With `--gpus 0,1` each server
has a GPU of its own and the two sweeps run at the same time; with one GPU they run in turn.

For every input length and concurrency it runs

    python -m sglang.bench_serving --backend sglang --dataset-name random-ids --tokenize-prompt
        --random-input-len L --random-output-len O --random-range-ratio 1
        --num-prompts max(4, 2 * C) --max-concurrency C --request-rate inf

and collects mean / median / p99 TTFT, ITL and throughput, plus the keep ratio the UniPrefill
server realised (its cumulative kept / scored tokens, from /server_info).

    python benchmarks/bench_serving_sweep.py --model-path benchmarks/models/llama-3.1-8b \\
        --lengths 32768,65536 --concurrency 1,4,8,16 --gpus 0,1 \\
        --out benchmarks/results/serving_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
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


class Server:
    """One of the two servers compared: its name in the rows, and its process."""

    def __init__(self, name: str, model: str, port: int, gpu: str, extra: list, log_dir: Path,
                 context_length: int):
        self.name = name
        cmd = sp.server_command(model, port, "--load-format", "dummy", "--disable-radix-cache",
                                "--context-length", str(context_length), "--random-seed", "0",
                                *extra, uniprefill=False)
        env = sp.launch_env(CUDA_VISIBLE_DEVICES=gpu,
                            SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN="1")
        print(f"[{name}] GPU {gpu}: {' '.join(cmd)}", flush=True)
        self.process = sp.ServerProcess(cmd, log_dir / f"server_{name}.log", env)
        self.url = self.process.url

    def wait_ready(self, timeout: float) -> None:
        seconds = self.process.wait_healthy(timeout)
        print(f"[{self.name}] ready after {seconds:.0f} s", flush=True)

    def uniprefill_state(self) -> dict:
        info = sp.server_info(self.url, timeout=5.0)
        states = info.get("internal_states") or [{}]
        return dict(states[0].get("uniprefill") or {},
                    chunked_prefill_size=info.get("chunked_prefill_size"),
                    attention_backend=info.get("attention_backend"))

    def stop(self) -> None:
        self.process.stop()


def run_bench(server: Server, model: str, length: int, conc: int, args, out_dir: Path) -> dict:
    out_file = out_dir / f"bench_{server.name}_{length}_{conc}.jsonl"
    num_prompts = max(4, 2 * conc)
    cmd = bench_serving_command(server.url, model, length, args.output_len, num_prompts, conc,
                                length + conc, out_file)
    before = server.uniprefill_state()
    result = run_bench_serving(cmd, out_file, out_dir / f"bench_{server.name}.log",
                               args.bench_timeout)
    after = server.uniprefill_state()
    row = {k: result.get(k) for k in METRICS}
    row.update(server=server.name, length=length, concurrency=conc, num_prompts=num_prompts,
               kept_fraction=kept_fraction(before, after))
    print(f"[{server.name}] L={length} C={conc}: mean TTFT {row['mean_ttft_ms']:.0f} ms, "
          f"ITL {row['mean_itl_ms']:.1f} ms, kept {row['kept_fraction']}", flush=True)
    return row


def sweep(server: Server, model: str, args, out_dir: Path, rows: list, lock, save) -> None:
    for length in [int(x) for x in args.lengths.split(",")]:
        for conc in [int(x) for x in args.concurrency.split(",")]:
            try:
                row = run_bench(server, model, length, conc, args, out_dir)
            except Exception as e:  # keep the other points
                row = dict(server=server.name, length=length, concurrency=conc, error=repr(e))
                print(f"[{server.name}] L={length} C={conc} failed: {e!r}", flush=True)
            with lock:
                rows.append(row)
            save()  # keep what was measured if a later point does not finish


def summarize(rows: list) -> list:
    """Dense/UniPrefill pairs with their ratios."""
    by = {(r["server"], r["length"], r["concurrency"]): r for r in rows if "error" not in r}
    table = []
    for (name, length, conc), dense in sorted(by.items()):
        up = by.get(("uniprefill", length, conc))
        if name != "dense" or up is None:
            continue
        table.append(dict(
            length=length, concurrency=conc,
            dense_mean_ttft_ms=dense["mean_ttft_ms"], up_mean_ttft_ms=up["mean_ttft_ms"],
            mean_ttft_speedup=dense["mean_ttft_ms"] / up["mean_ttft_ms"],
            dense_median_ttft_ms=dense["median_ttft_ms"], up_median_ttft_ms=up["median_ttft_ms"],
            dense_p99_ttft_ms=dense["p99_ttft_ms"], up_p99_ttft_ms=up["p99_ttft_ms"],
            dense_mean_itl_ms=dense["mean_itl_ms"], up_mean_itl_ms=up["mean_itl_ms"],
            dense_req_per_s=dense["request_throughput"], up_req_per_s=up["request_throughput"],
            kept_fraction=up["kept_fraction"]))
    return table


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True, help="a folder with config.json")
    ap.add_argument("--lengths", default="32768,65536")
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--keep-ratio", default="0.5,0.8")
    ap.add_argument("--attention-backend", default="flashinfer")
    ap.add_argument("--gpus", default="0", help="'0': both servers in turn; '0,1': side by side")
    ap.add_argument("--server-args", default="", help="extra args for both servers")
    ap.add_argument("--start-timeout", type=float, default=400)
    ap.add_argument("--bench-timeout", type=float, default=600)
    ap.add_argument("--out", required=True)
    return ap.parse_args(argv)


def sweep_side_by_side(plans: list, model: str, args, out_dir: Path, context: int, rows: list,
                       lock, save, setup: dict) -> None:
    """Both servers started, then both sweeps at once (a GPU each)."""
    servers = [Server(n, model, 30000 + 100 * i, g, x, out_dir, context)
               for i, (n, g, x) in enumerate(plans)]
    try:
        for s in servers:
            s.wait_ready(args.start_timeout)
        setup.update({s.name: s.uniprefill_state() for s in servers})
        setup["command"] = " ".join(sys.argv)
        threads = [threading.Thread(target=sweep, args=(s, model, args, out_dir, rows, lock, save))
                   for s in servers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for s in servers:
            s.stop()


def sweep_in_turn(plans: list, model: str, args, out_dir: Path, context: int, rows: list,
                  lock, save, setup: dict) -> None:
    """One server at a time, each stopped before the next starts."""
    for i, (n, g, x) in enumerate(plans):
        server = Server(n, model, 30000 + 100 * i, g, x, out_dir, context)
        try:
            server.wait_ready(args.start_timeout)
            setup[n] = server.uniprefill_state()
            sweep(server, model, args, out_dir, rows, lock, save)
        finally:
            server.stop()


def print_summary(rows: list) -> None:
    print("| length | conc | dense mean/median/p99 TTFT ms | UniPrefill mean/median/p99 TTFT ms "
          "| mean TTFT speedup | ITL ms dense / UniPrefill | req/s dense / UniPrefill | kept |")
    print("|---|---|---|---|---|---|---|---|")
    for r in summarize(rows):
        print(f"| {r['length']} | {r['concurrency']} | {r['dense_mean_ttft_ms']:.0f} / "
              f"{r['dense_median_ttft_ms']:.0f} / {r['dense_p99_ttft_ms']:.0f} | "
              f"{r['up_mean_ttft_ms']:.0f} / {r['up_median_ttft_ms']:.0f} / "
              f"{r['up_p99_ttft_ms']:.0f} | {r['mean_ttft_speedup']:.2f}x | "
              f"{r['dense_mean_itl_ms']:.1f} / {r['up_mean_itl_ms']:.1f} | "
              f"{r['dense_req_per_s']:.3f} / {r['up_req_per_s']:.3f} | "
              f"{r['kept_fraction'] if r['kept_fraction'] is None else round(r['kept_fraction'], 3)} |")


def main() -> None:
    args = parse_args()
    out_dir = Path(args.out).with_suffix("")
    out_dir.mkdir(parents=True, exist_ok=True)
    model = prepare(args.model_path, tempfile.mkdtemp(prefix="uniprefill-model-"))
    context = max(int(x) for x in args.lengths.split(",")) + args.output_len + 64
    max_conc = max(int(x) for x in args.concurrency.split(","))
    common = ["--attention-backend", args.attention_backend,
              "--cuda-graph-max-bs-decode", str(max(16, max_conc)), *args.server_args.split()]
    up_extra = ["--enable-uniprefill", "--uniprefill-keep-ratio", args.keep_ratio]
    gpus = args.gpus.split(",")
    plans = [("dense", gpus[0], common), ("uniprefill", gpus[-1], common + up_extra)]
    rows, lock, setup = [], threading.Lock(), {}

    def save():
        with lock:
            Path(args.out).write_text(json.dumps(
                {"header": result_header(model=args.model_path), "setup": setup,
                 "summary": summarize(rows), "rows": rows}, indent=1))

    run = sweep_side_by_side if len(gpus) > 1 else sweep_in_turn
    run(plans, model, args, out_dir, context, rows, lock, save, setup)
    setup["command"] = " ".join(sys.argv)
    save()
    print_summary(rows)


if __name__ == "__main__":
    main()
