"""The radix cache kept on for Qwen3-Next and LFM2 on the GPU (UNIPREFILL_HYBRID_PREFIX_CACHE=1):
test_hybrid_prefix_cache.py's checks with SGLang's GPU kernels, in bfloat16, decode CUDA graphs
on.

Skipped without CUDA. Run in a pytest process of its own:

    pytest tests/gpu/test_hybrid_prefix_cache_gpu.py -x -q

The models are the GPU tests' reduced Qwen3-Next (drops at 1 and 3, on FlashInfer and Triton)
and LFM2 (drops at 2 and 4, on FlashInfer: SGLang serves it on no other GPU backend), each with
the radix cache on (SGLang 0.5.17's UnifiedRadixCache with a recurrent-state component). The
workload is tests/hybrid_workload.py's. In bfloat16 a prefix computed in an earlier step rounds
otherwise than the same prompt computed whole, in stock SGLang as well, so a cached request is
held to dense over the same cached prefix; the exact comparison with an empty cache runs on the
CPU in float32.

On the H200 (2026-12-03, benchmarks/results/qwen3_next/gpu_prefix_cache_test_h200.json) the
Qwen3-Next engines passed every check, and dense with the cache empty differed from dense over
the cache from the 8th (FlashInfer) and 6th (Triton) greedy token. The three engines take more
than 280 s together (the FlashInfer one 3.6 min, compiling its kernels): give the run 420 s.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
pytest.register_assert_rewrite("test_hybrid_prefix_cache")

import test_lfm2_gpu  # noqa: E402
import test_qwen3_next_gpu  # noqa: E402
from engine_harness import random_model_results, serve_and_record  # noqa: E402
from hybrid_gpu import engine_kwargs  # noqa: E402
from hybrid_workload import prefix_cache_workload  # noqa: E402
from test_hybrid_prefix_cache import (DOC, FLAGS, FORCED, GREEDY, QUESTION,  # noqa: E402,F401
                                      SECOND, test_a_document_cached_dense_answers_as_dense,
                                      test_a_second_turn_kept_whole_answers_as_dense,
                                      test_a_second_turn_reuses_the_first_turns_survivors,
                                      test_nothing_left_behind,
                                      test_the_radix_cache_stays_on_without_state_snapshots_inside_a_step)

MODELS = {"qwen3_next": (test_qwen3_next_gpu.CONFIG, "1,3", ("flashinfer", "triton")),
          "lfm2": (test_lfm2_gpu.CONFIG, "2,4", ("flashinfer",))}
# One engine per model and backend: name -> its sglang.Engine arguments.
ENGINES = {
    f"{model}__{backend}": dict(engine_kwargs(drops, mem_fraction_static=0.2),
                                disable_radix_cache=False, attention_backend=backend)
    for model, (_, drops, backends) in MODELS.items() for backend in backends}
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def model_results():
    """Each model's engines' records (the models one after another, a model's engines at once)."""
    with contextlib.ExitStack() as stack:
        out = {}
        for model, (config, _, _) in MODELS.items():
            engines = {n: ENGINES[n] for n in ENGINES if n.startswith(f"{model}__")}
            gen = random_model_results(__file__, config, engines, TIMEOUT_S, f"cache_{model}_")
            out[model] = next(gen)
            stack.callback(gen.close)
        yield out


@pytest.fixture(scope="module", params=list(ENGINES))
def runs(request, model_results):
    res = dict(model_results[request.param.split("__")[0]][request.param])
    res["exact"] = False  # bfloat16: see the module docstring
    return res


def _workload(engine) -> dict:
    return prefix_cache_workload(engine, DOC, QUESTION, SECOND, GREEDY, FORCED)


if __name__ == "__main__":
    name, model_dir, out_path = sys.argv[1:4]
    os.environ.update(FLAGS)  # before the engine starts: its processes inherit them
    serve_and_record(name, ENGINES, {}, model_dir, out_path, _workload, 37000)
