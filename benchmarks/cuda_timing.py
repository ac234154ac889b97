"""The one CUDA-event timer the kernel benchmarks share."""

from __future__ import annotations

import statistics

import torch


def median_ms(fn, repeats: int, warmup: int = 1) -> float:
    """Median milliseconds of `fn()` over `repeats` runs timed by CUDA events, after `warmup`
    untimed runs (the first pays compilation and planning)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
