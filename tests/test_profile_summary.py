"""benchmarks/profile_steps.py's trace summary on small hand-made Chrome traces: step count,
GPU busy time as a union of kernel intervals, kernel kinds, and synchronising calls attributed
to the Python frames around them."""

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from profile_steps import kernel_kind, summarize  # noqa: E402

OURS = "uniprefill_sglang/kv_validity.py(55): mark_written"


def _x(name, cat, ts, dur, tid=1):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def _write(tmp_path, events) -> str:
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events + [{"ph": "M", "name": "process_name"}]}, f)
    return str(path)


def test_decode_steps_busy_time_and_sync_sites(tmp_path):
    events = []
    for i in range(5):  # 5 graph launches 1000 us apart = 4 steps
        t = 1000 * i
        events += [
            _x("cudaGraphLaunch", "cuda_runtime", t + 100, 10),
            # two overlapping kernels (300 us of union) and a disjoint one (100 us)
            _x("nvjet_sm90_gemm", "kernel", t + 200, 200, tid=7),
            _x("flashinfer::BatchPrefillWithPagedKVCacheKernel", "kernel", t + 300, 200, tid=8),
            _x("void at::native::index_kernel", "kernel", t + 700, 100, tid=7),
            _x(OURS, "python_function", t + 10, 80),
            _x("torch/_tensor.py(1): __setitem__", "python_function", t + 20, 40),
            _x("cudaStreamSynchronize", "cuda_runtime", t + 30, 20),
        ]
    s = summarize(_write(tmp_path, events), "decode")
    assert s["steps"] == 4
    assert s["wall_ms_per_step"] == pytest.approx(1.0)
    assert s["gpu_busy_ms_per_step"] == pytest.approx(0.4)
    assert s["gpu_idle_ms_per_step"] == pytest.approx(0.6)
    assert s["kernel_ms_per_step_by_kind"] == pytest.approx(
        {"gemm": 0.2, "attention": 0.2, "other": 0.1})
    assert s["syncs_per_step"] == pytest.approx(1.0)
    (site,) = s["sync_sites"]
    assert site["count"] == 4 and site["site"] == OURS  # torch frames are skipped
    assert s["uniprefill_host_ms_per_step"][OURS] == pytest.approx(0.08)


def test_prefill_window_is_first_kernel_to_last(tmp_path):
    events = [
        _x("_score_stats_kernel", "kernel", 1000, 500, tid=7),
        _x("_select_kernel", "kernel", 2000, 500, tid=7),
        _x("cudaMemcpy", "cuda_runtime", 1600, 300),
    ]
    s = summarize(_write(tmp_path, events), "prefill")
    assert s["steps"] == 1
    assert s["wall_ms_per_step"] == pytest.approx(1.5)
    assert s["gpu_idle_ms_per_step"] == pytest.approx(0.5)
    assert s["kernel_ms_per_step_by_kind"] == pytest.approx({"uniprefill": 1.0})
    assert s["sync_sites"][0]["site"] == "(no python frame)"


def test_too_few_steps_is_reported_not_divided(tmp_path):
    s = summarize(_write(tmp_path, [_x("cudaGraphLaunch", "cuda_runtime", 0, 1)]), "decode")
    assert "error" in s


def test_kernel_kinds():
    assert kernel_kind("void flashinfer::PersistentVariableLengthMergeStatesKernel") == "attention"
    assert kernel_kind("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT") == "gemm"
    assert kernel_kind("_score_accum_kernel") == "uniprefill"
    assert kernel_kind("void at::native::reduce_kernel") == "other"
