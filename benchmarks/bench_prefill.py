"""Static prefill latency: dense SGLang vs UniPrefill, side by side in one engine.

One `sglang.Engine` with `--enable-uniprefill` serves every measurement; the dense baseline is
the same engine with UniPrefill switched off per request (`custom_params={"uniprefill": False}`),
so weights, kernels, memory pool and process are identical. Each measurement is one request of
`length` random token ids (distinct per request, radix cache off) with `max_new_tokens=1`, so
its latency is the prefill (time to first token) plus one sampling step.

Random (`--load-format dummy`) weights give near-uniform attention, where top-p keeps almost
every block, so speed is measured with fixed keep-ratio schedules (one ratio per drop layer).
Beside each measured speedup the script prints the FLOP-ideal speedup for the tokens actually
kept (from the per-stage kept counts the request reports; `uniprefill_sglang/flops.py`, each
layer priced at its kind).

    python benchmarks/bench_prefill.py --model-path /path/llama31-8b-config \\
        --lengths 8192,32768,65536,131072 --schedules 0.3 0.5 0.7 0.9 0.5,0.8 --out results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from result_header import result_header
from transformers import AutoConfig

from uniprefill_sglang.flops import FlopShape, flop_ideal_speedup


def engine_kwargs_for(args, lengths) -> dict:
    kwargs = dict(
        model_path=args.model_path, load_format="dummy", enable_uniprefill=True,
        attention_backend=args.attention_backend, disable_radix_cache=True,
        context_length=max(lengths) + 64, mem_fraction_static=args.mem_fraction_static,
        cuda_graph_backend_prefill="disabled", log_level="error", random_seed=0,
        cuda_graph_max_bs_decode=16,  # decode graphs only for the ITL probe: start faster
        tp_size=args.tp_size,
        port=getattr(args, "port", 30000),  # profile_steps.py shares this without --port
        skip_tokenizer_init=True,  # token ids in, token ids out: the folder needs no tokenizer
    )
    if args.chunked_prefill_size != "default":  # else SGLang's own choice for this GPU
        kwargs["chunked_prefill_size"] = int(args.chunked_prefill_size)
        if int(args.chunked_prefill_size) < 0:
            kwargs["max_prefill_tokens"] = max(lengths) + 64
    if args.drop_layers:
        kwargs["uniprefill_drop_layers"] = args.drop_layers
    if args.device != "cuda":  # a smoke run of this script on SGLang's CPU engine
        kwargs.update(device=args.device, attention_backend="torch_native")
    return kwargs


class Runner:
    """Sends measured requests to one engine; every prompt is fresh random ids (no reuse)."""

    def __init__(self, engine, vocab: int, context_length: int):
        self.engine = engine
        self.probe_tokens = min(30000, context_length - 200)
        self.vocab = vocab
        self.gen = torch.Generator().manual_seed(0)
        self.n = 0

    def ids(self, length: int) -> list:
        return torch.randint(100, self.vocab - 100, (length,), generator=self.gen).tolist()

    def batch(self, length: int, custom: dict, concurrency: int, itl_probe: bool = False,
              decode_tokens: int = 0):
        """`concurrency` requests at once. Returns per-request TTFTs (s), their meta, the ITLs (s)
        of a short request that was decoding while they prefilled (if itl_probe), and the
        measured requests' own ITLs after their prefill (if decode_tokens > 1)."""
        return self.engine.loop.run_until_complete(
            self._batch(length, custom, concurrency, itl_probe, decode_tokens))

    async def _batch(self, length, custom, concurrency, itl_probe, decode_tokens):
        import asyncio

        params = {"max_new_tokens": max(1, decode_tokens), "temperature": 0.0,
                  "ignore_eos": True, "custom_params": custom}
        probe = stamps = None
        if itl_probe:
            self.n += 1
            probe_rid = f"itl-probe-{self.n}"
            probe = await self.engine.async_generate(
                input_ids=self.ids(128), rid=probe_rid, stream=True,
                sampling_params={"max_new_tokens": self.probe_tokens, "temperature": 0.0,
                                 "ignore_eos": True})
            stamps = []
            for _ in range(3):  # it is decoding now
                await probe.__anext__()

            async def follow():
                async for _ in probe:
                    stamps.append(time.perf_counter())

            follower = asyncio.ensure_future(follow())
        start = time.perf_counter()

        async def one():
            ids = self.ids(length)
            if decode_tokens <= 1:
                out = await self.engine.async_generate(input_ids=ids, sampling_params=params)
                return time.perf_counter() - start, out["meta_info"].get("uniprefill", [{}])[-1], []
            stream = await self.engine.async_generate(input_ids=ids, sampling_params=params,
                                                      stream=True)
            times, meta = [], None
            async for chunk in stream:
                times.append(time.perf_counter())
                meta = chunk["meta_info"].get("uniprefill") or meta
            own = [b - a for a, b in zip(times, times[1:])]
            return times[0] - start, (meta or [{}])[-1], own

        results = await asyncio.gather(*[one() for _ in range(concurrency)])
        end = min(start + r[0] for r in results) if decode_tokens > 1 else time.perf_counter()
        itls = []
        if itl_probe:
            # The probe's gaps from its last token before the long requests arrived to its first
            # token after their prefill ended: the longest one is the stall they caused.
            for _ in range(200):
                if stamps and stamps[-1] > end:
                    break
                await asyncio.sleep(0.01)
            self.engine.tokenizer_manager.abort_request(probe_rid)
            try:
                await asyncio.wait_for(follower, 30)
            except Exception:
                follower.cancel()
            before = [t for t in stamps if t <= start][-1:]
            during = [t for t in stamps if start < t <= end]
            after = [t for t in stamps if t > end][:1]
            window = before + during + after
            itls = [b - a for a, b in zip(window, window[1:])]
        own = [g for r in results for g in r[2]]
        return [r[0] for r in results], [r[1] for r in results], itls, own


TABLE_HEAD = ("| length | conc | schedule | dense s | UniPrefill s | speedup | FLOP-ideal | of ideal "
              "| kept after last drop | ITL dense ms (mean/max) | ITL UniPrefill ms (mean/max) |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|")
DENSE = {"uniprefill": False}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--lengths", default="8192,32768,65536,131072")
    ap.add_argument("--schedules", nargs="+", default=["0.3", "0.5", "0.7", "0.9", "0.5,0.8"],
                    help="keep-ratio schedules, one ratio per drop (the last repeats)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", default="1",
                    help="comma-separated: requests sent at once; TTFT is their mean")
    ap.add_argument("--attention-backend", default="flashinfer")
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--mem-fraction-static", type=float, default=0.8)
    ap.add_argument("--chunked-prefill-size", default="-1",
                    help="-1: one prefill step per prompt (static latency); 'default': SGLang's")
    ap.add_argument("--itl-probe", action="store_true",
                    help="a short request decodes alongside each measurement; report its ITL")
    ap.add_argument("--decode-tokens", type=int, default=0,
                    help="> 1: the measured requests stream this many tokens; report their ITL")
    ap.add_argument("--drop-layers", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--port", type=int, default=30000,
                    help="engine port base (give engines running side by side their own)")
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def start_engine(args, lengths: list) -> tuple:
    """(the engine, the run's setup: drop layers, backend, chunking, device, SGLang version)."""
    import os

    if args.device == "cpu":
        from uniprefill_sglang.tools.cpu_engine import activate_cpu_engine_env

        activate_cpu_engine_env()

    # A 131072-token prompt plus its output exceeds Llama-3.1's 131072 positions by a few.
    os.environ.setdefault("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "1")
    import sglang

    engine = sglang.Engine(**engine_kwargs_for(args, lengths))
    server = engine.get_server_info()
    info = server["internal_states"][0]["uniprefill"]
    setup = {"drop_layers": info["drop_layers"], "backend": server.get("attention_backend"),
             "tp_size": args.tp_size, "chunked_prefill_size": server.get("chunked_prefill_size"),
             "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
             "sglang": sglang.__version__}
    return engine, setup


def measure(runner: Runner, length: int, conc: int, schedule: str, args, drop_layers: list,
            shape: FlopShape) -> dict:
    """One schedule at one length and concurrency: dense and UniPrefill alternating over the
    repeats (so drift hits both alike), medians of their mean TTFTs."""
    custom = {"uniprefill_keep_ratio": schedule}
    runner.batch(length, custom, 1)  # warm-up
    dense_t, up_t, itl_d, itl_u, own_d, own_u, kept = [], [], [], [], [], [], []
    for _ in range(args.repeats):
        t, _, itl, own = runner.batch(length, DENSE, conc, args.itl_probe, args.decode_tokens)
        dense_t.append(statistics.mean(t)), itl_d.extend(itl), own_d.extend(own)
        t, metas, itl, own = runner.batch(length, custom, conc, args.itl_probe,
                                          args.decode_tokens)
        up_t.append(statistics.mean(t)), itl_u.extend(itl), own_u.extend(own)
        kept = [m.get("kept_tokens") for m in metas]
    dense, up = statistics.median(dense_t), statistics.median(up_t)
    row = dict(length=length, concurrency=conc, schedule=schedule, dense_s=dense,
               uniprefill_s=up, speedup=dense / up,
               flop_ideal=flop_ideal_speedup([kept[0]], drop_layers, shape), kept=kept[0],
               kept_fraction=sum(k[-1] for k in kept) / sum(k[0] for k in kept))
    if args.itl_probe:
        row.update(itl_dense_ms=_ms(itl_d), itl_uniprefill_ms=_ms(itl_u))
    if args.decode_tokens > 1:
        row.update(decode_itl_dense_ms=_ms(own_d), decode_itl_uniprefill_ms=_ms(own_u))
        print(f"decode ITL after the prefill, dense {_fmt(own_d)}, UniPrefill {_fmt(own_u)}")
    return row


def table_line(row: dict) -> str:
    itl_cols = ""
    if "itl_dense_ms" in row:
        itl_cols = (f" {row['itl_dense_ms']['mean']:.1f} / {row['itl_dense_ms']['max']:.0f} |"
                    f" {row['itl_uniprefill_ms']['mean']:.1f} / "
                    f"{row['itl_uniprefill_ms']['max']:.0f} |")
    dense, up, ideal = row["dense_s"], row["uniprefill_s"], row["flop_ideal"]
    return (f"| {row['length']} | {row['concurrency']} | {row['schedule']} | {dense:.3f} | "
            f"{up:.3f} | {dense / up:.2f}x | {ideal:.2f}x | {dense / up / ideal:.0%} | "
            f"{row['kept_fraction']:.0%} |{itl_cols}")


def main() -> None:
    args = parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    concurrencies = [int(x) for x in args.concurrency.split(",")]
    cfg = json.load(open(f"{args.model_path}/config.json"))
    # The FLOP model prices each layer by its kind: the config as transformers completes it
    # (Gemma 3's layer kinds from its sliding-window pattern).
    shape = FlopShape.from_config(AutoConfig.from_pretrained(args.model_path))
    engine, setup = start_engine(args, lengths)
    runner = Runner(engine, cfg["vocab_size"], max(lengths) + 64)
    rows = []

    def save():
        if args.out:  # keep what was measured even if a later length does not finish
            with open(args.out, "w") as f:
                json.dump({"header": result_header(model=args.model_path), **setup, "rows": rows},
                          f, indent=1)

    print(setup)
    print(TABLE_HEAD)
    for length in lengths:
        for conc in concurrencies:
            runner.batch(length, DENSE, 1)  # warm-up for this shape
            for schedule in args.schedules:
                rows.append(measure(runner, length, conc, schedule, args, setup["drop_layers"],
                                    shape))
                print(table_line(rows[-1]), flush=True)
                save()
    engine.shutdown()
    save()


def _fmt(gaps: list) -> str:
    m = _ms(gaps)
    return f"mean {m['mean']:.2f} ms, median {m.get('p50', float('nan')):.2f} ms (n={m['n']})"


def _ms(gaps: list) -> dict:
    if not gaps:
        return {"mean": float("nan"), "max": float("nan"), "n": 0}
    return {"mean": 1e3 * statistics.mean(gaps), "max": 1e3 * max(gaps),
            "p50": 1e3 * statistics.median(gaps), "n": len(gaps)}


if __name__ == "__main__":
    main()
