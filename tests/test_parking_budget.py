"""Parking is admitted against the device memory its rejoin needs (parking.RejoinCost).

A chunked prompt parks its earlier chunks' rows at the first drop layer and they go through
every later layer with the final chunk in one step, each sublayer over them in pieces of at most
a chunk. On one H200 (Llama-3.1-8B shape, bf16, 7.7-8.2 GiB free after start-up), before the
attention sublayers ran in pieces, a 131,000-token prompt fitted with keep 0.5 at the first drop
and ran out of memory under top-p, where nearly every row rejoins. The count now holds one
piece's attention instead of every row's; a refused prompt says why.
"""

from __future__ import annotations

import dataclasses
import inspect
import random
from types import SimpleNamespace

import pytest
import torch

from uniprefill_sglang.parking import rejoin_bound
from uniprefill_sglang.parking import ParkingLot, RejoinCost

GiB = 2**30
# Llama-3.1-8B: hidden 4096, 32 query heads and 8 KV heads of 128, bf16 K and V per slot.
LLAMA_8B = dict(hidden_size=4096, query_size=4096, kv_row_bytes=2 * 8 * 128 * 2,
                dtype=torch.bfloat16)
CONFIG = SimpleNamespace(block_size=64, sink_tokens=128, last_queries=128)


def _decision(keep=(), max_dropped_mass=None):
    keep = tuple(keep)
    return SimpleNamespace(ratio_at=lambda i: keep[min(i, len(keep) - 1)] if keep else 0.0,
                           max_dropped_mass=max_dropped_mass)


CHUNK = 8192  # SGLang's default chunked prefill on an 80 GB card: the rejoin's pieces


def _lot(free_bytes, max_parked_tokens=1 << 20, **model):
    cost = RejoinCost.for_model(**{**LLAMA_8B, **model}, device="cpu")
    lot = ParkingLot(max_parked_tokens, dataclasses.replace(cost, free_bytes=lambda: free_bytes))
    lot.enabled = True
    lot.piece_rows = CHUNK
    return lot


def test_a_128k_top_p_rejoin_is_counted_per_row_stream_and_one_piece():
    """Llama-3.1-8B shape: a parked row is 16 KiB (hidden state and residual), a rejoining row
    32 KiB (four hidden-size rows: the layer's input, the attention output, the residual, the
    MLP's output), one piece of 8,192 rows' attention 288 MiB. A whole context of 131,072 tokens
    under top-p, every row rejoining, is counted at 7.85 GiB with headroom: admitted with the
    8.7 GiB an H100 had free at SGLang's default memory fraction (issue 57), refused with the
    7.7 GiB of the H200 above. These are counts; the rejoin's peak is measured on a GPU."""
    cost = RejoinCost.for_model(**LLAMA_8B, device="cpu")
    assert (cost.parked_row_bytes, cost.rejoin_row_bytes) == (16 * 1024, 32 * 1024)
    assert cost.piece_row_bytes == (4096 + 3 * 4096) * 2 + 2 * 8 * 128 * 2
    tokens = 131_072
    need = cost.need(tokens, tokens, CHUNK)
    assert need == int((tokens * 48 * 1024 + CHUNK * 36 * 1024) * 1.25)
    assert 7.8 * GiB < need < 7.9 * GiB
    assert _lot(8.7 * GiB).reserve("top-p", tokens, 0, rejoin_bound(CONFIG, _decision(), tokens))
    refused = _lot(7.7 * GiB)
    assert not refused.reserve("top-p", tokens, 0, None)
    assert "GiB of device memory" in refused.refused["top-p"]
    assert "is free" in refused.refused["top-p"]
    # Keep 0.5 at the first drop (it fitted the H200 before the attention ran in pieces) and a
    # 32K prompt under top-p park in that memory.
    keep_half = rejoin_bound(CONFIG, _decision((0.5, 0.8)), 131_000)
    assert keep_half < 0.51 * 131_000
    assert _lot(7.7 * GiB).reserve("keep", 131_000, 0, keep_half)
    assert _lot(7.0 * GiB).reserve("32k", 32_768, 0, None)


def test_without_chunks_the_whole_rejoin_is_one_piece():
    cost = RejoinCost.for_model(**LLAMA_8B, device="cpu")
    assert cost.count(0, 10_000) == 10_000 * (cost.rejoin_row_bytes + cost.piece_row_bytes)
    assert cost.count(0, 10_000, 20_000) == cost.count(0, 10_000)
    assert cost.count(5, 10_000, 256) == (5 * cost.parked_row_bytes
                                          + 10_000 * cost.rejoin_row_bytes
                                          + 256 * cost.piece_row_bytes)


# Qwen3-Next-80B-A3B: hidden 2048, 16 gated query heads of 256 (2 KV heads); its Gated DeltaNet
# layers project to q/k/v/z (12,288), b/a (64), convolve 8,192 and project back to 2,048.
QWEN3_NEXT = dict(hidden_size=2048, query_size=16 * 256, kv_row_bytes=2 * 2 * 256 * 2,
                  dtype=torch.bfloat16)
QWEN3_NEXT_MIXER = 12_288 + 64 + 8_192 + 2_048


def test_a_linear_attention_rejoin_is_priced_at_its_pieced_peak():
    """On one H200 (Qwen3-Next shape, mixers in pieces of 8,192 rows) 65,792 rejoining rows of a
    131,000-token prompt at keep 0.5 took 3.98 GB above the step's start at their peak: the
    price must cover that and stay under the three times the projections that held before the
    mixer ran in pieces (which refused that prompt with 7.6 GiB free). Attention's count alone
    (20.5 KB a row, its sublayer in pieces) would not cover it."""
    tokens, rows, peak = 131_000, 65_792, 3_976_830_976
    as_mixer = RejoinCost.for_model(**QWEN3_NEXT, device="cpu", mixer_size=QWEN3_NEXT_MIXER)
    assert peak <= rows * as_mixer.rejoin_row_bytes < 1.1 * peak
    as_attention = RejoinCost.for_model(**QWEN3_NEXT, device="cpu")
    assert rows * as_attention.rejoin_row_bytes < peak
    keep_half = rejoin_bound(CONFIG, _decision((0.5, 0.8)), tokens)
    assert _lot(7.6 * GiB, **QWEN3_NEXT, mixer_size=QWEN3_NEXT_MIXER).reserve("keep", tokens, 0,
                                                                             keep_half)
    # Every row rejoining (top-p), headroom included, is refused with the 9.9 GiB free at the
    # default --mem-fraction-static (its chunks then run as stock SGLang's, and its final chunk
    # drops among its own tokens) and admitted with the 17.3 GiB free at 0.85.
    assert not _lot(9.9 * GiB, **QWEN3_NEXT, mixer_size=QWEN3_NEXT_MIXER).reserve(
        "top_p", tokens, 0)
    assert _lot(17.3 * GiB, **QWEN3_NEXT, mixer_size=QWEN3_NEXT_MIXER).reserve(
        "top_p", tokens, 0)


def test_every_row_may_rejoin_under_top_p_or_a_dropped_mass_bound():
    assert rejoin_bound(CONFIG, _decision(), 10_000) is None
    assert rejoin_bound(CONFIG, _decision((0.3,), max_dropped_mass=0.05), 10_000) is None
    # A keep ratio bounds the rejoin to its blocks, sinks and last queries.
    assert rejoin_bound(CONFIG, _decision((0.3, 0.9)), 10_000) == 3000 + 64 + 128 + 128


def test_need_counts_parked_and_rejoining_rows_on_fresh_shapes():
    rng = random.Random()
    for _ in range(20):
        hidden, query = rng.choice((64, 576, 2048, 5120)), rng.choice((64, 576, 4096))
        kv, dtype = rng.randrange(0, 4096), rng.choice((torch.float32, torch.bfloat16))
        mixer = rng.choice((0, 0, 256, 4 * hidden, 22_592))
        cost = RejoinCost.for_model(hidden, query, kv, dtype, device="cpu", mixer_size=mixer)
        act = torch.empty((), dtype=dtype).element_size()
        parked, rejoin = rng.randrange(0, 200_000), rng.randrange(0, 200_000)
        piece_rows = rng.choice((0, 256, 8192))
        # The costlier layer kind: attention's residual stream (or a drop layer's queries), or
        # (where there is one) the mixer layer; and one piece of attention.
        row = max(4 * hidden * act, (3 * hidden + query) * act,
                  (4 * hidden + mixer) * act if mixer else 0)
        piece = min(rejoin, piece_rows) if piece_rows else rejoin
        count = (parked * 2 * hidden * act + rejoin * row
                 + piece * ((hidden + 3 * query) * act + kv))
        assert cost.need(parked, rejoin, piece_rows) == int(count * (1 + RejoinCost.HEADROOM))
        assert cost.free_bytes() is None  # nothing bounds the CPU engine


def test_block_sparse_attention_adds_its_keys_and_estimate_to_the_piece():
    """A rejoin that attends block-sparse also holds, for one attention call, every key of the
    stage with its value, the keys pooled per block for every query head (float32) and the
    estimate per (query block, key block) pair; a dense rejoin is priced as before."""
    rng = random.Random()
    for _ in range(20):
        q_heads = rng.choice((4, 16, 32, 64))
        kv_heads = rng.choice([h for h in (1, 2, 8) if q_heads % h == 0])
        head_dim = rng.choice((64, 128))
        kv = 2 * kv_heads * head_dim * 2
        cost = RejoinCost.for_model(4096, q_heads * head_dim, kv, torch.bfloat16, device="cpu",
                                    q_heads=q_heads, kv_heads=kv_heads)
        rejoin, piece_rows = rng.randrange(1, 200_000), rng.choice((0, 8192))
        keys, block = rejoin + rng.randrange(0, 50_000), rng.choice((16, 64, 128))
        piece = min(rejoin, piece_rows) if piece_rows else rejoin
        key_blocks, query_blocks = -(-keys // block), -(-piece // block)
        extra = (keys * kv + key_blocks * 4 * q_heads * head_dim
                 + query_blocks * key_blocks * (12 * q_heads + 36 * kv_heads))
        dense = cost.count(0, rejoin, piece_rows)
        assert cost.count(0, rejoin, piece_rows, keys, block) == dense + extra
        assert cost.count(0, rejoin, piece_rows, keys, 0) == dense
    # Llama-3.1-8B shape, 131K: the block-sparse price of a rejoin is above the dense one by
    # about the gathered keys (512 MiB) and the estimate at one 8,192-row piece.
    cost = RejoinCost.for_model(**LLAMA_8B, device="cpu", q_heads=32, kv_heads=8)
    extra = cost.count(0, 65_664, CHUNK, 131_000, 64) - cost.count(0, 65_664, CHUNK)
    assert 0.6 * GiB < extra < 0.8 * GiB
    lot = _lot(0, q_heads=32, kv_heads=8)
    dense_need = lot.cost.need(131_000, 65_664, CHUNK)
    fits_dense = _lot(dense_need + 1, q_heads=32, kv_heads=8)
    assert fits_dense.reserve("dense", 131_000, 0, 65_664)
    refused = _lot(dense_need + 1, q_heads=32, kv_heads=8)
    assert not refused.reserve("sparse", 131_000, 0, 65_664, sparse_block_size=64)
    assert "GiB of device memory" in refused.refused["sparse"]


def test_the_token_budget_is_checked_first_and_the_memory_bound_is_per_request():
    lot = _lot(1 * GiB, max_parked_tokens=4096)
    assert not lot.reserve("long", 8192, 0)
    assert lot.refused["long"] == "prompt over --uniprefill-max-parked-tokens"
    # A cached prefix does not park: only the rest of the prompt counts.
    assert lot.reserve("cached", 40_000, 37_000)
    assert lot.is_parked("cached")
    # Decided once, at the first chunk: later chunks of a refused request stay refused.
    small = _lot(0)
    assert not small.reserve("r", 2048, 0, 512)
    assert not small.reserve("r", 2048, 0, 512)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="reads a GPU's free memory")
def test_free_memory_is_read_on_a_gpu():
    cost = RejoinCost.for_model(**LLAMA_8B, device="cuda")
    free = cost.free_bytes()
    assert 0 < free <= torch.cuda.mem_get_info()[1]


def test_the_token_budget_follows_the_context_length_unless_set():
    """Unset, `--uniprefill-max-parked-tokens` leaves the budget to the runtime, which takes the
    longest sequence the server's request table holds (runtime.py); a value given is kept, 0
    disables parking, a negative one is refused."""
    from uniprefill_sglang.config import UniPrefillConfigError, build_config
    from uniprefill_sglang.server_args import UniPrefillServerArgs

    knobs = dict(top_p=None, keep_ratio=None, block_size=None, sink_tokens=None,
                 last_queries=None, drop_layers=None, min_prompt_tokens=0)
    flags = inspect.signature(UniPrefillServerArgs).parameters
    assert flags["uniprefill_max_parked_tokens"].default is None
    assert build_config(**knobs).max_parked_tokens is None
    assert build_config(**knobs, max_parked_tokens=4096).max_parked_tokens == 4096
    assert build_config(**knobs, max_parked_tokens=0).max_parked_tokens == 0
    with pytest.raises(UniPrefillConfigError, match="max-parked-tokens must be >= 0"):
        build_config(**knobs, max_parked_tokens=-1)
