"""Does stock SGLang's FlashInfer backend apply Gemma 3's sliding window in a prefill?

UniPrefill is not loaded here (SGLANG_PLUGINS names another plugin) except in `fi_uniprefill`:
every other engine is stock SGLang. The model is the reduced random Gemma 3 of tests/gpu/test_gemma3_gpu.py (sliding window
128 on five of its eight layers), the prompt 3,000 tokens with no cached prefix, so SGLang plans
FlashInfer's ragged prefill. Each engine reports the final hidden state of the prompt's last row
and of 8 decode steps; the distance to torch_native's (which masks the window itself) is the
finding:

* `fi` near 0 (bfloat16 rounding, about 1%): FlashInfer applies the window;
* `fi` far and `fi_paged` (SGLANG_FLASHINFER_USE_PAGED=1, the paged prefill that is passed the
  window) near: the ragged prefill ignores the window;
* the `*_wide` engines run a copy of the model whose window (4,096) covers the whole prompt, so
  a sliding layer is a full one: there `fi_wide` must be near `tn_wide` whatever the ragged path
  does, which rules out any other cause of a distance.
* `fi_uniprefill` is FlashInfer with `--enable-uniprefill` and no drop layer: the plugin's
  start-up correction (backends/flashinfer.py `window_in_prefill`) must bring it near `tn`.

Found on an H200 (2026-12-04): `fi` 53% from `tn` (the window's own effect, `tn_wide` against
`tn`, is 53% too), `fi_paged` 0.8%, `fi_wide` 0.9% from `tn_wide`: the ragged prefill of SGLang
0.5.17 leaves the window out.

    python benchmarks/gemma3_flashinfer_window.py --out results/gemma3/flashinfer_window.json

Needs CUDA; the engines run at once, each in a process of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "gpu"))

STOCK = {"SGLANG_PLUGINS": "not-uniprefill"}
# name: (attention backend, sliding window, extra environment)
ENGINES = {
    "tn": ("torch_native", 128, STOCK),
    "fi": ("flashinfer", 128, STOCK),
    "fi_paged": ("flashinfer", 128, dict(STOCK, SGLANG_FLASHINFER_USE_PAGED="1")),
    "tn_wide": ("torch_native", 4096, STOCK),
    "fi_wide": ("flashinfer", 4096, STOCK),
    "fi_uniprefill": ("flashinfer", 128, {}),
}
DECODE_STEPS = 8


def serve(model_dir: str, backend: str, out_path: str) -> None:
    """The child side: one engine, one dense greedy request, hidden states out."""
    import sglang
    from test_gemma3_gpu import PROMPT

    plugin = "SGLANG_PLUGINS" not in os.environ
    extra = dict(enable_uniprefill=True, uniprefill_drop_layers="none") if plugin else {}
    engine = sglang.Engine(**extra,
                           model_path=model_dir, attention_backend=backend,
                           skip_tokenizer_init=True, dtype="bfloat16", context_length=8192,
                           disable_radix_cache=True, enable_return_hidden_states=True,
                           mem_fraction_static=0.15, max_total_tokens=32768, random_seed=0,
                           chunked_prefill_size=8192,
                           # Stock 0.5.17's prefill graph pads this prompt to 3,072 rows and
                           # FlashInfer's prefill then refuses it (q of 3,072 rows against a
                           # qo_indptr of 3,000): H200, 2026-12-04.
                           disable_prefill_cuda_graph=True)
    try:
        out = engine.generate(input_ids=PROMPT, return_hidden_states=True, sampling_params={
            "temperature": 0.0, "max_new_tokens": DECODE_STEPS, "ignore_eos": True})
    finally:
        engine.shutdown()
    states = out["meta_info"]["hidden_states"]
    Path(out_path).write_text(json.dumps({"output_ids": out["output_ids"],
                                          "hidden": [states[0][-1]] + list(states[1:])}))


def main() -> None:
    from test_gemma3_gpu import CONFIG
    from uniprefill_sglang.tools.model_zoo import random_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="result JSON, relative to benchmarks/")
    args = parser.parse_args()
    out_path = HERE / args.out
    out_path.parent.mkdir(parents=True, exist_ok=True)
    runs, logs = {}, {}
    with tempfile.TemporaryDirectory(prefix="gemma3-window-") as tmp:
        tmp = Path(tmp)
        models = {}
        for window in sorted({w for _, w, _ in ENGINES.values()}):
            models[window] = random_model(tmp / f"model_{window}",
                                          dict(CONFIG, sliding_window=window))
        procs = {}
        for name, (backend, window, extra_env) in ENGINES.items():
            env = dict(os.environ, **extra_env)
            if "SGLANG_PLUGINS" not in extra_env:
                env.pop("SGLANG_PLUGINS", None)
            procs[name] = subprocess.Popen(
                [sys.executable, __file__, "--serve", models[window], backend,
                 str(tmp / f"{name}.json")], env=env, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True)
        for name, proc in procs.items():
            log, _ = proc.communicate(timeout=600)
            if proc.returncode == 0:
                runs[name] = json.loads((tmp / f"{name}.json").read_text())
            else:
                logs[name] = log[-4000:]
            print(name, "rc", proc.returncode, flush=True)
            save(out_path, runs, logs)  # as it goes: a later engine may be cut off


def distance(runs: dict, name: str, ref: str):
    """Relative L2 distance of `name`'s final hidden states to `ref`'s: the prompt's last row
    and each decode step (None until both ran)."""
    from engine_harness import relative_distance

    if name not in runs or ref not in runs:
        return None
    got, want = runs[name]["hidden"], runs[ref]["hidden"]
    return {"prompt_last_row": relative_distance(got[:1], want[:1]),
            "decode_steps": [relative_distance([g], [w]) for g, w in zip(got[1:], want[1:])],
            "same_tokens": runs[name]["output_ids"] == runs[ref]["output_ids"]}


def save(out_path: Path, runs: dict, logs: dict) -> None:
    from result_header import result_header
    from test_gemma3_gpu import PROMPT

    summary = {"fi_vs_tn": distance(runs, "fi", "tn"),
               "fi_paged_vs_tn": distance(runs, "fi_paged", "tn"),
               "fi_wide_vs_tn_wide": distance(runs, "fi_wide", "tn_wide"),
               "fi_uniprefill_vs_tn": distance(runs, "fi_uniprefill", "tn"),
               "window_effect_tn": distance(runs, "tn_wide", "tn")}
    print(json.dumps(summary), flush=True)
    out_path.write_text(json.dumps({
        "header": result_header(model="reduced Gemma 3 (tests/gpu/test_gemma3_gpu.py), random "
                                      "weights, bfloat16", note=f"prompt {len(PROMPT)} tokens, "
                                      "UniPrefill loaded in fi_uniprefill only"),
        "engines": {n: {"attention_backend": b, "sliding_window": w, "env": e}
                    for n, (b, w, e) in ENGINES.items()},
        "summary": summary, "failed": logs}, indent=1))

if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--serve":
        serve(*sys.argv[2:])
    else:
        main()
