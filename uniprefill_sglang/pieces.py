"""A sublayer run over the survivors in pieces: which rows run now.

From the first drop layer on, while the batch is compacted, the MLP, a linear-attention mixer and
an attention sublayer run over at most the chunk size of rows at a time (model_integration.py
wraps them): the rows of earlier chunks that rejoin at the final chunk's first drop must not
make a step's activations there larger than a chunk's. A mixer or attention sublayer run in
pieces names each piece's rows on the forward's `RowPieces` (`DropContext.pieces`) while it
runs, so that the layer's backend adapter runs those rows (backends/common.py `row_piece`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional, Tuple

import torch


@dataclasses.dataclass
class RowPieces:
    """One forward's sublayers run in pieces."""
    # Rows [start, end) of the current survivors that a sublayer run in pieces is running now;
    # None: the whole batch.
    span: Optional[Tuple[int, int]] = None
    # Attention sublayers that ran in pieces in this forward (a rejoin reports it).
    attention_calls: int = 0
    # Layer id -> a drop layer's queries of every survivor, gathered while it runs in pieces.
    queries: Dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

    def gather_queries(self, layer_id: int, q_rows: torch.Tensor,
                       total: int) -> Optional[torch.Tensor]:
        """A drop layer run in pieces: its queries of every one of the `total` survivors,
        gathered piece by piece and returned complete at the last piece (None before). The drop
        reads each request's last queries by row (drop.py), so the layer holds a query row per
        survivor until it has run."""
        start, end = self.span
        queries = self.queries.get(layer_id)
        if queries is None:
            queries = self.queries[layer_id] = q_rows.new_empty((total, q_rows.shape[1]))
        queries[start:end] = q_rows
        if end < total:
            return None
        del self.queries[layer_id]
        return queries


def in_pieces(run: Callable, n: int, piece_rows: int, pieces: Optional[RowPieces] = None):
    """run(start, end) over consecutive pieces of at most `piece_rows` of `n` rows, written into
    one output; with `pieces`, each piece's rows are named on `pieces.span` while it runs."""
    out = None
    try:
        for start in range(0, n, piece_rows):
            end = min(n, start + piece_rows)
            if pieces is not None:
                pieces.span = (start, end)
            piece = run(start, end)
            if out is None:
                out = piece.new_empty((n,) + tuple(piece.shape[1:]))
            out[start:end] = piece
    finally:
        if pieces is not None:
            pieces.span = None
    return out
