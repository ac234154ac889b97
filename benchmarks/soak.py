"""A bounded soak of one UniPrefill server: mixed traffic, aborts and disconnects, then the checks.

Starts `python -m sglang.launch_server --enable-uniprefill` on 127.0.0.1 and a free port (or
talks to the local server at `--url`), sends it a fixed number of requests within a time limit,
and checks what a server must guarantee under such traffic:

* **No failed request.** A request the soak did not abort or disconnect must answer 200 with a
  finish reason of `length` (then exactly `max_new_tokens` output tokens) or `stop`. An aborted
  request must end with SGLang's `abort` finish reason, or finish normally when the abort came
  too late; an HTTP error, an error event, a timeout or a dropped connection is a failure.
* **Every pool back to idle.** SGLang's own checks: at idle its scheduler checks every pool
  (strict by default: a leak raises in the scheduler, so the server dies), and a server started
  here also gets `SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY=1`, which asserts the KV accounting
  (free + cached + protected + held by running requests == pool size) after every batch. After
  the traffic the server must still answer `/health` and `/server_info`, and its log must
  not report a leak. Ours, from
  `/server_info` -> `internal_states[0]["uniprefill"]` once idle: no protected KV slot,
  available + evictable == max_total_num_tokens, every request slot free, no parked chunk;
  after `/flush_cache` every KV slot is free. `leaked slots` counts KV slots and request slots
  not accounted for.
* **Replay.** A request is *comparable* when it ran greedily (temperature 0), was neither
  aborted nor disconnected, finished with 200, and its `meta_info["cached_tokens"]` is 0 (every
  prompt starts with a token no other prompt starts with, so only the shared-document requests
  can reuse a prefix). Each comparable request is replayed alone, non-streamed, after
  `/flush_cache`, and its output token ids must equal the soak's. Both runs then compute the
  same function of the same prompt from an empty cache: the only differences are the batch the
  request shared and, under chunked prefill, where its chunks were cut. A request that reused a
  cached prefix is not compared: what a prefix holds depends on the request that cached it (its
  tokens may have been dropped from the later layers), so its output may legitimately differ
  from a run without it. The replay also compares the kept-token counts of the drop
  (`meta_info["uniprefill"]`); a difference there is reported as a drop mismatch.

Traffic (all counts and times bounded; only to 127.0.0.1): short prompts under the drop minimum
(run dense), long ones that drop, some longer than `--chunked-prefill-size` (chunked), groups of
requests sharing one long document prefix (radix cache on), per-request knobs
(`sampling_params.custom_params`: `uniprefill` on/off, `uniprefill_top_p`,
`uniprefill_keep_ratio`), streamed and whole responses, streams the client closes after a few
tokens, explicit aborts (`POST /abort_request {"rid": ...}`) before the first token (queued or in
prefill) and during decode, and more concurrent clients than `--max-running-requests`. Prompts
are token ids: real text through the model's tokenizer, or random ids when the server has none
(`--skip-tokenizer-init`, e.g. a `--load-format dummy` config folder).

CPU (SmolLM2-135M-Instruct, the CPU engine; what tests/test_soak.py runs):

    python benchmarks/soak.py --cpu --model-path $(python -m uniprefill_sglang.tools.model_zoo smollm2) \\
        --out /tmp/soak_cpu.json

GPU (Llama-3.1-8B shape, random weights, FlashInfer, decode CUDA graphs; no tokenizer, so the
prompts are random token ids; a fixed keep ratio, as top-p keeps nearly everything on random
weights):

    python benchmarks/soak.py --model-path benchmarks/models/llama-3.1-8b --preset gpu \\
        --out benchmarks/results/soak/soak_flashinfer_h200.json -- --load-format dummy \\
        --skip-tokenizer-init --attention-backend flashinfer --uniprefill-keep-ratio 0.5,0.8 \\
        --context-length 32768 --chunked-prefill-size 8192 --max-running-requests 64 \\
        --disable-prefill-cuda-graph --mem-fraction-static 0.85

On random weights the logits are nearly flat, so a greedy token can flip with the bf16
summation order of the batch a request shares: there the output-token replay mismatches mix
such flips with real differences, while the kept-token comparison (the drop itself) stays exact.
SGLang's `--enable-deterministic-inference` (batch-invariant kernels) is meant to remove the
flips. With it, SGLang's FlashInfer prefill splits the KV at a fixed 4096 tokens in a 2 GiB
workspace, which 8192-token chunks over prompts longer than 12288 tokens overflow (the scheduler
dies); and it turns the radix cache off for FlashInfer, so the shared-document requests reuse
nothing. On the H200:

    SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE=8192 python benchmarks/soak.py ... \
        --mem-fraction-static 0.85 --enable-deterministic-inference

Arguments after `--` go to the launcher. Exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import aiohttp
import requests

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from result_header import result_header  # noqa: E402

from uniprefill_sglang.tools import server_process as sp  # noqa: E402

KNOB_CHOICES = (
    None,  # the server's default selection
    {"uniprefill": False},
    {"uniprefill": True},
    {"uniprefill_top_p": 0.9},
    {"uniprefill_top_p": 0.97},
    {"uniprefill_keep_ratio": 0.5},
    {"uniprefill_keep_ratio": [0.5, 0.8]},
    {"uniprefill_keep_ratio": "0.3"},
)
NORMAL_FINISH = ("length", "stop")
LEAK_PATTERN = re.compile(r"memory leak detected|Mem Leak Detected", re.IGNORECASE)

PRESETS = {
    # ~2-3 minutes on 2 idle CPU cores with SmolLM2-135M, server start-up and replay included:
    # mostly short requests, a few long and chunked ones. The time limits only stop a hung
    # run: a box busy with other work can make the CPU engine several times slower.
    "cpu": dict(requests=120, concurrency=16, short_len=(8, 64), long_len=(300, 600),
                chunked_len=(1000, 1400), n_long=8, n_chunked=3, shared_groups=1,
                group_size=6, doc_len=400, suffix_len=(8, 24), new_tokens=(1, 4),
                stream_frac=0.3, sampled_frac=0.1, n_abort_early=3, n_abort_decode=3,
                n_disconnect=3, abort_delay_s=(0.05, 1.0), min_cut_tokens=6,
                time_limit_s=900.0, request_timeout_s=800.0, idle_timeout_s=120.0,
                replay_time_limit_s=900.0, max_replays=0),
    # Thousands of requests on one H200 (Llama-3.1-8B shape), about 1.4M prompt tokens: sized
    # for the ~8K prompt tokens/s a 150 s run of this soak served there (2026-11-30), so that
    # start-up, traffic and replay take about five minutes.
    "gpu": dict(requests=2000, concurrency=128, short_len=(16, 200), long_len=(1024, 4096),
                chunked_len=(9000, 16000), n_long=300, n_chunked=30, shared_groups=10,
                group_size=10, doc_len=4000, suffix_len=(16, 256), new_tokens=(4, 64),
                stream_frac=0.3, sampled_frac=0.1, n_abort_early=40, n_abort_decode=40,
                n_disconnect=40, abort_delay_s=(0.01, 0.5), min_cut_tokens=16,
                time_limit_s=300.0, request_timeout_s=280.0, idle_timeout_s=120.0,
                replay_time_limit_s=90.0, max_replays=200),
}

# --- the traffic plan -------------------------------------------------------------------------


@dataclasses.dataclass
class Spec:
    idx: int
    rid: str
    kind: str  # short | long | chunked | shared
    input_ids: list
    sampling: dict
    stream: bool
    action: str  # complete | abort_early | abort_decode | disconnect
    after_tokens: int = 0  # abort_decode / disconnect: act once this many tokens arrived
    delay_s: float = 0.0  # abort_early: send the abort this long after the request

    @property
    def greedy(self) -> bool:
        return self.sampling.get("temperature", 1.0) == 0.0

    def body(self, stream: Optional[bool] = None) -> dict:
        return {"input_ids": self.input_ids, "sampling_params": self.sampling,
                "stream": self.stream if stream is None else stream, "rid": self.rid}


@dataclasses.dataclass
class Outcome:
    status: Optional[int] = None
    finish: Optional[str] = None
    output_ids: list = dataclasses.field(default_factory=list)
    meta: Optional[dict] = None
    error: Optional[str] = None
    abort_sent: bool = False
    tokens_at_abort: Optional[int] = None
    disconnected: bool = False
    seconds: float = 0.0


class TokenSource:
    """Prompt token ids: windows of generated English text through the model's tokenizer, or
    random ids. Every prompt starts with a token drawn without replacement, so no two prompts
    share a cached prefix unless they share a document on purpose."""

    def __init__(self, model_path: str, use_tokenizer: bool, rng: random.Random, n_firsts: int):
        config = json.loads((Path(model_path) / "config.json").read_text())
        self.vocab = int(config["vocab_size"])
        self.rng = rng
        self.pool: Optional[list] = None
        if use_tokenizer:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(model_path)
            self.pool = tok(_text(random.Random(1234), 2500), add_special_tokens=False)["input_ids"]
        lo, hi = min(1000, self.vocab // 4), self.vocab - 1
        self.firsts = rng.sample(range(lo, hi), n_firsts)

    def body(self, n: int) -> list:
        if self.pool is None:
            return [self.rng.randrange(100, self.vocab - 1) for _ in range(n)]
        assert n < len(self.pool), (n, len(self.pool))
        start = self.rng.randrange(0, len(self.pool) - n)
        return list(self.pool[start:start + n])

    def prompt(self, n: int) -> list:
        return [self.firsts.pop()] + self.body(n - 1)


def _text(rng: random.Random, n_sentences: int) -> str:
    names = ["Ada", "Bruno", "Chen", "Dana", "Emil", "Farah", "Goran", "Hana", "Ivo", "Jun"]
    verbs = ["walked to", "drove to", "wrote about", "painted", "cleaned", "visited"]
    places = ["the harbour", "the library", "a small farm", "the old mill", "the station",
              "the market", "a quiet garden", "the museum"]
    things = ["a red kite", "a brass key", "seven apples", "a blue notebook", "a lantern",
              "a map of the coast", "two letters", "a silver coin"]
    out = []
    for i in range(n_sentences):
        out.append(f"{rng.choice(names)} {rng.choice(verbs)} {rng.choice(places)} and found "
                   f"{rng.choice(things)}.")
        if i % 9 == 8:
            out.append(f"The number of the day was {rng.randrange(10_000, 99_999)}.\n")
    return " ".join(out)


def build_plan(cfg: dict, tokens: TokenSource, chunk: int, rng: random.Random,
               ignore_eos: Optional[bool]) -> list:
    n_shared = cfg["shared_groups"] * cfg["group_size"]
    n_short = cfg["requests"] - cfg["n_long"] - cfg["n_chunked"] - n_shared
    assert n_short >= 0, "more long, chunked and shared requests than requests"
    lengths = ([("short", rng.randint(*cfg["short_len"])) for _ in range(n_short)]
               + [("long", rng.randint(*cfg["long_len"])) for _ in range(cfg["n_long"])]
               + [("chunked", rng.randint(max(chunk + 1, cfg["chunked_len"][0]),
                                          max(chunk + 2, cfg["chunked_len"][1])))
                  for _ in range(cfg["n_chunked"])])
    prompts = [(kind, tokens.prompt(n)) for kind, n in lengths]
    for _ in range(cfg["shared_groups"]):
        doc = tokens.prompt(cfg["doc_len"])
        for _ in range(cfg["group_size"]):
            # The suffix starts with a token of its own, so the match ends at the document.
            prompts.append(("shared", doc + tokens.prompt(rng.randint(*cfg["suffix_len"]))))
    rng.shuffle(prompts)

    specs = []
    for idx, (kind, ids) in enumerate(prompts):
        sampling = {"max_new_tokens": rng.randint(*cfg["new_tokens"]),
                    "ignore_eos": rng.random() < 0.5 if ignore_eos is None else ignore_eos}
        # Short prompts run dense whatever they ask; they carry the sampled requests. Long ones
        # are greedy (so the replay covers them), and mostly drop.
        if kind == "short" and rng.random() < cfg["sampled_frac"]:
            sampling.update(temperature=0.8, top_p=0.9)
        else:
            sampling["temperature"] = 0.0
        if kind == "short" or rng.random() < 0.15:
            knobs = rng.choice(KNOB_CHOICES)
        else:
            knobs = rng.choice([k for k in KNOB_CHOICES if k != {"uniprefill": False}])
        if knobs is not None:
            sampling["custom_params"] = knobs
        specs.append(Spec(idx=idx, rid=f"soak-{idx}-{rng.getrandbits(32):08x}", kind=kind,
                          input_ids=ids, sampling=sampling, stream=rng.random() < cfg["stream_frac"],
                          action="complete"))

    # Faults: early aborts on prompts that take a while to prefill; decode aborts and
    # disconnects on streams long enough to be cut in the middle.
    def pick(n: int, kinds: tuple) -> list:
        """n requests still plain, taken in turn from each kind (while it has any)."""
        groups = [rng.sample(g, len(g)) for g in
                  ([s for s in specs if s.action == "complete" and s.kind == k] for k in kinds)]
        turns = [s for turn in itertools.zip_longest(*groups) for s in turn if s is not None]
        return turns[:n]

    # Early aborts on prompts that take a while to prefill (chunked ones first); decode aborts
    # and disconnects on streams long enough to be cut in the middle, dropped ones among them.
    for s in pick(cfg["n_abort_early"], ("chunked", "long", "shared")):
        s.action, s.delay_s = "abort_early", rng.uniform(*cfg["abort_delay_s"])
        s.stream = rng.random() < 0.5
    for action in ("abort_decode", "disconnect"):
        for s in pick(cfg[f"n_{action}"], ("short", "long", "shared", "short")):
            s.action, s.stream = action, True
            s.sampling["max_new_tokens"] = max(s.sampling["max_new_tokens"],
                                               cfg["min_cut_tokens"])
            s.sampling["ignore_eos"] = True  # so the stream is still running when we cut it
            s.after_tokens = rng.randint(1, cfg["min_cut_tokens"] // 2)
    return specs


# --- the clients ------------------------------------------------------------------------------


def _finish_type(meta: Optional[dict]) -> Optional[str]:
    reason = (meta or {}).get("finish_reason")
    return reason.get("type") if isinstance(reason, dict) else reason


async def _abort(session: aiohttp.ClientSession, url: str, spec: Spec, out: Outcome,
                 seen: int) -> None:
    out.abort_sent, out.tokens_at_abort = True, seen
    async with session.post(url + "/abort_request", json={"rid": spec.rid}) as r:
        if r.status != 200:
            out.error = f"/abort_request answered {r.status}: {await r.text()}"


async def _run_stream(session, url, spec, out: Outcome, incremental: bool) -> None:
    async with session.post(url + "/generate", json=spec.body()) as r:
        out.status = r.status
        if r.status != 200:
            out.error = (await r.text())[:500]
            return
        seen = 0
        async for raw in r.content:
            payload = sp.sse_payload(raw)
            if payload is None:
                continue
            if payload == sp.SSE_DONE:
                return
            event = json.loads(payload)
            if "error" in event:
                out.error = f"error event: {event['error']}"
                return
            ids = event.get("output_ids") or []
            out.output_ids = out.output_ids + ids if incremental else list(ids)
            out.meta = event.get("meta_info")
            out.finish = _finish_type(out.meta)
            seen = len(out.output_ids)
            if out.finish is None and seen >= spec.after_tokens > 0:
                if spec.action == "disconnect" and not out.disconnected:
                    out.disconnected = True
                    r.close()  # the client goes away mid-stream
                    return
                if spec.action == "abort_decode" and not out.abort_sent:
                    await _abort(session, url, spec, out, seen)
        out.error = out.error or "stream ended without [DONE]"


async def _run_whole(session, url, spec, out: Outcome) -> None:
    async with session.post(url + "/generate", json=spec.body()) as r:
        out.status = r.status
        text = await r.text()
        if r.status != 200:
            out.error = text[:500]
            return
        body = json.loads(text)
        out.output_ids, out.meta = body.get("output_ids") or [], body.get("meta_info")
        out.finish = _finish_type(out.meta)


async def run_one(session, url: str, spec: Spec, incremental: bool) -> Outcome:
    out = Outcome()
    t0 = time.monotonic()
    try:
        main = asyncio.ensure_future(
            _run_stream(session, url, spec, out, incremental) if spec.stream
            else _run_whole(session, url, spec, out))
        if spec.action == "abort_early":
            done, _ = await asyncio.wait({main}, timeout=spec.delay_s)
            if not done:
                await _abort(session, url, spec, out, len(out.output_ids))
        await main
    except asyncio.CancelledError:
        out.error = out.error or "cancelled at the soak's time limit"
        raise
    except Exception as e:  # a client-side failure is a failed request, not a crash
        out.error = f"{type(e).__name__}: {e}"
    finally:
        out.seconds = time.monotonic() - t0
    return out


async def run_traffic(url: str, specs: list, concurrency: int, time_limit_s: float,
                      request_timeout_s: float, incremental: bool) -> dict:
    outcomes: dict = {s.idx: Outcome(error="not sent before the time limit") for s in specs}
    queue: asyncio.Queue = asyncio.Queue()
    for s in specs:
        queue.put_nowait(s)
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    conn = aiohttp.TCPConnector(limit=concurrency + 8)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:

        async def worker():
            while True:
                try:
                    spec = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                outcomes[spec.idx] = Outcome(error="cancelled at the soak's time limit")
                outcomes[spec.idx] = await run_one(session, url, spec, incremental)

        workers = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
        _, pending = await asyncio.wait(workers, timeout=time_limit_s)
        for w in pending:
            w.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return outcomes


# --- judging ----------------------------------------------------------------------------------


def judge(spec: Spec, out: Outcome) -> Optional[str]:
    """Why this request failed, or None."""
    if spec.action == "disconnect" and out.disconnected and out.error is None:
        return None
    if out.error is not None:
        return out.error
    if out.status != 200:
        return f"HTTP {out.status}"
    if spec.action in ("abort_early", "abort_decode") and out.abort_sent and out.finish == "abort":
        return None
    if out.finish not in NORMAL_FINISH:
        return f"finish reason {out.finish!r}"
    if out.finish == "length" and len(out.output_ids) != spec.sampling["max_new_tokens"]:
        return f"{len(out.output_ids)} output tokens, max_new_tokens {spec.sampling['max_new_tokens']}"
    return None


def kept_tokens(meta: Optional[dict]) -> Optional[list]:
    """The kept-token count after each stage of the request's (last) prefill, repeats removed
    (a request that dropped nothing reports one stage or one per stage, by its batch)."""
    entries = [e for e in (meta or {}).get("uniprefill") or [] if e.get("reason") != "decode"]
    if not entries:
        return None
    kept = entries[-1].get("kept_tokens") or []
    return [k for i, k in enumerate(kept) if i == 0 or k != kept[i - 1]]


def drop_outcome(meta: Optional[dict]) -> str:
    kept = kept_tokens(meta)
    if kept is None:
        return "none"
    return "dropped" if len(kept) > 1 else "dense"


def comparable(spec: Spec, out: Outcome) -> bool:
    return (spec.greedy and spec.action == "complete" and judge(spec, out) is None
            and out.finish in NORMAL_FINISH and (out.meta or {}).get("cached_tokens") == 0)


def replay(url: str, specs: list, outcomes: dict, max_replays: int, time_limit_s: float,
           rng: random.Random, timeout_s: float) -> dict:
    chosen = [s for s in specs if comparable(s, outcomes[s.idx])]
    n_comparable = len(chosen)
    if max_replays and len(chosen) > max_replays:
        # Every long, chunked and shared request first, then a sample of the short ones.
        big = [s for s in chosen if s.kind != "short"]
        short = [s for s in chosen if s.kind == "short"]
        chosen = big[:max_replays] + rng.sample(short, max(0, max_replays - len(big)))
    result = {"comparable": n_comparable, "replayed": 0, "replayed_dropped": 0, "mismatches": [], "drop_mismatches": [],
              "errors": [], "not_replayed_time_limit": 0}
    deadline = time.monotonic() + time_limit_s
    for i, spec in enumerate(chosen):
        if time.monotonic() > deadline:
            result["not_replayed_time_limit"] = len(chosen) - i
            break
        sp.flush_cache(url)
        r = requests.post(url + "/generate", json=spec.body(stream=False), timeout=timeout_s)
        result["replayed"] += 1
        result["replayed_dropped"] += drop_outcome(outcomes[spec.idx].meta) == "dropped"
        if r.status_code != 200:
            result["errors"].append({"idx": spec.idx, "status": r.status_code, "body": r.text[:300]})
            continue
        body = r.json()
        soak = outcomes[spec.idx]
        ids, meta = body.get("output_ids") or [], body.get("meta_info") or {}
        if meta.get("cached_tokens") != 0:
            result["errors"].append({"idx": spec.idx, "cached_tokens": meta.get("cached_tokens")})
        if ids != soak.output_ids:
            first = next((j for j, (a, b) in enumerate(zip(ids, soak.output_ids)) if a != b),
                         min(len(ids), len(soak.output_ids)))
            result["mismatches"].append({
                "idx": spec.idx, "kind": spec.kind, "prompt_tokens": len(spec.input_ids),
                "knobs": spec.sampling.get("custom_params"), "first_difference": first,
                "soak": soak.output_ids, "replay": ids})
        # Only a drop has kept counts to compare: a dense prefill reports the tokens of its
        # last chunk, and where the chunks were cut depends on the batch.
        drops = (drop_outcome(meta), drop_outcome(soak.meta))
        if drops != ("dense", "dense") and kept_tokens(meta) != kept_tokens(soak.meta):
            result["drop_mismatches"].append({
                "idx": spec.idx, "kind": spec.kind, "knobs": spec.sampling.get("custom_params"),
                "soak": kept_tokens(soak.meta), "replay": kept_tokens(meta)})
    return result


# --- the server -------------------------------------------------------------------------------


def check_server(url: str, server: Optional[sp.ServerProcess], idle_timeout_s: float) -> dict:
    """Pools at idle (ours), SGLang's idle check (the server survived it, no leak logged), and
    every KV slot free after a flush. A server that stopped answering is a problem recorded with
    its exit status and last log line, not a crash of the soak (the result is still written)."""
    try:
        return _check_live_server(url, server, idle_timeout_s)
    except (requests.RequestException, RuntimeError, TimeoutError) as e:
        problem = f"server unreachable: {type(e).__name__}: {e}"
        if server is not None:
            tail = server.log_text().strip().splitlines()[-1:] or [""]
            problem += (f" (alive: {server.alive()}, exit status {server.proc.returncode}, "
                        f"last log line: {tail[0][:300]!r})")
        return {"idle_wait_s": None, "state": None, "after_flush": None, "leaked_slots": 0,
                "problems": [problem], "unreachable": True}


def _check_live_server(url: str, server: Optional[sp.ServerProcess], idle_timeout_s: float):
    t0 = time.monotonic()
    state = sp.wait_pool_state(url, idle_timeout_s)
    idle_wait = time.monotonic() - t0
    problems = sp.idle_pool_problems(state)
    time.sleep(1.0)  # let the scheduler's idle loop run its own check at least once more
    health = sp.health_status(url)
    if health != 200:
        problems.append(f"/health answered {health}")
    if server is not None:
        if not server.alive():
            problems.append(f"server exited with {server.proc.returncode}")
        leaks = LEAK_PATTERN.findall(server.log_text())
        if leaks:
            problems.append(f"the server's log reports {len(leaks)} leak(s)")
    state_again = sp.pool_state(url)
    problems += [f"after 1 s: {p}" for p in sp.idle_pool_problems(state_again)]
    sp.flush_cache(url)
    flushed = sp.pool_state(url)
    if flushed["available_kv_tokens"] != flushed["max_total_num_tokens"]:
        problems.append(f"after /flush_cache {flushed['available_kv_tokens']} of "
                        f"{flushed['max_total_num_tokens']} KV slots free")
    return {"idle_wait_s": round(idle_wait, 2), "state": state, "after_flush": flushed,
            "leaked_slots": max(sp.leaked_slots(state), sp.leaked_slots(state_again),
                                flushed["max_total_num_tokens"] - flushed["available_kv_tokens"]),
            "problems": problems}


def start_server(args, extra: list, log_dir: Path) -> sp.ServerProcess:
    engine_kwargs = {}
    if args.cpu:
        engine_kwargs = dict(chunked_prefill_size=512, max_running_requests=8)
    cmd = sp.server_command(args.model_path, sp.free_port(), *extra, cpu=args.cpu,
                            engine_kwargs=engine_kwargs)
    busy_check = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1"} if args.busy_mem_check else {}
    env = sp.launch_env(args.cpu, str(REPO), **busy_check)
    print("server:", " ".join(cmd), flush=True)
    return sp.ServerProcess(cmd, log_dir / "server.log", env)


# --- main -------------------------------------------------------------------------------------


@dataclasses.dataclass
class SoakRun:
    """What one soak sent and what it saw, before it is judged."""
    info: dict  # the server's /server_info
    chunk: int  # its chunked prefill size (10**9: none)
    specs: list
    outcomes: dict
    checks: dict  # the pools after the traffic
    final: dict  # the pools after the replay (`checks` itself when nothing was replayed)
    replayed: dict
    startup_s: float
    traffic_s: float
    replay_s: float


def soak_config(args) -> dict:
    """The preset, with the sizes given on the command line in place of its own."""
    cfg = dict(PRESETS[args.preset])
    for key in cfg:
        value = getattr(args, key, None)
        if value is not None:
            cfg[key] = value
    return cfg


def soak(args, extra: list) -> dict:
    cfg = soak_config(args)
    rng = random.Random(args.seed)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    server = None if args.url else start_server(args, extra, log_dir)
    try:
        run = run_soak(args, extra, cfg, rng, server, t_start)
    finally:
        if server is not None:
            server.stop()
    return soak_result(args, extra, cfg, run, log_dir, t_start)


def connect(args, extra: list, cfg: dict, rng: random.Random,
            server: Optional[sp.ServerProcess]) -> tuple:
    """(url, /server_info, the prompts' token source, whether they are real text) of the local
    server at `--url`, or of `server` once healthy (the text is tokenized while it starts)."""
    n_firsts = cfg["requests"] + cfg["shared_groups"] * (cfg["group_size"] + 1) + 8
    if server is None:
        url = args.url.rstrip("/")
        assert re.match(r"^http://(127\.0\.0\.1|localhost)(:\d+)?$", url), (
            "the soak only talks to a local server")
        info = sp.server_info(url)
        use_tokenizer = not info.get("skip_tokenizer_init", False)
        return url, info, TokenSource(args.model_path, use_tokenizer, rng, n_firsts), use_tokenizer
    use_tokenizer = "--skip-tokenizer-init" not in extra
    tokens = TokenSource(args.model_path, use_tokenizer, rng, n_firsts)
    server.wait_healthy(args.start_timeout_s)
    return server.url, sp.server_info(server.url), tokens, use_tokenizer


def run_soak(args, extra: list, cfg: dict, rng: random.Random,
             server: Optional[sp.ServerProcess], t_start: float) -> SoakRun:
    """The plan, its traffic, the checks after it, the replay and the checks after that."""
    url, info, tokens, use_tokenizer = connect(args, extra, cfg, rng, server)
    startup_s = time.monotonic() - t_start
    chunk = int(info.get("chunked_prefill_size") or 0)
    chunk = chunk if chunk > 0 else 10**9
    incremental = bool(info.get("incremental_streaming_output", False))
    ignore_eos = None if use_tokenizer else True  # random weights: fixed-length answers
    specs = build_plan(cfg, tokens, chunk, rng, ignore_eos)
    print(f"plan: {len(specs)} requests, concurrency {cfg['concurrency']} "
          f"(max running {info.get('max_running_requests')}), chunked prefill {chunk}, "
          f"longest prompt {max(len(s.input_ids) for s in specs)} tokens", flush=True)

    t0 = time.monotonic()
    outcomes = asyncio.run(run_traffic(url, specs, cfg["concurrency"], cfg["time_limit_s"],
                                       cfg["request_timeout_s"], incremental))
    traffic_s = time.monotonic() - t0
    checks = check_server(url, server, cfg["idle_timeout_s"])
    t0 = time.monotonic()
    replayed, final = replay_and_recheck(url, server, specs, outcomes, checks, cfg, rng)
    return SoakRun(info=info, chunk=chunk, specs=specs, outcomes=outcomes, checks=checks,
                   final=final, replayed=replayed, startup_s=startup_s, traffic_s=traffic_s,
                   replay_s=time.monotonic() - t0)


def replay_and_recheck(url: str, server: Optional[sp.ServerProcess], specs: list,
                       outcomes: dict, checks: dict, cfg: dict, rng: random.Random) -> tuple:
    """(the replay, the pools after it); neither runs against a server that stopped answering."""
    if checks.get("unreachable"):
        replayed = {"comparable": sum(comparable(s, outcomes[s.idx]) for s in specs),
                    "replayed": 0, "replayed_dropped": 0, "mismatches": [],
                    "drop_mismatches": [], "errors": [], "not_replayed_time_limit": 0,
                    "not_replayed_server_unreachable": True}
        return replayed, checks
    replayed = replay(url, specs, outcomes, cfg["max_replays"], cfg["replay_time_limit_s"], rng,
                      cfg["request_timeout_s"])
    return replayed, check_server(url, server, cfg["idle_timeout_s"])


def tally(specs: list, outcomes: dict) -> tuple:
    """(counts of what the requests did, requests per kind, the failed requests)."""
    failures = []
    counts = {"served": 0, "aborted": 0, "abort_too_late": 0, "aborted_before_first_token": 0,
              "aborted_in_decode": 0, "disconnected": 0, "dropped": 0, "dense": 0,
              "cached_prefix": 0, "streamed": 0, "prompt_tokens": 0, "output_tokens": 0}
    by_kind: dict = {}
    for s in specs:
        out = outcomes[s.idx]
        why = judge(s, out)
        by_kind.setdefault(s.kind, 0)
        by_kind[s.kind] += 1
        if why is not None:
            failures.append({"idx": s.idx, "rid": s.rid, "kind": s.kind, "action": s.action,
                             "status": out.status, "finish": out.finish, "why": why})
            continue
        counts["streamed"] += s.stream
        counts["prompt_tokens"] += len(s.input_ids)
        counts["output_tokens"] += len(out.output_ids)
        if out.disconnected:
            counts["disconnected"] += 1
        elif out.abort_sent and out.finish == "abort":
            counts["aborted"] += 1
            key = "aborted_in_decode" if out.tokens_at_abort else "aborted_before_first_token"
            counts[key] += 1
        else:
            counts["served"] += 1
            counts["abort_too_late"] += out.abort_sent
            counts[drop_outcome(out.meta)] = counts.get(drop_outcome(out.meta), 0) + 1
            counts["cached_prefix"] += bool((out.meta or {}).get("cached_tokens"))
    return counts, by_kind, failures


def request_rows(specs: list, outcomes: dict) -> list:
    """One line per request for the result file."""
    return [{"idx": s.idx, "kind": s.kind, "action": s.action, "stream": s.stream,
             "prompt_tokens": len(s.input_ids), "sampling": s.sampling,
             "status": outcomes[s.idx].status, "finish": outcomes[s.idx].finish,
             "output_tokens": len(outcomes[s.idx].output_ids),
             "cached_tokens": (outcomes[s.idx].meta or {}).get("cached_tokens"),
             "seconds": round(outcomes[s.idx].seconds, 2),
             "error": outcomes[s.idx].error} for s in specs]


def soak_result(args, extra: list, cfg: dict, run: SoakRun, log_dir: Path,
                t_start: float) -> dict:
    """The result file's content: the settings, the counts, every failure and problem, the
    pools' states, the replay and one line per request."""
    counts, by_kind, failures = tally(run.specs, run.outcomes)
    checks, final, replayed = run.checks, run.final, run.replayed
    problems = checks["problems"] + [f"after the replay: {p}" for p in final["problems"]
                                     if final is not checks]
    summary = {
        "requests": len(run.specs), **counts, "failures": len(failures),
        "leaked_slots": max(checks["leaked_slots"], final["leaked_slots"]),
        "pool_problems": len(problems), "replayed": replayed["replayed"],
        "comparable": replayed["comparable"], "replay_mismatches": len(replayed["mismatches"]),
        "drop_mismatches": len(replayed["drop_mismatches"]),
        "replay_errors": len(replayed["errors"]), "startup_s": round(run.startup_s, 1),
        "traffic_s": round(run.traffic_s, 1), "replay_s": round(run.replay_s, 1),
        "wall_s": round(time.monotonic() - t_start, 1),
    }
    return {"config": {**cfg, "seed": args.seed, "server_args": extra, "url": args.url,
                       "chunked_prefill_size": run.chunk,
                       "max_running_requests": run.info.get("max_running_requests")},
            "kinds": by_kind, "summary": summary, "failures": failures, "problems": problems,
            "pools": {"after_traffic": checks, "after_replay": final},
            "replay": replayed, "log_dir": str(log_dir),
            "requests": request_rows(run.specs, run.outcomes)}


def print_table(result: dict) -> None:
    s = result["summary"]
    rows = [
        ("requests sent", s["requests"]),
        ("requests served (200, length/stop)", s["served"]),
        ("  of which dropped / dense / reused a cached prefix",
         f"{s['dropped']} / {s['dense']} / {s['cached_prefix']}"),
        ("intended aborts (before first token / in decode)",
         f"{s['aborted']} ({s['aborted_before_first_token']} / {s['aborted_in_decode']})"),
        ("aborts that came after the finish", s["abort_too_late"]),
        ("streams closed by the client", s["disconnected"]),
        ("failures", s["failures"]),
        ("leaked slots", s["leaked_slots"]),
        ("pool problems (ours and SGLang's)", s["pool_problems"]),
        ("replayed / comparable", f"{s['replayed']} / {s['comparable']}"),
        ("replay mismatches (output ids)", s["replay_mismatches"]),
        ("drop mismatches (kept tokens)", s["drop_mismatches"]),
        ("wall time s (start-up / traffic / replay)",
         f"{s['wall_s']} ({s['startup_s']} / {s['traffic_s']} / {s['replay_s']})"),
    ]
    width = max(len(r[0]) for r in rows)
    print("\n| what | count |\n|---|---|")
    for name, value in rows:
        print(f"| {name.ljust(width)} | {value} |")
    for f in result["failures"][:10]:
        print("failure:", f)
    for p in result["problems"]:
        print("problem:", p)
    for m in result["replay"]["mismatches"][:5]:
        print("replay mismatch:", {k: m[k] for k in ("idx", "kind", "knobs", "first_difference")})


def passed(result: dict) -> bool:
    s = result["summary"]
    return (s["failures"] == 0 and s["leaked_slots"] == 0 and s["pool_problems"] == 0
            and s["replay_mismatches"] == 0 and s["replay_errors"] == 0)


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True,
                   help="model folder (its config.json; its tokenizer unless the server skips it)")
    p.add_argument("--url", help="an already running local server instead of starting one")
    p.add_argument("--cpu", action="store_true",
                   help="start the server on SGLang's CPU engine (chunked prefill 512, 8 running)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="traffic size (default: cpu "
                   "with --cpu, else gpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--requests", type=int)
    p.add_argument("--concurrency", type=int)
    p.add_argument("--time-limit-s", type=float)
    p.add_argument("--replay-time-limit-s", type=float)
    p.add_argument("--max-replays", type=int, help="0: replay every comparable request")
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    p.add_argument("--no-busy-mem-check", dest="busy_mem_check", action="store_false",
                   help="leave out SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY=1, with which the "
                        "started server asserts its pool accounting after every batch")
    p.add_argument("--log-dir", help="where the server's log goes (default: a new temp folder)")
    p.add_argument("--out", help="JSON result file")
    args = p.parse_args(argv)
    args.preset = args.preset or ("cpu" if args.cpu else "gpu")
    return args, extra


def main(argv=None) -> int:
    args, extra = parse_args(argv)
    result = soak(args, extra)
    print_table(result)
    ok = passed(result)
    print("PASSED" if ok else "FAILED", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        model = args.model_path if args.cpu else f"{Path(args.model_path).name} shape"
        with open(args.out, "w") as f:
            json.dump({"header": result_header(model=model), **result, "passed": ok}, f, indent=1)
        print("wrote", args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
