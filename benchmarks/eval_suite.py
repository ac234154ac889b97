"""Long-context evaluation suite: dense vs UniPrefill on RULER-style tasks, in one engine.

Cases come from ``uniprefill_sglang/tools/tasks.py`` (generated locally, deterministic). Every
case is sent once dense (``custom_params={"uniprefill": False}``) and once per UniPrefill
configuration, greedy, streamed (time to first streamed chunk = TTFT). Per task and length it
reports dense accuracy, UniPrefill accuracy, agreement (UniPrefill correct on the cases dense
gets right), kept ratio per stage (token-weighted) and the TTFT ratio (dense / UniPrefill mean
TTFT, >1 is faster). Writes a JSON file and a PNG heat map (task x length; plus a line plot for
a sweep).

Targets: ``--base-url http://host:port`` (a running SGLang server, native ``/generate``; launch
it with ``--enable-uniprefill --disable-radix-cache``), or an ``sglang.Engine`` built here from
``--model`` (``smollm2`` / ``gemma3-270m`` from model_zoo, or a folder) and ``--engine-kwargs``
(JSON); without CUDA that is SGLang's CPU engine (uniprefill_sglang/tools/cpu_engine.py, float32).

RULER's families and haystacks: ``--tasks`` takes any of ``tasks.RULER_TASKS`` (adds multi-query,
common- and frequent-words extraction) and the retrieval tasks; ``--haystacks noise,prose,essay``
runs every needle task in each haystack (tools/haystacks.py). Every record carries both the
project's strict check (``correct``: whole words, no distractor named) and the benchmark's own
score (``score``, RULER's ``string_match_all``; ``bench_correct``: score 1); ``--scoring`` says
which one the printed tables count. ``--seeds`` takes a list or a named set's first seeds
(``reporting:2`` = 1000, 1001, ``test:1`` = 2000; tools/seeds.py: tuning, reporting = validation,
test); the seeds' set is recorded.

Shared context (SCBench's modes, tools/shared_context_tasks.py): ``--shared-tasks kv,niah``
adds cases of one context and ``--shared-queries`` queries, as separate requests
(``multi_request``) or a conversation (``multi_turn``), ``--shared-modes``. The engine then runs
with the radix cache on (every single case and every shared sequence starts from a flushed
cache). Per case: dense with the cache (the follow-ups hit the cached context), and per
UniPrefill configuration ``cache_on`` (the follow-ups reuse the first request's prefix, under the
server's prefix policy) and ``cache_off`` (the cache flushed before every follow-up: each request
selects for itself; its first request is ``cache_on``'s, the same request on an empty cache).
Scored with SCBench's retrieval rule (the answer appears in the output).

Sweeps (``--sweep``): ``none`` dense only; ``default`` dense vs UniPrefill at the engine's
settings (top-p 0.99 unless --engine-kwargs say otherwise); ``top_p`` / ``keep_ratio`` per
request in one engine; ``block_size`` / ``last_queries`` one engine per value (engine only);
``custom`` a list of configurations, each the request knobs it sends (``--sweep-values``: JSON
objects of ``custom_params``, ';'-separated), e.g. block-sparse attention with and without the
drops in one engine. A run that attends block-sparse records the realised density (the share of
causal key blocks attended, ``meta_info``'s ``block_sparse_density``) per case and its mean per
cell.

    python benchmarks/eval_suite.py --out benchmarks/results/eval_smollm2_cpu.json
    python benchmarks/eval_suite.py --sweep top_p --lengths 2048 --depths 0.5 --out top_p.json
    python benchmarks/eval_suite.py --base-url http://127.0.0.1:30000 --lengths 8192,32768
    python benchmarks/eval_suite.py --sweep custom --sweep-values \
        '{"uniprefill_block_sparse_top_p": 0.9, "uniprefill_keep_ratio": 1.0};{"uniprefill_block_sparse_top_p": 0.9}'
    python benchmarks/eval_suite.py --tasks niah_number,niah_multiquery,cwe \
        --haystacks noise,prose --seeds reporting:2 --scoring benchmark --shared-tasks kv,niah \
        --out ruler_scbench.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # result_header, also when loaded by path
from result_header import result_header  # noqa: E402

SWEEPS = ("none", "default", "top_p", "keep_ratio", "block_size", "last_queries", "custom")
# Values of each sweep (the paper's ablations; top-p 0.9-1.0).
SWEEP_VALUES = {
    "top_p": (0.9, 0.95, 0.99, 1.0),
    "keep_ratio": (0.2, 0.4, 0.6, 0.8),
    "block_size": (16, 32, 64, 128),
    "last_queries": (32, 64, 128, 256),
}
ENGINE_LEVEL = {"block_size": "uniprefill_block_size", "last_queries": "uniprefill_last_queries"}
DENSE = {"uniprefill": False}


# ---------------------------------------------------------------------------------------------
# targets


class EngineTarget:
    """An ``sglang.Engine`` (CPU engine without CUDA) serving dense and UniPrefill requests."""

    def __init__(self, model_path: str, engine_kwargs: dict):
        self.model_path = model_path
        self.engine_kwargs = engine_kwargs
        t0 = time.perf_counter()
        if _use_cpu_engine():
            from uniprefill_sglang.tools.cpu_engine import make_cpu_engine

            self.engine = make_cpu_engine(model_path, **engine_kwargs)
        else:
            import sglang

            self.engine = sglang.Engine(model_path=model_path, **engine_kwargs)
        self.startup_s = time.perf_counter() - t0

    def flush_cache(self) -> None:
        if not self.engine_kwargs.get("disable_radix_cache"):
            from uniprefill_sglang.tools.cpu_engine import flush_cache

            flush_cache(self.engine, timeout_s=120.0)

    def generate(self, input_ids: list, sampling_params: dict) -> dict:
        from uniprefill_sglang.tools.demo import timed_generate

        t0 = time.perf_counter()
        ttft, last = timed_generate(self.engine, input_ids, sampling_params)
        return _result(last, ttft, time.perf_counter() - t0)

    def close(self) -> None:
        self.engine.shutdown()


class HTTPTarget:
    """A running SGLang server (native ``/generate``, streamed)."""

    def __init__(self, base_url: str, timeout: float = 3600.0):
        import requests

        self.base_url = base_url.rstrip("/")
        self.session = requests.Session()
        self.timeout = timeout
        self.startup_s = 0.0
        info = self.session.get(f"{self.base_url}/get_model_info", timeout=60).json()
        self.model_path = info.get("model_path", base_url)

    def generate(self, input_ids: list, sampling_params: dict) -> dict:
        from uniprefill_sglang.tools.server_process import sse_events

        t0 = time.perf_counter()
        ttft, last = None, None
        with self.session.post(f"{self.base_url}/generate", stream=True, timeout=self.timeout,
                               json={"input_ids": input_ids, "sampling_params": sampling_params,
                                     "stream": True}) as r:
            r.raise_for_status()
            for event in sse_events(r.iter_lines()):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                last = event
        return _result(last, ttft, time.perf_counter() - t0)

    def flush_cache(self) -> None:
        # Identical prompts would reuse the dense pass's KV otherwise (server started without
        # --disable-radix-cache).
        from uniprefill_sglang.tools.server_process import flush_cache

        flush_cache(self.base_url, timeout_s=10.0)

    def close(self) -> None:
        self.session.close()


def _result(chunk: Optional[dict], ttft: Optional[float], e2e: float) -> dict:
    if chunk is None:
        raise RuntimeError("the server streamed no output")
    meta = chunk.get("meta_info", {})
    finish = meta.get("finish_reason")
    if isinstance(finish, dict) and finish.get("type") == "abort":
        # e.g. a prompt longer than the engine's KV pool allows: an empty answer would count
        # as a wrong one and leave the case out of the agreement silently
        raise RuntimeError(f"the engine aborted the request: {finish.get('message')}")
    up = (meta.get("uniprefill") or [{}])[-1]
    return {"text": chunk.get("text", ""), "ttft_s": ttft, "e2e_s": e2e,
            "prompt_tokens": meta.get("prompt_tokens"), "cached_tokens": meta.get("cached_tokens"),
            "enabled": up.get("enabled"), "reason": up.get("reason"),
            "kept_tokens": up.get("kept_tokens"), "dropped_mass": up.get("dropped_mass"),
            "prefix": up.get("prefix"), "block_sparse_density": up.get("block_sparse_density")}


def _use_cpu_engine() -> bool:
    flag = os.environ.get("UNIPREFILL_CPU_ENGINE")
    if flag is not None:
        return flag == "1"
    import torch

    return not torch.cuda.is_available()


def resolve_model(model: str) -> str:
    from uniprefill_sglang.tools.model_zoo import MODELS, prepare_model

    return prepare_model(model) if model in MODELS else model


# ---------------------------------------------------------------------------------------------
# the run


def configs_for(sweep: str, values: Optional[str] = None) -> list[dict]:
    """UniPrefill configurations: name, sweep parameter, value, engine kwargs, custom params.
    ``values`` (';'-separated) replaces the sweep's own; a top-p or keep ratio may be a
    comma-separated list, one per drop layer (``0.94,0.995;0.92,1.0``). ``custom`` takes JSON
    objects, each a configuration's ``custom_params``, named by its knobs."""
    if sweep == "none":
        return []
    if sweep == "default":
        return [{"name": "uniprefill", "param": None, "value": None, "engine": {}, "custom": {}}]
    if sweep == "custom":
        return [_custom_config(v) for v in (values or "").split(";") if v.strip()]
    if values is None:
        values = SWEEP_VALUES[sweep]
    else:
        kind = int if sweep in ENGINE_LEVEL else _fraction_or_list
        values = [kind(v) for v in values.split(";") if v]
    out = []
    for v in values:
        if sweep in ENGINE_LEVEL:
            out.append({"name": f"{sweep}={v}", "param": sweep, "value": v,
                        "engine": {ENGINE_LEVEL[sweep]: v}, "custom": {}})
        else:
            out.append({"name": f"{sweep}={v}", "param": sweep, "value": v, "engine": {},
                        "custom": {f"uniprefill_{sweep}": v}})
    return out


def _custom_config(text: str) -> dict:
    """One ``custom`` configuration: a JSON object of request knobs, checked as the server
    checks them (request_knobs.py: a typo or a value out of range fails here, not mid-run)."""
    from uniprefill_sglang.config import UniPrefillConfig
    from uniprefill_sglang.request_knobs import parse_request_knobs

    custom = json.loads(text)
    if not isinstance(custom, dict) or not custom:
        raise ValueError(f"a custom configuration is a non-empty JSON object of custom_params, "
                         f"got {text!r}")
    parse_request_knobs(custom, UniPrefillConfig())
    name = ",".join(f"{k.removeprefix('uniprefill_')}={v}" for k, v in custom.items())
    return {"name": name, "param": "custom", "value": name, "engine": {}, "custom": custom}


def _fraction_or_list(text: str):
    """A swept top-p or keep ratio: a number, or a comma-separated list kept as the request
    knob takes it (one per drop layer)."""
    return float(text) if "," not in text else text


def _record(case, res: dict) -> dict:
    score = case.score(res["text"])
    return {**res, "correct": case.check(res["text"]), "recall": case.recall(res["text"]),
            "score": score, "bench_correct": score == 1.0}


def case_label(case) -> str:
    """The row label: the task, and its haystack unless that is the default noise."""
    return case.task if case.haystack == "noise" else f"{case.task}/{case.haystack}"


def run_suite(target_factory, cases: Sequence, configs: list[dict], progress: bool = True,
              log=print, shared_cases: Sequence = (), only_dense_right: Optional[str] = None,
              checkpoint=None, dense_from: Optional[dict] = None) -> tuple[list[dict], dict]:
    """Serve every case dense and under every config. ``target_factory(engine_overrides)``
    returns a target; configs with different engine kwargs get their own target (in turn).
    ``shared_cases`` (shared_context_tasks.SharedCase) run after the single cases in each
    target (which must have its radix cache on); their rows are ``timing["shared_rows"]``.
    ``only_dense_right`` (``"correct"`` or ``"bench_correct"``): skip the UniPrefill requests of a
    single case dense gets wrong by that rule (its row has no run for the config).
    ``checkpoint(rows, shared_rows)``, if given, is called after every case (partial results).
    ``dense_from`` (case name -> an earlier run's dense record, see reusable_dense): those cases
    are not sent dense again (dense outputs do not change with the UniPrefill schedule); their
    TTFT ratios then compare with that earlier engine's dense TTFT."""
    from tqdm import tqdm

    rows = [{"name": c.name, "task": case_label(c), "family": c.task, "haystack": c.haystack,
             "metric": c.metric, "target_tokens": c.target_tokens,
             "n_tokens": c.n_tokens, "depth": c.depth, "seed": c.seed, "answers": c.answers,
             "runs": {}} for c in cases]
    shared_rows = [_shared_row(c) for c in shared_cases]
    groups: dict[str, list[dict]] = defaultdict(list)
    for cfg in configs:
        groups[json.dumps(cfg["engine"], sort_keys=True)].append(cfg)
    if not groups:
        groups["{}"] = []
    timing: dict[str, Any] = {"engines": []}
    dense_done = False
    for key, cfgs in groups.items():
        overrides = json.loads(key)
        t0 = time.perf_counter()
        target = target_factory(overrides)
        timing["engines"].append({"overrides": overrides, "startup_s": target.startup_s})
        try:
            # Warm-up, not recorded: an engine's first requests pay one-off costs that would
            # land on whichever of dense / UniPrefill goes first.
            if cases or shared_cases:
                warm = (cases[0].input_ids if cases
                        else shared_cases[0].queries[0].input_ids)[:1024]
                for custom in (DENSE, {}):
                    _flush(target)
                    target.generate(warm, {"temperature": 0.0, "max_new_tokens": 2,
                                           "custom_params": custom})
            n_req = (len(cases) * (len(cfgs) + 1)
                     + sum(len(c.queries) * (2 * len(cfgs) + 1) - len(cfgs)
                           for c in shared_cases))
            bar = tqdm(total=n_req, desc=f"engine {overrides or 'default'}", unit="req",
                       disable=not progress, file=sys.stderr)
            for case, row in zip(cases, rows):
                sp = {"temperature": 0.0, "max_new_tokens": case.max_new_tokens}
                # Dense in every engine too: TTFT ratios compare requests of one engine (engines
                # started minutes apart see different load; dense outputs do not change), unless
                # an earlier run's dense answer was given for the case.
                dense = (dense_from or {}).get(case.name)
                if dense is None:
                    _flush(target)
                    dense = _record(case, target.generate(
                        case.input_ids, {**sp, "custom_params": DENSE}))
                if not dense_done:
                    row["dense"] = dense
                bar.update(1)
                for cfg in cfgs:
                    if only_dense_right and not dense[only_dense_right]:
                        bar.update(1)
                        continue
                    _flush(target)
                    rec = _record(case, target.generate(
                        case.input_ids, {**sp, "custom_params": dict(cfg["custom"])}))
                    rec["dense_ttft_s"] = dense["ttft_s"]  # same engine
                    row["runs"][cfg["name"]] = rec
                    bar.update(1)
                bar.set_postfix_str(case.name)
                if checkpoint:
                    checkpoint(rows, shared_rows)
            for case, row in zip(shared_cases, shared_rows):
                _run_shared(target, case, row, cfgs, record_dense=not dense_done, bar=bar)
                bar.set_postfix_str(case.name)
                if checkpoint:
                    checkpoint(rows, shared_rows)
            bar.close()
            dense_done = True
        finally:
            target.close()
        timing["engines"][-1]["total_s"] = time.perf_counter() - t0
    if shared_cases:
        timing["shared_rows"] = shared_rows
    return rows, timing


def reusable_dense(paths: Sequence[str], cases: Sequence, model: str) -> dict:
    """The dense records of earlier eval_suite results of ``model`` for the cases that match one
    of ``cases`` by name, prompt and answers (same tokenizer and generator) and that ran whole (a
    request the engine refused or aborted has no answer to reuse), by case name; the first
    file holding a case gives its record. A result of another model (by its folder's name,
    which is the same where another machine keeps it) is refused (ValueError)."""
    wanted = {c.name: c for c in cases}
    found = {}
    for path in paths:
        earlier = json.loads(Path(path).read_text())
        if Path(earlier["meta"]["model"]).name != Path(model).name:
            raise ValueError(f"--dense-from {path}: a result of {earlier['meta']['model']}, "
                             f"not of {model}")
        for row in earlier["cases"]:
            case, dense = wanted.get(row["name"]), row.get("dense")
            if (case is None or dense is None or row["name"] in found
                    or row["n_tokens"] != case.n_tokens or row["answers"] != list(case.answers)
                    or dense.get("prompt_tokens") != case.n_tokens):
                continue
            found[row["name"]] = dense
    return found


def _flush(target) -> None:
    if hasattr(target, "flush_cache"):
        target.flush_cache()


def _shared_row(case) -> dict:
    return {"name": case.name, "task": f"shared_{case.task}" + (
                "" if case.haystack == "noise" else f"/{case.haystack}"),
            "mode": case.mode, "fmt": case.fmt, "target_tokens": case.target_tokens,
            "seed": case.seed, "context_tokens": len(case.context_ids),
            "queries": [{"turn": k, "n_tokens": len(q.input_ids), "answer": q.answer, "runs": {}}
                        for k, q in enumerate(case.queries)]}


def _shared_record(query, res: dict) -> dict:
    score = query.score(res["text"])
    return {**res, "correct": query.check(res["text"]), "score": score,
            "bench_correct": score == 1.0}


def _run_shared(target, case, row: dict, cfgs: list[dict], record_dense: bool, bar) -> None:
    """Dense with the cache, then per config the cached sequence (``cache_on``) and the
    follow-ups alone on a flushed cache (``cache_off``; its first request is ``cache_on``'s)."""
    sp = {"temperature": 0.0, "max_new_tokens": case.max_new_tokens}

    def send(q, custom):
        return _shared_record(q, target.generate(q.input_ids, {**sp, "custom_params": custom}))

    _flush(target)
    for q, qrow in zip(case.queries, row["queries"]):
        dense = send(q, DENSE)
        if record_dense:
            qrow["dense"] = dense
        bar.update(1)
    for cfg in cfgs:
        custom = dict(cfg["custom"])
        _flush(target)
        on = [send(q, custom) for q in case.queries]
        bar.update(len(on))
        off = [on[0]]
        for q in case.queries[1:]:
            _flush(target)
            off.append(send(q, custom))
            bar.update(1)
        for qrow, a, b in zip(row["queries"], on, off):
            qrow["runs"][cfg["name"]] = {"cache_on": a, "cache_off": b}


# ---------------------------------------------------------------------------------------------
# summaries


def summarize(rows: Sequence[dict], configs: list[dict]) -> dict:
    """Per config, per task, per length (and ``all``): accuracy, agreement, kept, TTFT."""
    out: dict[str, Any] = {}
    names = [c["name"] for c in configs] or [None]
    for name in names:
        cells: dict[str, dict] = {}
        by: dict[tuple, list] = defaultdict(list)
        for r in rows:
            for key in ((r["task"], str(r["target_tokens"])), (r["task"], "all"),
                        ("all", str(r["target_tokens"])), ("all", "all")):
                by[key].append(r)
        for (task, length), rs in sorted(by.items()):
            cells.setdefault(task, {})[length] = _cell(rs, name)
        out[name or "dense"] = cells
    return out


def _cell(rs: Sequence[dict], name: Optional[str]) -> dict:
    n = len(rs)
    dense_ok = [r for r in rs if r["dense"]["correct"]]
    cell = {"n": n, "dense_correct": len(dense_ok), "dense_acc": len(dense_ok) / n,
            "dense_recall": sum(r["dense"]["recall"] for r in rs) / n,
            "dense_ttft_s": sum(r["dense"]["ttft_s"] for r in rs) / n,
            "mean_tokens": sum(r["n_tokens"] for r in rs) / n}
    if "score" in rs[0]["dense"]:
        cell.update(_bench_cell(rs, name))
    if name is None:
        return cell
    # Rows without this config's run: skipped as dense got them wrong (--only-dense-right).
    rs = [r for r in rs if name in r["runs"]]
    cell["uniprefill_n"] = len(rs)
    if not rs:
        return cell
    runs = [r["runs"][name] for r in rs]
    up_ok = sum(u["correct"] for u in runs)
    agree = sum(r["runs"][name]["correct"] for r in dense_ok)
    kept = [u["kept_tokens"] for u in runs if u["kept_tokens"]]
    stages = max((len(k) for k in kept), default=0)
    per_stage = []
    for s in range(1, stages):
        num = sum(k[min(s, len(k) - 1)] for k in kept)
        per_stage.append(num / sum(k[0] for k in kept))
    up_ttft = sum(u["ttft_s"] for u in runs) / len(rs)
    dense_ttft = (sum(u.get("dense_ttft_s", r["dense"]["ttft_s"]) for u, r in zip(runs, rs))
                  / len(rs))
    reasons = sorted({u["reason"] for u in runs if u["reason"]})
    densities = [u["block_sparse_density"] for u in runs if u.get("block_sparse_density")]
    cell.update({
        "uniprefill_correct": up_ok, "uniprefill_acc": up_ok / len(rs),
        "uniprefill_recall": sum(u["recall"] for u in runs) / len(rs),
        "agree": agree, "agreement": agree / len(dense_ok) if dense_ok else None,
        "kept_ratio_per_stage": per_stage,
        "kept_ratio_final": per_stage[-1] if per_stage else 1.0,
        "uniprefill_ttft_s": up_ttft, "dense_ttft_same_engine_s": dense_ttft,
        "ttft_ratio": dense_ttft / up_ttft,
        "enabled": sum(bool(u["enabled"]) for u in runs), "dense_reasons": reasons,
        # the mean over the runs that attended block-sparse (None: none did)
        "block_sparse_density": sum(densities) / len(densities) if densities else None,
        "block_sparse_n": len(densities),
    })
    return cell


def _bench_cell(rs: Sequence[dict], name: Optional[str]) -> dict:
    """The benchmark's own rule (RULER string_match_all / part): right = score 1."""
    n = len(rs)
    ok = [r for r in rs if r["dense"]["bench_correct"]]
    cell = {"bench_dense_correct": len(ok),
            "bench_dense_score": sum(r["dense"]["score"] for r in rs) / n}
    if name is None:
        return cell
    ran = [r for r in rs if name in r["runs"]]
    if not ran:
        return cell
    agree = sum(r["runs"][name]["bench_correct"] for r in ok)
    cell.update({
        "bench_uniprefill_correct": sum(r["runs"][name]["bench_correct"] for r in ran),
        "bench_uniprefill_score": sum(r["runs"][name]["score"] for r in ran) / len(ran),
        "bench_agree": agree, "bench_agreement": agree / len(ok) if ok else None,
    })
    return cell


def summarize_shared(rows: Sequence[dict], configs: list[dict]) -> dict:
    """Per config, per shared task / mode / length (and ``all``), first requests and
    follow-ups apart, by SCBench's rule (``bench_correct``) and the strict check."""
    out: dict[str, Any] = {}
    for cfg in configs:
        name = cfg["name"]
        by: dict[tuple, list] = defaultdict(list)
        for r in rows:
            for key in ((r["task"], r["mode"], str(r["target_tokens"])),
                        (r["task"], r["mode"], "all"), ("all", "all", str(r["target_tokens"])),
                        ("all", "all", "all")):
                by[key].append(r)
        cells: dict = {}
        for (task, mode, length), rs in sorted(by.items()):
            cells.setdefault(task, {}).setdefault(mode, {})[length] = {
                part: _shared_cell([q for r in rs for q in r["queries"] if sel(q["turn"])], name)
                for part, sel in (("first", lambda t: t == 0), ("followup", lambda t: t > 0))}
        out[name] = cells
    return out


def _shared_cell(qs: Sequence[dict], name: str) -> dict:
    if not qs:
        return {"n": 0}
    cell: dict[str, Any] = {"n": len(qs), "mean_tokens": sum(q["n_tokens"] for q in qs) / len(qs)}
    for rule in ("bench_correct", "correct"):
        pre = "" if rule == "bench_correct" else "strict_"
        ok = [q for q in qs if q["dense"][rule]]
        cell[f"{pre}dense_correct"] = len(ok)
        for mode in ("cache_on", "cache_off"):
            cell[f"{pre}{mode}_correct"] = sum(q["runs"][name][mode][rule] for q in qs)
            agree = sum(q["runs"][name][mode][rule] for q in ok)
            cell[f"{pre}{mode}_agree"] = agree
    for mode in ("cache_on", "cache_off"):
        runs = [q["runs"][name][mode] for q in qs]
        kept = [u["kept_tokens"] for u in runs if u["kept_tokens"]]
        cell[f"{mode}_kept_final"] = (sum(k[-1] for k in kept) / sum(k[0] for k in kept)
                                      if kept else None)
        cell[f"{mode}_cached_tokens"] = sum(u["cached_tokens"] or 0 for u in runs) / len(runs)
        actions = defaultdict(int)
        for u in runs:
            if u.get("prefix"):
                actions[str(u["prefix"].get("action"))] += 1
        cell[f"{mode}_prefix_actions"] = dict(actions)
        reasons = defaultdict(int)
        for u in runs:
            reasons["dropped" if u["enabled"] else str(u["reason"])] += 1
        cell[f"{mode}_outcomes"] = dict(reasons)
        cell[f"{mode}_ttft_s"] = sum(u["ttft_s"] for u in runs) / len(runs)
    cell["dense_ttft_s"] = sum(q["dense"]["ttft_s"] for q in qs) / len(qs)
    return cell


def shared_markdown(summary: dict, name: str, lengths: Sequence[int]) -> str:
    cells = summary[name]
    lines = ["| shared task | mode | length | requests | dense right | UniPrefill right, cache "
             "off | agreement, cache off | UniPrefill right, cache on | agreement, cache on | "
             "kept (cache off) | cached tokens / request (cache on) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for task in sorted(t for t in cells if t != "all") + ["all"]:
        for mode in sorted(m for m in cells[task] if m != "all" or task == "all"):
            for length in [*map(str, lengths), "all"]:
                parts = cells[task][mode].get(length)
                if parts is None:
                    continue
                for part in ("first", "followup"):
                    c = parts[part]
                    if not c["n"]:
                        continue
                    kept = c["cache_off_kept_final"]
                    lines.append(
                        f"| {task} | {mode} | {length} {part} | {c['n']} | {c['dense_correct']} "
                        f"| {c['cache_off_correct']} | {c['cache_off_agree']}/{c['dense_correct']}"
                        f" | {c['cache_on_correct']} | {c['cache_on_agree']}/{c['dense_correct']}"
                        f" | {'-' if kept is None else f'{kept:.0%}'} | "
                        f"{c['cache_on_cached_tokens']:.0f} |")
    return "\n".join(lines)


def markdown(summary: dict, name: Optional[str], lengths: Sequence[int], tasks: Sequence[str],
             scoring: str = "strict") -> str:
    """Task x length table of one config (or dense only); ``scoring="benchmark"`` counts by the
    benchmark's own rule (``bench_*`` keys)."""
    cells = summary[name or "dense"]
    if scoring == "benchmark":
        cells = {t: {L: _as_bench(c) for L, c in by_len.items()} for t, by_len in cells.items()}
    if name is None:
        head = "| task | length | cases | dense correct | mean tokens | dense TTFT s |"
        lines = [head, "|---|---|---|---|---|---|"]
    else:
        head = ("| task | length | cases | dense correct | UniPrefill correct | agreement "
                "| kept after each drop | TTFT ratio |")
        lines = [head, "|---|---|---|---|---|---|---|---|"]
    for task in [*tasks, "all"]:
        for length in [*map(str, lengths), "all"]:
            c = cells.get(task, {}).get(length)
            if c is None or (task != "all" and length == "all" and len(lengths) == 1):
                continue
            if name is None:
                lines.append(f"| {task} | {length} | {c['n']} | {c['dense_correct']} | "
                             f"{c['mean_tokens']:.0f} | {c['dense_ttft_s']:.2f} |")
                continue
            if "uniprefill_correct" not in c:  # every case skipped (dense wrong)
                lines.append(f"| {task} | {length} | {c['n']} | {c['dense_correct']} | - | - "
                             "| - | - |")
                continue
            ag = "-" if c["agreement"] is None else f"{c['agree']}/{c['dense_correct']}"
            kept = ", ".join(f"{k:.0%}" for k in c["kept_ratio_per_stage"]) or "100%"
            up = (f"{c['uniprefill_correct']}" if c["uniprefill_n"] == c["n"]
                  else f"{c['uniprefill_correct']} of {c['uniprefill_n']} run")
            lines.append(f"| {task} | {length} | {c['n']} | {c['dense_correct']} | "
                         f"{up} | {ag} | {kept} | {c['ttft_ratio']:.2f}x |")
    return "\n".join(lines)


def _as_bench(c: dict) -> dict:
    c = dict(c)
    for key in ("dense_correct", "uniprefill_correct", "agree", "agreement"):
        if f"bench_{key}" in c:
            c[key] = c[f"bench_{key}"]
    return c


def sweep_markdown(summary: dict, configs: list[dict], scoring: str = "strict") -> str:
    """One row per config over all cases; ``scoring="benchmark"`` counts by the benchmark's own
    rule. A block-sparse density column where some config attended block-sparse."""
    cells = [summary[cfg["name"]]["all"]["all"] for cfg in configs]
    if scoring == "benchmark":
        cells = [_as_bench(c) for c in cells]
    sparse = any(c.get("block_sparse_density") is not None for c in cells)
    lines = ["| setting | cases | dense correct | UniPrefill correct | agreement | kept after "
             "last drop | kept after each drop | TTFT ratio |"
             + (" block-sparse density |" if sparse else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|" if sparse else "")]
    for cfg, c in zip(configs, cells):
        if "uniprefill_correct" not in c:  # every case skipped (dense wrong)
            lines.append(f"| {cfg['name']} | {c['n']} | {c['dense_correct']} | - | - | - | - "
                         "| - |" + (" - |" if sparse else ""))
            continue
        ag = "-" if c["agreement"] is None else f"{c['agree']}/{c['dense_correct']}"
        kept = ", ".join(f"{k:.0%}" for k in c["kept_ratio_per_stage"])
        density = c.get("block_sparse_density")
        lines.append(f"| {cfg['name']} | {c['n']} | {c['dense_correct']} | "
                     f"{c['uniprefill_correct']} | {ag} | {c['kept_ratio_final']:.0%} | {kept} | "
                     f"{c['ttft_ratio']:.2f}x |"
                     + ((" - |" if density is None else f" {density:.3f} |") if sparse else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# plots


def plot(summary: dict, configs: list[dict], tasks: Sequence[str], lengths: Sequence[int],
         path: str, title: str) -> list[str]:
    """Heat map(s) task x length: dense accuracy, UniPrefill accuracy (first config) and the
    kept ratio after the last drop; for a sweep also accuracy/kept vs the swept value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    written = []
    ref = configs[0]["name"] if len(configs) == 1 else None
    if configs and len(configs) > 1:
        ref = _reference_config(configs)
    panels = [("dense accuracy", ref, "dense_acc")]
    if ref is not None:
        panels += [(f"UniPrefill accuracy ({ref})", ref, "uniprefill_acc"),
                   (f"kept after last drop ({ref})", ref, "kept_ratio_final")]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels) + 1, 0.45 * len(tasks) + 1.6),
                             squeeze=False)
    for ax, (label, name, key) in zip(axes[0], panels):
        cells = summary[name or "dense"]
        grid = np.array([[cells[t].get(str(L), {}).get(key, np.nan) for L in lengths]
                          for t in tasks], dtype=float)
        ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(L) for L in lengths], fontsize=7)
        ax.set_yticks(range(len(tasks)), tasks if ax is axes[0][0] else [""] * len(tasks),
                      fontsize=7)
        ax.set_title(label, fontsize=8)
        ax.set_xlabel("prompt tokens", fontsize=7)
        for i in range(len(tasks)):
            for j in range(len(lengths)):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=6,
                        color="white" if grid[i, j] < 0.6 else "black")
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    written.append(path)
    if len(configs) > 1 and configs[0]["param"] is not None:
        sweep_path = str(Path(path).with_name(Path(path).stem + "_sweep.png"))
        xs = [c["value"] for c in configs]
        if any(isinstance(x, str) for x in xs):  # one value per drop: categories
            xs = [str(x) for x in xs]
        allc = [summary[c["name"]]["all"]["all"] for c in configs]
        fig, ax = plt.subplots(figsize=(4.5, 3))
        ax.plot(xs, [c["uniprefill_acc"] for c in allc], "o-", label="UniPrefill accuracy")
        ax.plot(xs, [c["agreement"] or 0 for c in allc], "s-", label="agreement with dense")
        ax.plot(xs, [c["kept_ratio_final"] for c in allc], "^-", label="kept after last drop")
        ax.axhline(allc[0]["dense_acc"], color="gray", ls="--", label="dense accuracy")
        ax.set_xlabel(configs[0]["param"], fontsize=8)
        if configs[0]["param"] in ENGINE_LEVEL:
            ax.set_xscale("log", base=2)
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=6)
        ax.set_title(title, fontsize=7)
        fig.tight_layout()
        fig.savefig(sweep_path, dpi=90)
        plt.close(fig)
        written.append(sweep_path)
    return written


def _reference_config(configs: list[dict]) -> str:
    """The default-like config of a sweep (top-p 0.99, block 64, 128 queries), else the first."""
    for c in configs:
        if (c["param"], c["value"]) in (("top_p", 0.99), ("block_size", 64),
                                         ("last_queries", 128), ("keep_ratio", 0.4)):
            return c["name"]
    return configs[0]["name"]


# ---------------------------------------------------------------------------------------------


def _machine() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}"
    except Exception:  # pragma: no cover
        pass
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"CPU {cpu}, {os.cpu_count()} cores, {mem:.0f} GiB"


def _task_spec(spec: str, lengths: list, haystacks: list) -> tuple[str, list, list]:
    """``TASK[/HAYSTACK][@L1+L2]`` -> (task, lengths, haystacks)."""
    spec, _, at = spec.partition("@")
    task, _, hay = spec.partition("/")
    return (task, [int(x) for x in at.split("+")] if at else lengths,
            [hay] if hay else haystacks)


def parse_args(argv=None):
    from uniprefill_sglang.tools.haystacks import HAYSTACKS
    from uniprefill_sglang.tools.shared_context_tasks import SHARED_FORMATS, SHARED_MODES
    from uniprefill_sglang.tools.tasks import FORMATS, RETRIEVAL_TASKS, RULER_TASKS, TASKS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    tgt = ap.add_mutually_exclusive_group()
    tgt.add_argument("--base-url", default=None, help="a running SGLang server")
    tgt.add_argument("--model", default="smollm2",
                     help="smollm2 | gemma3-270m (model_zoo) | a model folder (engine target)")
    ap.add_argument("--engine-kwargs", default="{}",
                    help='JSON of sglang.Engine kwargs, e.g. \'{"dtype": "bfloat16"}\'')
    ap.add_argument("--tasks", default=",".join(TASKS),
                    help=f"comma list of {RULER_TASKS + RETRIEVAL_TASKS} (may be empty); an "
                         "entry TASK/HAYSTACK sets that task's haystacks (instead of "
                         "--haystacks), TASK@L1+L2 its lengths (instead of --lengths), e.g. "
                         "niah_number/prose,cwe@2048")
    ap.add_argument("--haystacks", default="noise",
                    help=f"comma list of {HAYSTACKS}: the needle tasks run in each")
    ap.add_argument("--lengths", default="1024,2048,4096",
                    help="prompt token budgets (SmolLM2: up to 8000; its context is 8192)")
    ap.add_argument("--depths", default="0.5", help="needle depths in [0, 1], e.g. 0.1,0.5,0.9")
    ap.add_argument("--seeds", default="0",
                    help="comma list, or a named set's first seeds: reporting:2, tuning:3, test:1")
    ap.add_argument("--scoring", default="strict", choices=("strict", "benchmark"),
                    help="what the printed tables count: the strict check or the benchmark's "
                         "own rule (both are in the JSON)")
    ap.add_argument("--only-dense-right", action="store_true",
                    help="skip UniPrefill on single cases dense gets wrong (by --scoring)")
    ap.add_argument("--shared-tasks", default="",
                    help="comma list of shared-context tasks (kv, niah); radix cache on")
    ap.add_argument("--shared-modes", default=",".join(SHARED_MODES))
    ap.add_argument("--shared-queries", type=int, default=3)
    ap.add_argument("--shared-fmt", default="plain", choices=SHARED_FORMATS)
    ap.add_argument("--shared-lengths", default=None, help="default: --lengths")
    ap.add_argument("--shared-haystacks", default=None, help="niah's; default: --haystacks")
    ap.add_argument("--fmt", default="plain", choices=FORMATS)
    ap.add_argument("--sweep", default="default", choices=SWEEPS)
    ap.add_argument("--sweep-values", default=None,
                    help="';'-separated values replacing the sweep's own (top-p 0.9-1.0, ...); "
                         "a top-p or keep ratio may be one per drop: '0.975;0.94,0.995'; "
                         "--sweep custom: JSON objects of custom_params, e.g. "
                         "'{\"uniprefill_block_sparse_top_p\": 0.9, \"uniprefill_keep_ratio\": "
                         "1.0};{\"uniprefill_block_sparse_top_p\": 0.9}'")
    ap.add_argument("--dense-from", action="append", default=[],
                    help="an earlier result JSON of the same model (repeatable): its dense "
                         "answers are reused for the cases it holds (matched by name, prompt and "
                         "answers; requests that did not run whole are sent again)")
    ap.add_argument("--out", default="eval_suite.json", help="JSON path; PNG(s) beside it")
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    engine_kwargs = json.loads(args.engine_kwargs)
    if args.base_url is None and _use_cpu_engine():
        from uniprefill_sglang.tools.cpu_engine import activate_cpu_engine_env

        activate_cpu_engine_env()  # before anything imports sglang
    from transformers import AutoTokenizer

    from uniprefill_sglang.tools.shared_context_tasks import make_shared_cases
    from uniprefill_sglang.tools.tasks import (HAYSTACK_TASKS, fingerprint, make_cases,
                                              parse_seeds, seed_set)

    tasks = [t for t in args.tasks.split(",") if t]
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    seeds = parse_seeds(args.seeds)
    haystacks = [h for h in args.haystacks.split(",") if h]
    shared_tasks = [t for t in args.shared_tasks.split(",") if t]
    shared_modes = [m for m in args.shared_modes.split(",") if m]
    shared_lengths = ([int(x) for x in args.shared_lengths.split(",")] if args.shared_lengths
                      else lengths)
    shared_haystacks = ([h for h in args.shared_haystacks.split(",") if h]
                        if args.shared_haystacks else haystacks)
    if args.sweep_values is not None and args.sweep in ("none", "default"):
        raise SystemExit("--sweep-values needs a --sweep of top_p, keep_ratio, block_size, "
                         "last_queries or custom")
    if args.sweep == "custom" and not (args.sweep_values or "").strip():
        raise SystemExit("--sweep custom needs its configurations in --sweep-values")
    configs = configs_for(args.sweep, args.sweep_values)
    if shared_tasks and args.sweep in ("none",):
        raise SystemExit("--shared-tasks compares UniPrefill with dense: use a sweep with configs")
    started = datetime.datetime.now(datetime.timezone.utc)
    t_all = time.perf_counter()

    if args.base_url:
        if any(c["engine"] for c in configs):
            raise SystemExit(f"--sweep {args.sweep} restarts the engine per value; with "
                             "--base-url launch one server per value and use --sweep default")
        probe = HTTPTarget(args.base_url)
        model_path = probe.model_path
        factory = lambda overrides: probe  # noqa: E731 - one server for everything
        probe.close = lambda: None  # kept open across groups; closed below
    else:
        model_path = resolve_model(args.model)
        # The shared-context cases need the radix cache (flushed before every other request).
        base_kwargs = {"enable_uniprefill": True, "disable_radix_cache": not shared_tasks,
                       **engine_kwargs}

        def factory(overrides):
            return EngineTarget(model_path, {**base_kwargs, **overrides})

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    t0 = time.perf_counter()
    cases = []
    for spec in tasks:
        task, task_lengths, task_haystacks = _task_spec(spec, lengths, haystacks)
        cases += make_cases(tokenizer, [task], task_lengths, depths, seeds, args.fmt,
                            task_haystacks)
    shared = make_shared_cases(tokenizer, shared_tasks, shared_modes, shared_lengths, seeds,
                               args.shared_queries, args.shared_fmt, shared_haystacks)
    gen_s = time.perf_counter() - t0
    print(f"{len(cases)} cases ({len(tasks)} tasks x {len(haystacks)} haystacks x "
          f"{len(lengths)} lengths x {len(depths)} depths x {len(seeds)} seeds), "
          f"{len(shared)} shared-context cases ({sum(len(c.queries) for c in shared)} queries), "
          f"generated in {gen_s:.1f} s, fingerprint {fingerprint(cases)}; {len(configs)} "
          "UniPrefill configs", flush=True)
    rule = "bench_correct" if args.scoring == "benchmark" else "correct"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.stem + ".partial.json")

    def checkpoint(rows, shared_rows):  # what is done so far, removed once the run completes
        partial.write_text(json.dumps({"cases": rows, "shared_cases": shared_rows}, indent=1))

    # The header says where the run started: taken now, not when the result is written.
    header = result_header(model=model_path, argv=[
        "benchmarks/eval_suite.py", *(argv if argv is not None else sys.argv[1:])])
    dense_from = (reusable_dense(args.dense_from, cases, model_path) if args.dense_from
                  else None)
    if dense_from is not None:
        print(f"dense answers of {len(dense_from)}/{len(cases)} cases from "
              f"{', '.join(args.dense_from)}", flush=True)
    rows, timing = run_suite(factory, cases, configs, progress=not args.no_progress,
                             shared_cases=shared,
                             only_dense_right=rule if args.only_dense_right else None,
                             checkpoint=checkpoint, dense_from=dense_from)
    shared_rows = timing.pop("shared_rows", [])
    summary = summarize(rows, configs)
    shared_summary = summarize_shared(shared_rows, configs) if shared_rows else {}
    labels = list(dict.fromkeys(r["task"] for r in rows))
    all_lengths = sorted({r["target_tokens"] for r in rows})
    duration = time.perf_counter() - t_all
    result = {
        "header": header,
        "meta": {
            "date": started.date().isoformat(), "started_utc": started.isoformat(),
            "duration_s": duration, "machine": _machine(), "model": model_path,
            "target": args.base_url or "sglang.Engine", "engine_kwargs": engine_kwargs,
            "command": " ".join([os.path.relpath(sys.argv[0]) if sys.argv else "eval_suite",
                                 *(argv if argv is not None else sys.argv[1:])]),
            "tasks": tasks, "lengths": lengths, "depths": depths, "seeds": seeds,
            "seed_sets": sorted({seed_set(s) for s in seeds}), "haystacks": haystacks,
            "haystack_tasks": [t for t in tasks if _task_spec(t, [], [])[0] in HAYSTACK_TASKS],
            "scoring": args.scoring, "only_dense_right": args.only_dense_right,
            "shared": {"tasks": shared_tasks, "modes": shared_modes, "lengths": shared_lengths,
                       "queries": args.shared_queries, "fmt": args.shared_fmt,
                       "haystacks": shared_haystacks, "n_cases": len(shared)},
            "fmt": args.fmt, "sweep": args.sweep, "n_cases": len(cases),
            "case_fingerprint": fingerprint(cases), "case_generation_s": gen_s,
            "dense_from": ({"paths": args.dense_from, "cases": len(dense_from)}
                           if args.dense_from else None), **timing,
        },
        "configs": configs, "summary": summary, "cases": rows,
    }
    if shared_rows:
        result.update({"shared_summary": shared_summary, "shared_cases": shared_rows})
    out.write_text(json.dumps(result, indent=1))
    partial.unlink(missing_ok=True)
    title = (f"{Path(model_path).name}, {args.sweep}, {len(cases)} cases, "
             f"{started.date().isoformat()}")
    pngs = (plot(summary, configs, labels, all_lengths, str(out.with_suffix(".png")), title)
            if rows else [])
    result["meta"]["pngs"] = pngs
    out.write_text(json.dumps(result, indent=1))
    if not rows:
        pass
    elif args.sweep in ("none", "default"):
        print(markdown(summary, configs[0]["name"] if configs else None, all_lengths, labels,
                       args.scoring))
    else:
        print(sweep_markdown(summary, configs, args.scoring))
    for cfg in configs if shared_rows else []:
        print(f"shared context, {cfg['name']} (SCBench's rule):")
        print(shared_markdown(shared_summary, cfg["name"], shared_lengths))
    print(f"wrote {out} and {', '.join(pngs)} in {duration / 60:.1f} min")
    return result


if __name__ == "__main__":
    main()
