"""Runs GPU test engines in subprocesses of their own and collects their JSON results.

Each GPU test module is also a script: `python <module> NAME MODEL_DIR OUT_JSON` starts the
engine configuration NAME, runs the module's workload and writes its results. This module starts
those processes (all at once, or one after another when they need the same GPUs), waits for them
within one time budget and hands the results to the tests; an engine that failed makes every
test touching it fail with the end of its log.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, Optional

import pytest
from uniprefill_sglang.tools.cpu_engine import idle_state

REPO_ROOT = Path(__file__).resolve().parent.parent.parent


def cuda_device_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def engine_env(tmp: Path) -> dict:
    """Environment of the engine subprocesses: the repo importable and, if the package is not
    installed where this interpreter looks (its `sglang.srt.plugins` entry point missing), a
    stand-in dist-info declaring it, so SGLang's plugin loader finds it in every process.
    UNIPREFILL_CHECK_KV_LENS is on unless the caller's environment says otherwise."""
    from importlib.metadata import entry_points

    paths = [str(REPO_ROOT)]
    if "uniprefill" not in {ep.name for ep in entry_points(group="sglang.srt.plugins")}:
        dist = tmp / "plugin_site" / "uniprefill_sglang_gputest-0.0.0.dist-info"
        dist.mkdir(parents=True, exist_ok=True)
        (dist / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: uniprefill-sglang-gputest\nVersion: 0.0.0\n")
        (dist / "entry_points.txt").write_text(
            "[sglang.srt.plugins]\nuniprefill = uniprefill_sglang.plugin:load\n")
        paths.insert(0, str(dist.parent))
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    # Every engine checks the host-side per-stage KV lengths against the device at each use.
    env = {"UNIPREFILL_CHECK_KV_LENS": "1", **os.environ}
    return dict(env, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(paths))


def log_dir_or(tmp: Path) -> Path:
    """UNIPREFILL_GPU_TEST_LOG_DIR keeps the engines' logs and results; else the temp folder."""
    logs = Path(os.environ.get("UNIPREFILL_GPU_TEST_LOG_DIR") or tmp)
    logs.mkdir(parents=True, exist_ok=True)
    return logs


def run_engines(script: str, names: Iterable[str], model_dir: str, tmp: Path, logs: Path,
                timeout_s: float, prefix: str, concurrent: bool = True):
    """Run `python script NAME model_dir tmp/NAME.json` for every name; returns (results by
    name, failure messages by name). All engines share the timeout_s budget."""
    names = list(names)
    env, t0 = engine_env(tmp), time.time()
    out, failed = {}, {}

    def start(name):
        log = open(logs / f"{prefix}{name}.log", "w")
        proc = subprocess.Popen([sys.executable, script, name, model_dir, str(tmp / f"{name}.json")],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
        return proc, log

    def finish(name, proc, log):
        try:
            rc = proc.wait(timeout=max(1, timeout_s - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "timeout"
        log.close()
        if rc == 0:
            out[name] = json.loads((tmp / f"{name}.json").read_text())
        else:
            failed[name] = f"engine {name} failed (rc {rc}):\n" + (
                logs / f"{prefix}{name}.log").read_text()[-8000:]

    if concurrent:
        procs = {name: start(name) for name in names}
        for name, (proc, log) in procs.items():
            finish(name, proc, log)
    else:
        for name in names:
            finish(name, *start(name))
    (logs / f"{prefix}results.json").write_text(json.dumps(out))
    print(f"{prefix}engines: {time.time() - t0:.0f} s wall, failed: {sorted(failed)}")
    return out, failed


class EngineResults:
    """Engine results by name; a test touching an engine that failed fails with its log, one
    touching an engine that did not run (`skipped`: name -> why) is skipped saying why."""

    def __init__(self, out: dict, failed: dict, skipped: Optional[dict] = None):
        self.out, self.failed, self.skipped = out, failed, skipped or {}

    def __getitem__(self, name: str) -> dict:
        if name in self.skipped:
            pytest.skip(f"engine {name}: {self.skipped[name]}")
        if name in self.failed:
            pytest.fail(self.failed[name])
        res = self.out[name]
        errors = res.get("errors")
        if errors:
            pytest.fail(f"engine {name}: scenarios failed: {errors}")
        return res


def serve_and_record(name: str, engines: dict, engine_kwargs: dict, model_dir: str,
                     out_path: str, workload, port_base: int) -> None:
    """The script side: start engine configuration `name`, run `workload(engine)` (a dict of
    results), write them to `out_path` as JSON, and shut the engine down."""
    import sglang

    engine = sglang.Engine(model_path=model_dir, port=port_base + 100 * list(engines).index(name),
                           **engine_kwargs, **engines[name])
    try:
        res = workload(engine)
    finally:
        engine.shutdown()
    Path(out_path).write_text(json.dumps(res))


# The workload of the hybrid-model tests: 16 greedy tokens, dense or at a forced keep.
GREEDY = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
FORCED = dict(GREEDY, custom_params={"uniprefill_keep_ratio": [0.3, 0.6]})


def relative_distance(got: list, want: list) -> float:
    """The largest relative L2 distance between two lists of hidden-state vectors (NaN if
    either holds a NaN, so that no bound passes it)."""
    import math

    worst = 0.0
    for a, b in zip(got, want, strict=True):
        norm = math.sqrt(sum(y * y for y in b))
        dist = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b, strict=True)))
        if dist != dist or norm != norm:
            return math.nan
        worst = max(worst, dist / norm if norm else dist)
    return worst


def random_prompts(vocab_size: int, lengths=(3000, 1900)) -> list:
    """Seeded random token ids, one prompt per length (seeds 1, 2, ...)."""
    prompts = []
    for seed, n in enumerate(lengths, start=1):
        rng = random.Random(seed)
        prompts.append([rng.randrange(3, vocab_size) for _ in range(n)])
    return prompts


def forced_keep_workload(engine, prompt: list, other: list, greedy: dict = GREEDY,
                         forced: dict = FORCED, top2: bool = False, hidden: bool = False) -> dict:
    """`prompt` dense (UniPrefill off per request), at top-p 1.0 and at a forced keep; `other`
    at the forced keep; both batched; then the idle state and whether decode CUDA graphs were
    on. With `top2`, each output token's two largest log-probabilities too (how close a greedy
    choice was, where two kernels' bfloat16 rounding may flip it). With `hidden` (the engine
    started with `enable_return_hidden_states`), the final hidden state of the prompt's last
    row and of each decode step for `prompt` alone: they depend on every layer's attention
    over the survivors, where the top-2 log-probabilities of a random model barely do."""
    extra = dict(return_logprob=True, top_logprobs_num=2) if top2 else {}

    def record(out) -> dict:
        rec = {"output_ids": out["output_ids"], "uniprefill": out["meta_info"]["uniprefill"]}
        if top2:
            rec["top2"] = [[lp for lp, *_ in step[:2]]
                           for step in out["meta_info"]["output_top_logprobs"]]
        return rec

    def one(ids, params, with_hidden=False):
        args = dict(extra, return_hidden_states=True) if with_hidden else extra
        out = engine.generate(input_ids=ids, sampling_params=params, **args)
        rec = record(out)
        if with_hidden:  # the prefill's rows (the survivors' last is the prompt's), then decode
            states = out["meta_info"]["hidden_states"]
            rec["hidden"] = [states[0][-1]] + list(states[1:])
        return rec

    res = {"dense": one(prompt, dict(greedy, custom_params={"uniprefill": False}), hidden),
           "full": one(prompt, dict(greedy, custom_params={"uniprefill_top_p": 1.0})),
           "forced": one(prompt, forced, hidden), "other": one(other, forced),
           "batch": [record(o) for o in engine.generate(input_ids=[prompt, other],
                                                        sampling_params=forced, **extra)]}
    res["state"] = idle_state(engine)
    res["cuda_graph"] = not engine.get_server_info().get("disable_cuda_graph", True)
    return res


def agreeing_prefix(a: list, b: list) -> int:
    """How many leading tokens two greedy outputs share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _last_meta(rec) -> dict:
    return rec["uniprefill"][-1]


def check_top_p_one_as_dense(res: dict, prompt_len: int, stages: int) -> None:
    """`forced_keep_workload`'s top-p 1.0 request kept every token at each of the `stages`
    and answered token for token as dense in the same engine, decode on CUDA graphs."""
    meta = _last_meta(res["full"])
    assert meta["kept_tokens"] == [prompt_len] * stages, meta
    assert res["full"]["output_ids"] == res["dense"]["output_ids"], \
        (res["full"]["output_ids"], res["dense"]["output_ids"])
    assert res["cuda_graph"]


def first_unexplained_difference(a: dict, b: dict, slack: float = 4.0,
                                 cap: float = 0.5) -> Optional[int]:
    """The step at which two greedy runs of one request (`forced_keep_workload` records with
    `top2`) first part for a reason rounding does not explain, or None.

    Where a model's layers round differently by batch composition (SGLang's fused MoE picks its
    tiling by the batch's token count), two runs that should agree may flip a near tie. A first
    difference at step i is explained when `a`'s two best log-probabilities at i lie within
    `slack` times the largest difference between the two runs' log-probabilities on the steps
    before i, where both had the same context, and that difference is at most `cap` nats (the
    GPU modules' random models spread their logits over about one nat: a difference that large
    is no rounding). A difference at the first step, or after bit-identical steps, is never
    explained; a NaN never is."""
    ids_a, ids_b = a["output_ids"], b["output_ids"]
    if len(ids_a) != len(ids_b):
        return min(len(ids_a), len(ids_b))
    noise = 0.0
    for i, (x, y) in enumerate(zip(ids_a, ids_b)):
        top_a, top_b = a["top2"][i], b["top2"][i]
        if any(v != v for v in (*top_a, *top_b)):
            return i
        if x != y:
            return None if top_a[0] - top_a[1] <= slack * noise and noise <= cap else i
        noise = max(noise, *(abs(u - v) for u, v in zip(top_a, top_b)))
    return None


def within_block(got: list, want: list, block: int) -> bool:
    """Kept counts per stage equal, or within `block` tokens of each other."""
    return len(got) == len(want) and all(abs(g - w) <= block for g, w in zip(got, want))


def check_forced_keep(res: dict, prompt_len: int, last_below: float,
                      no_reason: bool = False, batch_rounding_block: int = 0) -> None:
    """`forced_keep_workload`'s forced keep dropped to under `last_below` of the prompt by its
    last stage (with `no_reason`, without any fallback reason) and answered the same batched
    with the other prompt. With `batch_rounding_block` (a model that rounds differently by
    batch composition, recorded with `top2`), batched kept counts may differ from alone by up
    to that many tokens a stage and the tokens may part where `first_unexplained_difference`
    finds a near tie."""
    meta = _last_meta(res["forced"])
    kept = meta["kept_tokens"]
    assert meta["enabled"] and kept[0] == prompt_len, meta
    assert not no_reason or meta["reason"] is None, meta
    assert kept[-1] < last_below * prompt_len, kept
    alone = [res["forced"], res["other"]]
    if not batch_rounding_block:
        assert [_last_meta(o)["kept_tokens"] for o in res["batch"]] == \
            [_last_meta(o)["kept_tokens"] for o in alone]
        assert [o["output_ids"] for o in res["batch"]] == [o["output_ids"] for o in alone]
        return
    for got, want in zip(res["batch"], alone, strict=True):
        assert within_block(_last_meta(got)["kept_tokens"], _last_meta(want)["kept_tokens"],
                            batch_rounding_block), (_last_meta(got), _last_meta(want))
        step = first_unexplained_difference(want, got)
        assert step is None, (step, want["output_ids"], got["output_ids"], want["top2"][step:],
                              got["top2"][step:])


def check_chunked_as_whole(whole: dict, chunked: dict, batch_rounding_block: int = 0) -> None:
    """The same engine chunked keeps what it keeps whole (the final chunk scores the whole
    prompt with its last queries) and answers alike as far as dense itself does: stock
    SGLang's chunked prefill rounds differently in bfloat16 (a chunk attends to its prefix and
    to itself in two merged passes), so dense may answer otherwise chunked (on the H200, LFM2
    on FlashInfer from its 7th token). With `batch_rounding_block`, as in `check_forced_keep`
    (a chunk is another batch composition than the whole prompt)."""
    got, want = _last_meta(chunked["forced"]), _last_meta(whole["forced"])
    if batch_rounding_block:
        assert within_block(got["kept_tokens"], want["kept_tokens"],
                            batch_rounding_block), (got, want)
    else:
        assert got["kept_tokens"] == want["kept_tokens"]
    horizon = agreeing_prefix(chunked["dense"]["output_ids"], whole["dense"]["output_ids"])
    assert horizon >= 4, (chunked["dense"]["output_ids"], whole["dense"]["output_ids"])
    for key in ("forced", "full"):
        if chunked[key]["output_ids"][:horizon] == whole[key]["output_ids"][:horizon]:
            continue
        assert batch_rounding_block, key
        step = first_unexplained_difference(whole[key], chunked[key])
        assert step is None or step >= horizon, (key, step, chunked[key], whole[key])


def check_nothing_left(state: dict) -> None:
    """Idle, nothing parked, every KV slot free."""
    assert state["idle"] and state["parked_requests"] == 0, state
    assert state["available_kv_tokens"] == state["max_total_num_tokens"], state


def selected_engines(engines: dict, unsupported: Optional[dict] = None) -> tuple:
    """(names to run, skipped: name -> why): every engine but those the model's SGLang does
    not serve (`unsupported`: name -> why) and, when UNIPREFILL_GPU_TEST_ENGINES names some
    (a comma list), those it does not name."""
    skipped = dict(unsupported or {})
    chosen = os.environ.get("UNIPREFILL_GPU_TEST_ENGINES")
    if chosen:
        wanted = set(chosen.split(","))
        skipped.update({n: "not in UNIPREFILL_GPU_TEST_ENGINES" for n in engines
                        if n not in wanted and n not in skipped})
    return [n for n in engines if n not in skipped], skipped


def random_model_results(script: str, config: dict, engines: dict, timeout_s: float,
                         prefix: str, unsupported: Optional[dict] = None,
                         dtype: str = "float32"):
    """A module fixture's body: a random-weight model of `config` in a temporary folder, the
    engines of `engines` that `selected_engines` picks run on it by `script`; yields their
    EngineResults (skips without CUDA). `dtype`: the weights' as stored (`random_model`)."""
    import tempfile

    if cuda_device_count() < 1:
        pytest.skip("CUDA not available")
    from uniprefill_sglang.tools.model_zoo import random_model

    names, skipped = selected_engines(engines, unsupported)
    with tempfile.TemporaryDirectory(prefix=f"uniprefill-{prefix}") as tmp:
        tmp = Path(tmp)
        model_dir = random_model(tmp / "model", config, dtype=dtype)
        yield EngineResults(*run_engines(script, names, model_dir, tmp, log_dir_or(tmp),
                                         timeout_s, prefix=prefix), skipped)
