"""Tensor parallelism: every rank must drop exactly the same tokens.

Each TP rank holds a slice of the attention heads, so it scores the tokens with its own heads
only. The full score is the sum over ranks. If the ranks then selected from sums that differ in
the last bit (an all-reduce need not give bitwise-equal results on every rank: a one-shot custom
all-reduce adds the peers' buffers in each rank's own order), a near-tie could keep a block on one
rank and drop it on another, and the hidden states of the ranks would diverge for good (the
reference vLLM fork's intermittent "!!!!" with TP > 1).

So the sum is formed once, on the group's first rank (`reduce`), and sent back to every rank
(`broadcast`): the ranks select from bit-identical scores, and the selection kernels are
deterministic on identical inputs (no atomics; see kernels/), so they keep identical tokens. Two
collectives move what one all-reduce would. With `UNIPREFILL_CHECK_TP=1` every drop also
all-gathers a checksum of each rank's kept rows and raises on any mismatch (a debug mode: it adds
a host sync per drop).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from uniprefill_sglang.errors import CheckFailed


class TPAgreementError(CheckFailed):
    """Ranks of one TP group selected different tokens."""


class TPScoreAgreement:
    """Sums per-rank scores over a process group so that every rank holds the same bits.

    group: the torch.distributed group whose ranks hold the head slices (for SGLang, the
    attention TP group's `device_group`); ranks: its global ranks, in group order.
    """

    def __init__(self, group, ranks: Sequence[int]):
        self.group = group
        self.ranks = list(ranks)
        self.root = self.ranks[0]

    @classmethod
    def from_group_coordinator(cls, coordinator) -> "TPScoreAgreement":
        """From SGLang's `GroupCoordinator` (get_attn_tp_group(), get_tp_group())."""
        return cls(coordinator.device_group, coordinator.ranks)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def reduce_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """In place: every rank ends with the group's sum as computed on the first rank."""
        if self.world_size == 1:
            return scores
        dist.reduce(scores, dst=self.root, op=dist.ReduceOp.SUM, group=self.group)
        dist.broadcast(scores, src=self.root, group=self.group)
        return scores

    def verify(self, keep_idx: torch.Tensor, new_counts: torch.Tensor) -> None:
        """Raise TPAgreementError unless every rank kept the same rows (debug mode)."""
        if self.world_size == 1:
            return
        digest = selection_digest(keep_idx, new_counts)
        gathered = [torch.empty_like(digest) for _ in self.ranks]
        dist.all_gather(gathered, digest, group=self.group)
        if any(not torch.equal(g, gathered[0]) for g in gathered[1:]):
            raise TPAgreementError(
                "UniPrefill: TP ranks selected different tokens; digests per rank "
                f"{[g.tolist() for g in gathered]}")


def selection_digest(keep_idx: torch.Tensor, new_counts: torch.Tensor) -> torch.Tensor:
    """A cheap fingerprint of a selection: counts, index sum, and a position-weighted sum.

    int64 [3]; equal selections give equal digests, and any added, removed or moved row changes
    at least one entry unless the changes cancel in both sums at once.
    """
    idx = keep_idx.to(torch.int64)
    weights = torch.arange(1, idx.numel() + 1, device=idx.device, dtype=torch.int64)
    return torch.stack([
        new_counts.to(torch.int64).sum(),
        idx.sum(),
        (idx * weights).sum(),
    ])
