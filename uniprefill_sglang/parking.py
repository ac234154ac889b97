"""Chunked prefill: rows of earlier chunks wait at the first drop layer for the final chunk.

SGLang prefills a long prompt in chunks, and only the final chunk holds the prompt's true last
queries, which are what UniPrefill scores with. So a non-final chunk runs up to the first drop
layer (whose attention and KV write see every token), parks its rows there (hidden state and
residual right after that layer's attention), and the final chunk scores every parked row
together with its own; the survivors of both go on through the rest of the model in one step.

A parked chunk's KV slots hold KV for stage 0 only until its final chunk writes the later
layers, so they must not be shared meanwhile: patches/radix_cache.py keeps them out of the
radix tree until the whole prompt is prefilled.

Parking is decided at a request's first chunk (`ParkingLot.reserve`): the rest of the prompt
must fit `--uniprefill-max-parked-tokens` (unset: the longest prompt the server holds) and, on
a GPU, the device memory free then (`RejoinCost`): the parked rows are held until the final
chunk, and the rows that rejoin there go through every later layer in one step, each sublayer
over them in pieces of at most the chunk size. A prompt refused parking runs its earlier chunks as
stock SGLang does and drops among its final chunk's tokens only, so no prompt that stock SGLang
serves runs out of memory in the rejoin.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, List, Optional

import torch

from uniprefill_sglang.request_plan import log_fallback_once


class ParkedRows:
    """One request's parked rows: positions [start_pos, start_pos + count), their hidden state
    and residual after the first drop layer's attention, and the queries of the latest chunk's
    last rows (the final chunk borrows them when it is shorter than the query window)."""

    def __init__(self, start_pos: int):
        self.start_pos = start_pos
        self.count = 0
        self._hidden, self._residual = [], []
        self.last_q: Optional[torch.Tensor] = None
        self.last_q_pos: Optional[torch.Tensor] = None

    def append(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        self._hidden.append(hidden)
        self._residual.append(residual)
        self.count += hidden.shape[0]

    def truncate(self, count: int) -> None:
        """Keep the first `count` rows (a failed forward appended the rest)."""
        if count < self.count:
            hidden, residual = self.states()
            self._hidden, self._residual = [hidden[:count]], [residual[:count]]
            self.count = count

    def set_last_queries(self, q: torch.Tensor, q_pos: torch.Tensor) -> None:
        self.last_q, self.last_q_pos = q, q_pos.to(torch.int64)

    def states(self):
        """(hidden, residual) of every parked row, in position order."""
        if len(self._hidden) > 1:
            self._hidden, self._residual = [torch.cat(self._hidden)], [torch.cat(self._residual)]
        return self._hidden[0], self._residual[0]


@dataclasses.dataclass
class ParkingStep:
    """What one forward does to parked rows, those parking now and those rejoining
    (`DropContext.parking`): the drop writes it, the layer hook hands the parking rows to the
    lot and splices the rejoining ones in, the runtime settles it when the forward ends or rolls
    it back when it failed."""
    # rid -> (ParkedRows, count) when the forward began (a failed forward is rolled back to it).
    before: Dict[str, tuple] = dataclasses.field(default_factory=dict)
    # Do parked rows rejoin in this forward (also where no request drops: a dense final chunk)?
    rejoins: bool = False
    parked_now: List[int] = dataclasses.field(default_factory=list)  # requests parking now
    to_park: List[tuple] = dataclasses.field(default_factory=list)  # (rid, rows tensor)
    sink: Optional[Callable] = None  # (rid, hidden_rows, residual_rows) -> None
    # Slots of each parking chunk's last row, which goes on past the first drop (for logits).
    ghost_slots: List[torch.Tensor] = dataclasses.field(default_factory=list)
    finished: List[str] = dataclasses.field(default_factory=list)  # rids whose rows rejoined
    # Device memory allocated when a rejoining forward began (the allocator's peak was reset to
    # it), to measure what the rejoin took above it; None off CUDA or without a rejoin.
    allocated_at_start: Optional[int] = None
    # Hidden states and residuals of the rows rejoining at the first drop (`JoiningRows`),
    # spliced in after the current rows by the next layer hook (context.Survivors.shrink and
    # apply_pending).
    extra_hidden: Optional[List[torch.Tensor]] = None
    extra_residual: Optional[List[torch.Tensor]] = None
    # Dense requests whose earlier rows rejoined whole: b -> rows ahead of its own (the logits
    # see its own rows only, as a dense step's would: patches/logits.py).
    rejoined_whole: Dict[int, int] = dataclasses.field(default_factory=dict)

    def hand_over(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> None:
        """Right after the first drop layer's attention: the rows parking now go to the lot
        (`sink`), out of that layer's hidden states and residual."""
        for rid, park_rows in self.to_park:
            self.sink(rid, hidden_states.index_select(0, park_rows),
                      residual.index_select(0, park_rows))
        self.to_park = []


def start_peak_measure(step: ParkingStep, device) -> None:
    """Begin measuring a rejoining forward's device-memory peak (allocator statistics only,
    no device sync)."""
    if torch.device(device).type == "cuda":
        step.allocated_at_start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)


def rejoin_record(ctx, cost: Optional["RejoinCost"], previous: Optional[dict],
                  piece_rows: int = 0, block_size: int = 0) -> dict:
    """What a rejoining forward (`ctx`, a DropContext) took: its number (counting from 1), rows
    through the first later layer, its attention sublayers run in pieces, what `cost` counts for
    those rows (headroom and the parked rows, allocated before the step, left out; block-sparse
    attention in blocks of `block_size` where a rejoining request asks for it) and, on a GPU
    (where its peak measure started), the bytes allocated above its start at the peak."""
    after_first_drop = ctx.report.kept[min(1, len(ctx.report.kept) - 1)]
    rejoined = [(b, d) for b, d in enumerate(ctx.plan.decisions) if d.rid in ctx.parking.finished]
    rows = sum(after_first_drop[b] for b, _ in rejoined)
    sparse_keys = max((d.prompt_len for _, d in rejoined if d.block_sparse), default=0)
    peak = None
    if ctx.parking.allocated_at_start is not None:
        peak = int(torch.cuda.max_memory_allocated(ctx.survivors.out_cache_loc.device)
                   - ctx.parking.allocated_at_start)
    return {"number": previous["number"] + 1 if previous else 1, "rows": int(rows),
            "pieced_attention_calls": ctx.pieces.attention_calls, "peak_bytes": peak,
            "priced_bytes": cost.count(0, rows, piece_rows, sparse_keys, block_size)
            if cost is not None else None}


@dataclasses.dataclass(frozen=True)
class RejoinCost:
    """The device memory a chunked prompt's parking and rejoin take, against what is free.

    Counted from the code, not measured (a GPU's peak is reported beside the count,
    `rejoin_record`):
    `parked_row_bytes`: one parked row (hidden state and residual), held from its chunk to the
    end of the step it rejoins in.
    `rejoin_row_bytes`: one rejoining row in a layer after the first drop, where every rejoining
    row is alive at once, in the costlier of the model's layer kinds. There every sublayer runs
    over the rows in pieces of at most `piece_rows` (the chunk size, model_integration.py), so
    what a row holds is the residual stream:
    * an attention layer: the layer's input, the attention sublayer's output (the MLP's input),
      the residual and the MLP's output; at a drop layer, until its drop has run, a query row
      (drop.py reads each request's last queries by row) in place of the MLP's output. The drop
      gathers hidden state and residual to the survivors in place (context.py), without a
      second copy of either;
    * a linear-attention or short-convolution layer (`mixer_size`: the outputs per token of its
      projections, its convolution's included): hidden state, residual and norm output, and its
      projections once.
    `piece_row_bytes`: one row of an attention sublayer's piece (its q/k/v projection, the
    attention's two partial outputs, the output projection); `count` adds one piece of at most
    `piece_rows` rows. Not counted: an MLP's or a mixer's piece (the MLP's intermediate width is
    not read here), which a chunked step of stock SGLang holds as well; `HEADROOM` is what
    covers it.
    `sparse_*`: where the request attends block-sparse (backends/block_sparse.py), what one of
    its attention calls holds beyond a piece: every key of the stage gathered with its value
    (`sparse_key_bytes` a key), the keys pooled per block for every query head in float32
    (`sparse_key_block_bytes` a key block) and the estimate's masses, sort and block lists per
    (query block, key block) pair (`sparse_pair_bytes`). Without these, on one H100 (2026-12-07,
    benchmarks/results/block_sparse/) the block-sparse rows' rejoins peaked 1.54 and 0.76 GB
    above their price where the dense ones stay within 0.54 GB of it, each with an allocator
    retry.
    `free_bytes()`: device memory available now, None where nothing bounds it (the CPU engine).

    Measured before the attention sublayers ran in pieces (each then took every rejoining row,
    and an attention row was counted with its projections, partial outputs and KV): on one H200
    (Llama-3.1-8B shape, 7.7 GiB free after start-up) a 131,000-token prompt with half its rows
    rejoining fitted and with every row rejoining ran out of memory. On one H200 (Qwen3-Next-80B-
    A3B shape with 128 experts) 66K rejoining rows ran out of memory in a Gated DeltaNet layer,
    before its recurrence, when the mixer took every row at once (7.6 GiB free); in pieces of
    8,192 rows (2026-12-04) 65,792 rejoining rows took 3.98 GB above the step's start at their
    peak, 60.4 KB a row, against 61.6 KB counted by the mixer's count, which this one keeps
    (that step's attention was not yet in pieces; the mixer's count covered it). With attention
    in pieces and the rows gathered from their sources without a concatenation (context.py), on
    one H200 (Llama-3.1-8B shape, 2026-12-06, benchmarks/results/defaults/
    defaults_fa3_adapter_*_h200.json) 131,000-token prompts rejoined 129,792 rows (the defaults),
    78,720 (top-p 0.6) and 65,664 (keep 0.5,0.8) at peaks of 5.10, 3.43 and 2.99 GB above the
    step's start against 4.56, 2.88 and 2.45 GB counted: the same 0.54 GB above the count in
    each whatever the rows (about one MLP piece of 8,192 rows, not counted), inside `HEADROOM`.
    Before the gather read its sources in place (a concatenation of every parked row), the last
    two peaked at 4.36 GB on an H100. A rejoin of a few hundred rows measures above its count
    (LFM2's GPU test: 592 rows, 6.6 KB a row against 4.1 counted), where memory never bounds it."""
    parked_row_bytes: int
    rejoin_row_bytes: int
    free_bytes: Callable[[], Optional[int]]
    piece_row_bytes: int = 0
    sparse_key_bytes: int = 0
    sparse_key_block_bytes: int = 0
    sparse_pair_bytes: int = 0
    # What a rejoin must leave free beyond its count, as a fraction of it: the count is of
    # allocations at the peak, not of the allocator's blocks around them, nor of an MLP's piece.
    HEADROOM = 0.25

    @classmethod
    def for_model(cls, hidden_size: int, query_size: int, kv_row_bytes: int, dtype, device,
                  mixer_size: int = 0, q_heads: int = 0, kv_heads: int = 0):
        """`kv_row_bytes`: the K and V of one token in one layer (a piece's k/v projection);
        `q_heads`, `kv_heads`: this rank's attention heads (0: no block-sparse term)."""
        act = torch.empty((), dtype=dtype).element_size()
        free = _cuda_free_bytes(device) if torch.device(device).type == "cuda" else _no_bound
        attention_row = max(4 * hidden_size, 3 * hidden_size + query_size) * act
        mixer_row = (4 * hidden_size + mixer_size) * act if mixer_size else 0
        return cls(parked_row_bytes=2 * hidden_size * act,
                   rejoin_row_bytes=max(attention_row, mixer_row), free_bytes=free,
                   piece_row_bytes=(hidden_size + 3 * query_size) * act + kv_row_bytes,
                   sparse_key_bytes=kv_row_bytes if q_heads else 0,
                   sparse_key_block_bytes=4 * query_size if q_heads else 0,
                   sparse_pair_bytes=12 * q_heads + 36 * kv_heads)

    def count(self, parked_rows: int, rejoin_rows: int, piece_rows: int = 0,
              sparse_keys: int = 0, block_size: int = 0) -> int:
        """Bytes counted for `parked_rows` parked and `rejoin_rows` rejoining in pieces of at
        most `piece_rows` (0: one piece), headroom left out; with `sparse_keys`, a block-sparse
        attention call over that many keys in blocks of `block_size` is added to the piece."""
        piece = min(rejoin_rows, piece_rows) if piece_rows else rejoin_rows
        total = (parked_rows * self.parked_row_bytes + rejoin_rows * self.rejoin_row_bytes
                 + piece * self.piece_row_bytes)
        if sparse_keys and block_size and piece:
            key_blocks = -(-sparse_keys // block_size)
            total += (sparse_keys * self.sparse_key_bytes
                      + key_blocks * self.sparse_key_block_bytes
                      + -(-piece // block_size) * key_blocks * self.sparse_pair_bytes)
        return total

    def need(self, parked_rows: int, rejoin_rows: int, piece_rows: int = 0,
             sparse_keys: int = 0, block_size: int = 0) -> int:
        """`count`, headroom included."""
        return int(self.count(parked_rows, rejoin_rows, piece_rows, sparse_keys, block_size)
                   * (1 + self.HEADROOM))


def _no_bound() -> Optional[int]:
    return None


def _cuda_free_bytes(device) -> Callable[[], int]:
    def free() -> int:
        """Free device memory plus what torch's allocator holds unused (no device sync)."""
        unused, _ = torch.cuda.mem_get_info(device)
        return unused + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)

    return free


class ParkingLot:
    """Parked rows by request id, and the requests whose prompt exceeds the parking budget."""

    def __init__(self, max_parked_tokens: int, cost: Optional[RejoinCost] = None):
        self.max_parked_tokens = max_parked_tokens
        self.cost = cost  # None: no memory bound (set by the model runner hook)
        # Rows a rejoining step's sublayers take at a time (the runtime's `piece_rows`; 0: all).
        self.piece_rows = 0
        self.enabled = False  # set once the model integration can stop rows at the first drop
        self.rows: Dict[str, ParkedRows] = {}
        self.refused: Dict[str, str] = {}  # rid -> why its chunks do not park

    def __len__(self) -> int:
        return len(self.rows)

    def get(self, rid: Optional[str]) -> Optional[ParkedRows]:
        return self.rows.get(rid)

    def is_parked(self, rid: Optional[str]) -> bool:
        return rid in self.rows

    def forget(self, rid: str) -> None:
        """Drop a request's parked state (its final chunk consumed it, or it was aborted)."""
        self.rows.pop(rid, None)
        self.refused.pop(rid, None)

    def append(self, rid: str, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        self.rows[rid].append(hidden, residual)

    def roll_back(self, before: Dict[str, tuple], rids) -> None:
        """Undo what a failed forward did to the parked rows of requests in `rids`: each has
        again the rows it had when the forward began (`before`: rid -> (ParkedRows, count)),
        even where that forward consumed them or dropped them as stale; one it started parking
        parks nothing."""
        for rid in rids:
            if rid in before:
                rows, count = before[rid]
                rows.truncate(count)
                self.rows[rid] = rows
                self.refused.pop(rid, None)
            else:
                self.forget(rid)

    def give_up(self, rid: Optional[str], why: str) -> Optional[ParkedRows]:
        """Stop parking a request's chunks (its later chunks run dense); returns what it had
        parked."""
        parked = self.rows.pop(rid, None)
        if parked is not None:
            self.refused[rid] = why
        return parked

    def rejoining_chunks(self, ctx) -> Dict[int, "ParkedRows"]:
        """At the first drop: per request of the forward that does not park now, the parked rows
        of its earlier chunks, which rejoin it here. Their parking ends with this forward."""
        out = {}
        for b, d in enumerate(ctx.plan.decisions):
            parked = None if d.park else self.rows.get(d.rid)
            if parked is None:
                continue
            ctx.parking.finished.append(d.rid)
            if parked.count:
                out[b] = parked
        return out

    def reserve(self, rid: str, prompt_len: int, prefix_len: int,
                rejoin_rows: Optional[int] = None, sparse_block_size: int = 0) -> bool:
        """May this non-final chunk park? The first chunk of a request decides for all of them:
        the rest of the prompt must fit `--uniprefill-max-parked-tokens` and the device memory
        free now, with at most `rejoin_rows` rows rejoining (None: all of them), attending
        block-sparse over the prompt's keys in blocks of `sparse_block_size` (0: densely)."""
        if rid in self.rows:
            return True
        if rid in self.refused or not self.enabled:
            return False
        rest = prompt_len - prefix_len
        if rest > self.max_parked_tokens:
            return self._refuse(rid, "prompt over --uniprefill-max-parked-tokens",
                                "prompt longer than --uniprefill-max-parked-tokens")
        free = self.cost.free_bytes() if self.cost is not None else None
        if free is not None:
            need = self.cost.need(rest, rest if rejoin_rows is None else min(rest, rejoin_rows),
                                  self.piece_rows, prompt_len if sparse_block_size else 0,
                                  sparse_block_size)
            if need > free:
                return self._refuse(rid, f"its rejoin needs {need / 2**30:.1f} GiB of device "
                                         f"memory, {free / 2**30:.1f} GiB is free",
                                    "the rejoin of its parked rows would not fit in memory")
        # SGLang's scheduler has one chunked request in flight; anything else parked is left
        # over from an abort that bypassed the hook.
        for stale in [r for r in self.rows if r != rid]:
            self.forget(stale)
        self.rows[rid] = ParkedRows(start_pos=prefix_len)
        return True

    def _refuse(self, rid: str, why: str, kind: str) -> bool:
        self.refused[rid] = why
        log_fallback_once(f"{kind}: earlier chunks run dense, the final chunk drops among its "
                          "own tokens")
        return False


def merge_parked(first: ParkedRows, then: Optional[ParkedRows]) -> ParkedRows:
    """Rows that rejoin together: `first` (e.g. a re-selected cached prefix), then `then` (the
    parked chunks right after it), with `then`'s last queries."""
    if then is None:
        return first
    if first.start_pos + first.count != then.start_pos:
        raise ValueError(f"parked rows [{first.start_pos}, +{first.count}) and "
                         f"[{then.start_pos}, +{then.count}) are not contiguous")
    merged = ParkedRows(first.start_pos)
    merged.append(*first.states())
    merged.append(*then.states())
    last = then if then.last_q is not None else first
    merged.last_q, merged.last_q_pos = last.last_q, last.last_q_pos
    return merged


@dataclasses.dataclass
class JoiningRows:
    """Parked rows rejoining their requests at the final chunk's first drop, numbered after the
    step's own rows (row `total + i`)."""
    positions: List[torch.Tensor] = dataclasses.field(default_factory=list)
    slots: List[torch.Tensor] = dataclasses.field(default_factory=list)
    hidden: List[torch.Tensor] = dataclasses.field(default_factory=list)
    residual: List[torch.Tensor] = dataclasses.field(default_factory=list)
    request: List[torch.Tensor] = dataclasses.field(default_factory=list)
    count: int = 0

    def add(self, b: int, parked: ParkedRows, req_slots: torch.Tensor, total: int) -> torch.Tensor:
        """Let request b's parked rows rejoin (`req_slots`: its req_to_token row); returns the
        row numbers they get."""
        device = req_slots.device
        hidden, residual = parked.states()
        span = slice(parked.start_pos, parked.start_pos + parked.count)
        self.positions.append(torch.arange(span.start, span.stop, device=device))
        self.slots.append(req_slots[span].to(torch.int64))
        self.hidden.append(hidden)
        self.residual.append(residual)
        self.request.append(torch.full((parked.count,), b, dtype=torch.int64, device=device))
        rows = total + self.count + torch.arange(parked.count, device=device)
        self.count += parked.count
        return rows


# ---- The first drop's parking and rejoin steps (drop.py runs them) ----------------------------
def parks_here(rt, ctx, b: int, n: int) -> bool:
    """At the first drop: does request b, a non-final chunk with `n` rows here, park (its rest
    of the prompt fits, `ParkingLot.reserve`)? A refused one says why and runs dense."""
    d, fixed_len = ctx.plan.decisions[b], ctx.survivors.fixed_lens[b]
    if n > 0 and rt.parking.reserve(d.rid, d.prompt_len, fixed_len,
                                    rejoin_bound(rt.config, d, d.prompt_len - fixed_len),
                                    rt.config.block_sparse_block_size if d.block_sparse else 0):
        return True
    if d.rid in rt.parking.refused:
        ctx.note(b, f"non-final chunk, not parked ({rt.parking.refused[d.rid]}): runs dense")
    return False


def park_chunk(rt, ctx, b, rows, q, keep, stage) -> None:
    """At the first drop (drop.py): all rows of request b, a non-final chunk, stop here and wait
    for the final chunk; the last one goes on alone so the forward still yields the logits
    SGLang expects (discarded). `keep` is the drop's row mask, `stage` its layer's."""
    rid, survivors = ctx.plan.decisions[b].rid, ctx.survivors
    last = rows[-rt.config.last_queries:]
    ctx.parking.to_park.append((rid, rows))
    ctx.parking.parked_now.append(b)
    keep.index_fill_(0, rows[:-1], False)
    rt.slots.mark_dropped(survivors.out_cache_loc[rows[:-1]], stage, release=False)
    ctx.parking.ghost_slots.append(survivors.out_cache_loc[rows[-1:]])
    rt.parking.get(rid).set_last_queries(q[last], survivors.positions[last])
    ctx.kv.sparse[b] = True
    survivors.lens[b] = 1


def rejoining_rows(rt, ctx, layer, q) -> Dict[int, ParkedRows]:
    """At the first drop: per request, the rows that rejoin it here, from both providers: a
    cached prefix it selects over anew (prefix_reuse.py) and, for a chunk that does not park,
    the parked rows of its earlier chunks (`ParkingLot.rejoining_chunks`), in position order."""
    prefixes = rt.prefix_reuse.rejoining_prefixes(ctx, layer, q)
    chunks = rt.parking.rejoining_chunks(ctx)
    out = {}
    for b in sorted(set(prefixes) | set(chunks)):
        out[b] = merge_parked(prefixes[b], chunks.get(b)) if b in prefixes else chunks[b]
    return out


def rejoin_bound(config, d, tokens: int) -> Optional[int]:
    """At most how many of `tokens` parked rows rejoin at the final chunk's first drop: a fixed
    keep ratio's whole blocks, sinks and last queries; None (all of them) under top-p, or where
    a dropped-mass bound may keep every row."""
    ratio = d.ratio_at(0)
    if not ratio or d.max_dropped_mass is not None:
        return None
    return math.ceil(ratio * tokens) + config.block_size + config.sink_tokens + config.last_queries
