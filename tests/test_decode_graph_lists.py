"""The per-stage decode-graph index lists' size (backends/common.py `decode_graph_entries`) and
the rule that sends a decode batch whose lists outgrow them to eager decode
(`decode_graph_fits`, read by the decode graph runner's hook in patches/cuda_graphs.py). The
graphs themselves run on the GPU only (tests/gpu/test_backends_gpu.py's `flashinfer_small_lists`
engine decodes batches past a forced small size eagerly and must answer as the graphs do)."""

from __future__ import annotations

import random
from types import SimpleNamespace

from uniprefill_sglang import environ
from uniprefill_sglang.backends.common import (
    DECODE_GRAPH_POOLS,
    decode_graph_entries,
    decode_graph_fits,
)


def _runtime(num_slots):
    # The two attributes the rule reads of a UniPrefillRuntime.
    return SimpleNamespace(slots=SimpleNamespace(num_slots=num_slots), decode_graph_entries=None)


def test_lists_hold_pools_not_upstream_width(monkeypatch):
    monkeypatch.delenv(environ.DECODE_GRAPH_ENTRIES.name, raising=False)
    rng = random.Random()
    for _ in range(50):
        slots, max_bs, context = rng.randrange(1, 10**6), rng.randrange(1, 512), rng.randrange(1, 2**18)
        runtime = _runtime(slots)
        entries = decode_graph_entries(runtime, max_bs * context)
        assert entries == min(max_bs * context, DECODE_GRAPH_POOLS * slots)
        assert runtime.decode_graph_entries == entries
        floor = rng.randrange(0, 10**6)
        assert decode_graph_entries(_runtime(slots), max_bs * context, floor) == max(floor, entries)
    # Llama-3.1-8B on an H200: 906,051 slots, 256 captured batch sizes x 131,072 positions.
    assert decode_graph_entries(_runtime(906_051), 256 * 131_072) == 1_812_102


def test_the_smallest_list_decides_and_the_switch_overrides(monkeypatch):
    runtime = _runtime(1000)
    monkeypatch.delenv(environ.DECODE_GRAPH_ENTRIES.name, raising=False)
    decode_graph_entries(runtime, 10**6)
    decode_graph_entries(runtime, 1500)  # a second backend (a hybrid's full-attention one)
    assert runtime.decode_graph_entries == 1500
    monkeypatch.setenv(environ.DECODE_GRAPH_ENTRIES.name, "700")
    assert decode_graph_entries(_runtime(1000), 10**6) == 700


def test_a_batch_fits_with_its_padding_rows():
    runtime = _runtime(1000)
    assert decode_graph_fits(runtime, 10**9, 8)  # no graph sized: nothing to outgrow
    runtime.decode_graph_entries = 2000
    assert decode_graph_fits(runtime, 1992, 8)
    assert not decode_graph_fits(runtime, 1993, 8)
    assert decode_graph_fits(None, 10**9, 8)
