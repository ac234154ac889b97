"""The per-forward drop context: what the layers after a drop need to know.

One `DropContext` lives for one `ModelRunner` forward; the layer hooks and attention adapters
reach it through the batch they are given (`drop_context`). Beside the forward's inputs (`plan`,
`forward_batch`, `is_extend`) it holds one part per concern, each defined by the module that
writes it:

* `survivors` (`Survivors`, here): the rows an extend carries on. They start as every token of
  the batch and shrink at each drop layer: `positions` and `out_cache_loc` hold the surviving
  rows in batch order, `lens` the surviving rows per request, and `pending_rows` the rows that
  the hidden states and residual still have to be gathered to (applied by the layer hooks right
  after the drop layer's attention, `apply_pending`);
* `kv` (kv_validity.ForwardKV): the KV each request holds per stage, which the attention
  adapters read (`sparse`, `prefix_valid`, decode's `gaps`), and their per-forward `views`;
* `parking` (parking.ParkingStep): what the forward does to chunked prefill's parked rows, the
  rows rejoining at the first drop included;
* `prefixes` (prefix_reuse.MovedPrefixes): cached prefixes moved to private slots, which a
  failed forward points back;
* `pieces` (pieces.RowPieces): the rows a sublayer run in pieces runs now;
* `report` (`DropReport`, here): what the forward reports per request, read by
  patches/logits.py into meta_info.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional

import torch

from uniprefill_sglang.device import to_device
from uniprefill_sglang.kv_validity import ForwardKV, compact
from uniprefill_sglang.parking import ParkingStep
from uniprefill_sglang.pieces import RowPieces
from uniprefill_sglang.prefix_reuse import MovedPrefixes
from uniprefill_sglang.request_plan import BatchPlan


@dataclasses.dataclass
class Survivors:
    """The rows of an extend that go on through the layers: every token of the batch until the
    first drop, then each drop's survivors (unset in a decode forward)."""
    # The surviving rows in batch order (their positions and KV slots), and how many per request.
    positions: Optional[torch.Tensor] = None
    out_cache_loc: Optional[torch.Tensor] = None
    lens: Optional[List[int]] = None
    # Per request: tokens before its first current row (a cached prefix), never dropped here.
    fixed_lens: Optional[List[int]] = None
    # Rows the hidden states must be gathered to, and the row count they have before it.
    pending_rows: Optional[torch.Tensor] = None
    rows_before_pending: int = 0
    compacted: bool = False
    # Layer input name -> (the positions it was computed for, the input): the survivors' position
    # inputs (RoPE cos/sin), computed once per drop and shared by the layers after it
    # (model_integration.py).
    position_inputs: Dict[str, tuple] = dataclasses.field(default_factory=dict)

    def own_rows(self, rejoined_whole: Dict[int, int]) -> Optional[torch.Tensor]:
        """Rows of the current hidden states that are this step's own tokens for requests whose
        earlier rows rejoined whole (`rejoined_whole`: b -> rows ahead of its own), and every
        current row of the others; None when no request rejoined whole."""
        if not rejoined_whole:
            return None
        pieces, start = [], 0
        for b, n in enumerate(self.lens):
            skip = rejoined_whole.get(b, 0)
            pieces.append(torch.arange(start + skip, start + n, device=self.positions.device))
            start += n
        return torch.cat(pieces)

    def own_lens(self, rejoined_whole: Dict[int, int]) -> List[int]:
        return [n - rejoined_whole.get(b, 0) for b, n in enumerate(self.lens)]

    def segment_starts(self) -> List[int]:
        starts, acc = [], 0
        for n in self.lens:
            starts.append(acc)
            acc += n
        return starts

    def shrink(self, keep: torch.Tensor, joining, rows_per_request: List[int],
               parking: ParkingStep, park_sink: Callable) -> None:
        """Keep the rows where `keep` is set: the step's own rows, then any parked rows
        rejoining (`parking.JoiningRows`), which go ahead of their request's new rows. The
        hidden states follow at the next layer hook (`apply_pending`), which hands the rows
        parking now to `park_sink` and splices in the rejoining ones (`parking`)."""
        total = sum(rows_per_request)
        kept = sum(self.lens)  # the drop has set each request's rows: no device read
        if kept == total and not joining.count and not parking.to_park:
            return
        n = keep.shape[0]
        rows = compact(torch.arange(n, device=keep.device),
                       to_device([0, n], torch.int64, keep.device), keep)[2][:kept]
        positions = torch.cat([self.positions.to(torch.int64)] + joining.positions)
        slots = torch.cat([self.out_cache_loc.to(torch.int64)] + joining.slots)
        if joining.count:  # order by (request, position)
            request = torch.cat([torch.repeat_interleave(
                torch.arange(len(self.lens), device=keep.device),
                to_device(rows_per_request, torch.int64, keep.device))] + joining.request)
            key = request[rows] * (int(positions.max()) + 1) + positions[rows]
            rows = rows[torch.argsort(key, stable=True)]
            parking.extra_hidden, parking.extra_residual = joining.hidden, joining.residual
        self.positions = positions.index_select(0, rows).to(self.positions.dtype)
        self.out_cache_loc = slots.index_select(0, rows).to(self.out_cache_loc.dtype)
        if self.pending_rows is not None:  # a previous drop's gather was never applied
            rows = self.pending_rows.index_select(0, rows)
        else:
            self.rows_before_pending = total
        parking.sink = park_sink
        self.pending_rows = rows
        self.compacted = True

    def apply_pending(self, hidden_states, residual, parking: ParkingStep):
        """Gather hidden states and residual to the surviving rows, if not done yet.

        Right after a drop layer's attention (the post-attention norm hook) this also parks the
        rows of non-final chunks and splices in the rows parked by earlier chunks (`parking`).
        """
        rows = self.pending_rows
        if rows is None or hidden_states.shape[0] != self.rows_before_pending:
            return hidden_states, residual
        parking.hand_over(hidden_states, residual)
        if parking.extra_hidden is not None:
            hidden_sources = [hidden_states] + parking.extra_hidden
            residual_sources = [residual] + parking.extra_residual
            parking.extra_hidden = parking.extra_residual = None
            return (gather_from_sources(hidden_sources, rows),
                    gather_from_sources(residual_sources, rows))
        # No row spliced in: the rows ascend (each drop keeps rows in order).
        return gather_in_place(hidden_states, rows), gather_in_place(residual, rows)

    def finish_pending(self) -> None:
        self.pending_rows = None

    def position_digest(self) -> List[int]:
        """Per request, a fingerprint of the positions that survive the current drop (debug:
        compares runs token for token, one host read)."""
        pos = self.positions.to(torch.int64)
        seg = torch.repeat_interleave(torch.arange(len(self.lens), device=pos.device),
                                      torch.tensor(self.lens, device=pos.device))
        digest = torch.zeros(len(self.lens), dtype=torch.int64, device=pos.device)
        digest.index_add_(0, seg, pos * pos % 1000003 + pos)
        return digest.tolist()


@dataclasses.dataclass
class DropContext:
    """One forward's drop context: its inputs and one part per concern (the module docstring)."""
    plan: Optional[BatchPlan]
    forward_batch: object
    is_extend: bool
    survivors: Survivors = dataclasses.field(default_factory=Survivors)
    kv: ForwardKV = dataclasses.field(default_factory=ForwardKV)
    parking: ParkingStep = dataclasses.field(default_factory=ParkingStep)
    prefixes: MovedPrefixes = dataclasses.field(default_factory=MovedPrefixes)
    pieces: RowPieces = dataclasses.field(default_factory=RowPieces)
    report: "DropReport" = dataclasses.field(default_factory=lambda: DropReport())

    @property
    def acts(self) -> bool:
        """Do the drop layers have work in this forward: drop, park, let parked rows rejoin, or
        give a dense request the tokens its cached prefix lacks (a prefix holding every token
        has nothing to restore, so such a step runs as stock SGLang)?"""
        if not self.is_extend or self.plan is None:
            return False
        sparse = self.kv.sparse or ()
        return self.parking.rejoins or any(
            d.enabled or d.park or (d.restore_prefix and b < len(sparse) and sparse[b])
            for b, d in enumerate(self.plan.decisions))

    def note(self, b: int, reason: str) -> None:
        """Why request b ran dense or dropped less than its decision said."""
        notes = self.report.notes
        decided = self.plan.decisions[b].reason if self.plan is not None else None
        earlier = notes.get(b, decided)
        notes[b] = reason if earlier is None else f"{earlier}; {reason}"


@dataclasses.dataclass
class DropReport:
    """What a forward reports per request in `meta_info["uniprefill"]` (patches/logits.py)."""
    # kept[k][b]: rows of request b entering stage k (kept[0] = the tokens scored at the first
    # drop: the step's new tokens plus any rejoining).
    kept: List[List[int]] = dataclasses.field(default_factory=list)
    # dropped_mass[k][b]: the share of the attention mass drop k's selection scored for request
    # b that fell on the candidates it dropped (0.0 where it dropped none or did not select),
    # read to the host in one copy with the drop's kept counts.
    dropped_mass: List[List[float]] = dataclasses.field(default_factory=list)
    # Per request whose first drop would have let go more than its max dropped mass: that
    # mass; it keeps every row at every drop (drop.py).
    over_bound: Dict[int, float] = dataclasses.field(default_factory=dict)
    # kept_digest[k][b]: fingerprint of request b's positions after drop k (debug).
    kept_digest: List[List[int]] = dataclasses.field(default_factory=list)
    # Per request: why it ran dense or dropped less than its decision said (DropContext.note).
    notes: Dict[int, str] = dataclasses.field(default_factory=dict)
    # Per request with a cached prefix: what it did with it (prefix_reuse.PrefixOutcome).
    prefix_outcomes: Dict[int, object] = dataclasses.field(default_factory=dict)
    # Did SGLang's prefill CUDA graph run the step (None: no graph runner was asked)?
    prefill_graph: Optional[bool] = None
    # Block-sparse attention's plan and tally (backends/block_sparse.py; None: off).
    block_sparse: Optional[object] = None

    def entry(self, b: int, decision) -> dict:
        entry = {"enabled": decision.enabled, "reason": self.notes.get(b, decision.reason),
                 "kept_tokens": [stage_lens[b] for stage_lens in self.kept],
                 "dropped_mass": [float(f"{drop[b]:.6g}") for drop in self.dropped_mass]}
        if self.block_sparse is not None:
            entry.update(self.block_sparse.entry(b, decision))
        if b in self.prefix_outcomes:  # a cached prefix: reused or re-selected, and why
            entry["prefix"] = self.prefix_outcomes[b].as_dict()
        if self.prefill_graph is not None:
            entry["prefill_cuda_graph"] = self.prefill_graph
        if self.kept_digest:  # UNIPREFILL_REPORT_KEPT=1
            entry["kept_digest"] = [stage[b] for stage in self.kept_digest]
        return entry


# Rows a gather in place copies at a time (its temporary).
GATHER_STEP_ROWS = 4096


def gather_from_sources(sources: List[torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    """`torch.cat(sources).index_select(0, rows)` without the concatenation.

    At a rejoin the sources are the step's own rows and each request's parked rows (together
    the whole prompt); concatenating them first would hold a copy of every parked row beside
    the survivors (measured: 4.36 GB above the step's start at 131K tokens, H100). Here the
    step holds the output and one source's selected rows at a time. One host read per source
    (which output rows it fills): this runs once per rejoining forward."""
    out = sources[0].new_empty((rows.shape[0],) + tuple(sources[0].shape[1:]))
    start = 0
    for source in sources:
        end = start + source.shape[0]
        mine = ((rows >= start) & (rows < end)).nonzero().squeeze(1)
        if mine.numel():
            out.index_copy_(0, mine, source.index_select(0, rows.index_select(0, mine) - start))
        start = end
    return out


def gather_in_place(x: torch.Tensor, rows: torch.Tensor,
                    step: int = GATHER_STEP_ROWS) -> torch.Tensor:
    """x[rows] for strictly ascending `rows`, written over x's first rows and returned as a view
    of them: the gather to a drop's survivors without a second copy of every row (a rejoin's
    rows are held once, beside a temporary of `step` rows). In place is safe: the rows a step
    reads are at or past the first row it writes, and past every row written before it. A
    tensor that is not contiguous is gathered to a new one."""
    if not x.is_contiguous():
        return x.index_select(0, rows)
    k = rows.shape[0]
    for start in range(0, k, step):
        end = min(k, start + step)
        x[start:end] = x.index_select(0, rows[start:end])
    return x[:k]


def drop_context(forward_batch) -> Optional[DropContext]:
    """The drop context of the forward that runs `forward_batch`, from its side-car
    (`forward_batch.uniprefill_inputs`); None between forwards or without UniPrefill. The copies
    of the batch the model runner's runners run the model on carry the side-car too
    (patches/cuda_graphs.py)."""
    inputs = getattr(forward_batch, "uniprefill_inputs", None)
    return inputs.drop_context if inputs is not None else None
