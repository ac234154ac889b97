"""Per-stage KV pools: the layers after a drop hold KV memory only for the tokens reaching them.

SGLang gives each token one KV slot index, valid in every layer. Under the staged layout the
layers of stage 0 (up to the first drop layer) keep that slot space (the *full pool*, whose
allocator SGLang's scheduler and radix cache manage), while each later stage's layers have a
smaller buffer of their own, addressed through a map from full slots to stage slots:

    stage_slot = maps[stage - 1][full_slot]     (0: no slot; slot 0 of every buffer is a dummy)

The life of a stage slot follows its full slot, as SGLang's SWA pool does with its full-to-SWA
index mapping:
* SGLang's allocator hands out full slots (a prefill chunk, a decode step, private prefix
  slots); each gets a slot in every stage at once (`assign`). A prefill may keep every token,
  so admission reserves the whole prompt in every pool (patches/kv_allocator.py).
* A drop gives the dropped tokens' slots in the later stages back (`release`), right where the
  drop happens; a chunk parked at the first drop keeps them, since it rejoins later.
* Freeing a full slot (a request ends, the radix cache evicts) frees its stage slots.

`StageLayout` is the static part: which layers form each stage, and each stage pool's size as
a fraction of the full pool (the expected keep profile, `--uniprefill-stage-kv-fraction`).
`wire_stage_pools` builds the pools for SGLang's KV pool and allocator at start-up.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Dict, List, Optional, Sequence

import torch

from uniprefill_sglang.errors import UniPrefillError
from uniprefill_sglang.kv_validity import LayerStages

logger = logging.getLogger(__name__)

# Headroom over the expected keep fraction: decode tokens take a slot in every stage, and a
# fixed keep ratio keeps whole blocks plus the sink and last-query tokens.
DEFAULT_HEADROOM = 0.02


def default_stage_fractions(num_drops: int, keep_ratio: Optional[Sequence[float]]) -> tuple:
    """The fraction of the full pool each stage 1..D holds: the cumulative fixed keep ratios
    plus headroom, or 1.0 everywhere when selection is by top-p (nothing to expect)."""
    if not keep_ratio:
        return (1.0,) * num_drops
    fractions, reach = [], 1.0
    for k in range(num_drops):
        reach *= keep_ratio[min(k, len(keep_ratio) - 1)]
        fractions.append(min(1.0, reach + DEFAULT_HEADROOM))
    return tuple(fractions)


class StageLayout:
    """Which layers form each stage and how large each stage's pool is relative to the full
    pool (stage 0 is the full pool itself)."""

    def __init__(self, drop_layers: Sequence[int], num_layers: int, fractions: Sequence[float],
                 min_slots: int = 0):
        self.stages = LayerStages(drop_layers, num_layers)
        num_drops = self.stages.num_drops
        if not fractions:
            raise ValueError("a staged KV layout needs at least one fraction")
        self.fractions = tuple(float(fractions[min(s, len(fractions) - 1)])
                               for s in range(num_drops))
        # A stage pool never holds fewer slots than one whole request needs (admission
        # reserves a prompt in every pool), unless the full pool itself is smaller.
        self.min_slots = int(min_slots)

    @property
    def num_stages(self) -> int:
        return self.stages.num_drops

    def stage_of_layer(self, layer_id: int) -> int:
        return self.stages.stage(layer_id)

    def layers_per_stage(self) -> List[int]:
        counts = [0] * (self.num_stages + 1)
        for layer in range(self.stages.num_layers):
            counts[self.stages.stage(layer)] += 1
        return counts

    def kv_fraction(self) -> float:
        """KV bytes per full-pool slot relative to the shared layout's."""
        per_stage = (1.0,) + self.fractions
        layers = self.layers_per_stage()
        return sum(f * n for f, n in zip(per_stage, layers)) / self.stages.num_layers

    def stage_sizes(self, full_size: int) -> List[int]:
        """Slots of the pools of stages 1..D for a full pool of `full_size` slots."""
        floor = min(full_size, self.min_slots)
        return [min(full_size, max(floor, math.ceil(full_size * f))) for f in self.fractions]


@dataclasses.dataclass
class StagedBuffers:
    """A KV pool built with the staged layout (patches/kv_pool.py), as its `uniprefill`
    attribute: the layout, the stage pools' sizes (stages 1..D), each layer's stage, and the
    full-to-stage slot maps its writes go through (set once `StagePools` is wired)."""
    layout: StageLayout
    sizes: List[int]
    stage_of_layer: List[int]
    maps: Optional[list] = None


class StagePools:
    """The stage slot maps and free lists of one KV pool (stages 1..D)."""

    def __init__(self, layout: StageLayout, full_size: int, sizes: Sequence[int],
                 bytes_per_slot: Sequence[int], device):
        self.layout = layout
        self.full_size = int(full_size)
        self.sizes = [int(s) for s in sizes]
        self.bytes_per_slot = [int(b) for b in bytes_per_slot]  # stages 0..D
        self.device = device
        # maps[s - 1][full slot] -> slot in stage s's buffers (0: none; also the dummy slot 0).
        self.maps = torch.zeros((len(self.sizes), self.full_size + 1), dtype=torch.int64,
                                device=device)
        self.free_lists: List[torch.Tensor] = []
        self.clear()

    @property
    def num_stages(self) -> int:
        return len(self.sizes)

    def clear(self) -> None:
        self.maps.zero_()
        self.free_lists = [torch.arange(1, size + 1, dtype=torch.int64, device=self.device)
                           for size in self.sizes]

    def available(self) -> int:
        """Tokens every stage can still take (a new token needs a slot in each)."""
        return min((f.numel() for f in self.free_lists), default=self.full_size)

    def free_counts(self) -> List[int]:
        return [int(f.numel()) for f in self.free_lists]

    def assign(self, full_slots: torch.Tensor) -> bool:
        """Give newly allocated full slots a slot in every stage. False (nothing taken) when
        some stage has too few free slots."""
        n = full_slots.numel()
        if n == 0:
            return True
        if self.available() < n:
            return False
        taken = [f[:n] for f in self.free_lists]
        self.free_lists = [f[n:] for f in self.free_lists]
        self.maps[:, full_slots.to(torch.int64)] = torch.stack(taken)
        return True

    def release(self, full_slots: torch.Tensor, first_stage: int = 1) -> None:
        """Return the slots that `full_slots` hold in stages >= first_stage (idempotent: a slot
        released before, or never given one, is skipped)."""
        if full_slots.numel() == 0 or first_stage > self.num_stages:
            return
        idx = full_slots.to(torch.int64)
        rows = self.maps[first_stage - 1:]
        held = rows[:, idx]
        rows[:, idx] = 0
        mask = held > 0
        counts = mask.sum(1).tolist()
        if not any(counts):
            return
        freed = torch.split(held[mask], counts)
        for k, ids in enumerate(freed):
            if ids.numel():
                s = first_stage - 1 + k
                self.free_lists[s] = torch.cat((self.free_lists[s], ids))

    def refill(self, full_slots: torch.Tensor) -> None:
        """Give back a slot in every stage to those of `full_slots` that lost one (a forward
        that dropped failed and runs again dense: every row writes every layer)."""
        idx = full_slots.to(torch.int64)
        for s in range(self.num_stages):
            missing = idx[self.maps[s, idx] == 0]
            n = missing.numel()
            if n == 0:
                continue
            if self.free_lists[s].numel() < n:  # the failed forward released at least this
                raise RuntimeError(f"UniPrefill: stage {s + 1} pool cannot refill {n} slots")
            self.maps[s, missing] = self.free_lists[s][:n]
            self.free_lists[s] = self.free_lists[s][n:]

    def stage_slots(self, full_slots: torch.Tensor, stage: int) -> torch.Tensor:
        """Where `full_slots` live in the buffers of `stage`'s layers."""
        if stage == 0:
            return full_slots
        return self.maps[stage - 1][full_slots.to(torch.int64)].to(full_slots.dtype)

    def held_slots(self) -> List[int]:
        return [size - f.numel() for size, f in zip(self.sizes, self.free_lists)]

    # ---- accounting for SGLang's scheduler ---------------------------------------------
    def evictable_bound(self, full_used: int, evictable: int) -> int:
        """Tokens every stage is sure to get back if the radix cache evicts `evictable` tokens:
        at most `full_used - held_s` of the full pool's used slots lack a stage-s slot, so
        evicting frees at least `evictable - (full_used - held_s)` slots in stage s."""
        return min((max(0, evictable - (full_used - held))
                    for held in self.held_slots()), default=evictable)

    def shortfall(self, full_available: int, full_used: int, evictable: int) -> int:
        """How much SGLang's view of the room (full pool free + evictable) overstates what every
        stage can take; admission subtracts it."""
        bound = min(free + max(0, evictable - (full_used - held))
                    for free, held in zip(self.free_counts(), self.held_slots()))
        return max(0, full_available + evictable - bound)

    # ---- invariants and reporting ------------------------------------------------------
    def check(self, full_free: Optional[torch.Tensor] = None) -> List[str]:
        """Problems with the pools (empty when sound): every stage slot is free or mapped from
        exactly one full slot, never both; a free full slot holds no stage slot."""
        problems = []
        for s, (size, free) in enumerate(zip(self.sizes, self.free_lists), start=1):
            mapped = self.maps[s - 1][self.maps[s - 1] > 0]
            uses = torch.bincount(torch.cat((mapped, free)).cpu(), minlength=size + 1)
            if int(uses[0]):
                problems.append(f"stage {s}: the dummy slot 0 is free or mapped")
            bad = torch.nonzero(uses[1:] != 1).flatten()
            if bad.numel():
                problems.append(f"stage {s}: {bad.numel()} slots are not exactly one of free or "
                                f"mapped (e.g. slot {int(bad[0]) + 1} counted "
                                f"{int(uses[int(bad[0]) + 1])} times)")
        if full_free is not None and full_free.numel():
            stale = int((self.maps[:, full_free.to(torch.int64)] > 0).sum())
            if stale:
                problems.append(f"{stale} stage slots are held by free full slots")
        return problems

    def report(self, full_free: int) -> List[Dict[str, int]]:
        """One entry per stage (0 = the full pool): its layers, slots, free slots and the K+V
        bytes one slot takes across the stage's layers."""
        layers = self.layout.layers_per_stage()
        sizes, free = [self.full_size] + self.sizes, [int(full_free)] + self.free_counts()
        return [dict(stage=s, layers=layers[s], size=sizes[s], free=free[s],
                     bytes_per_slot=self.bytes_per_slot[s]) for s in range(len(sizes))]


def wire_stage_pools(stages: LayerStages, pool, allocator, device):
    """The stage pools when the KV pool was built with the staged layout (patches/kv_pool.py),
    wired to the allocator (patches/kv_allocator.py) and the pool's writes; else None."""
    staged = getattr(pool, "uniprefill_stage_buffers", None)
    if staged is None:
        return None
    if allocator is None:
        raise UniPrefillError("UniPrefill: the staged KV layout needs the KV allocator")
    bytes_per_slot = [0] * (stages.num_drops + 1)
    for layer, size in enumerate(slot_bytes_per_layer(pool)):
        bytes_per_slot[stages.stage(layer)] += size
    pools = StagePools(staged.layout, pool.size, staged.sizes, bytes_per_slot, device)
    staged.maps = pools.maps
    allocator.uniprefill_stage_pools = pools
    total = sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                for k, v in zip(pool.k_buffer, pool.v_buffer))
    logger.info("UniPrefill staged KV layout: stage pools of %s slots (full pool %d), "
                "%.1f GiB of KV in all", pools.sizes, pool.size, total / 2**30)
    return pools


def slot_bytes_per_layer(pool) -> list:
    """K+V bytes of one slot, per layer of the pool (of its full-attention layers, for the pool
    of a model with linear-attention layers; an MLA pool keeps one latent buffer a layer)."""
    pool = getattr(pool, "full_kv_pool", pool)
    if not hasattr(pool, "k_buffer"):  # MLATokenToKVPool: its value is a view of its key
        return [kv.shape[1:].numel() * kv.element_size() for kv in pool.kv_buffer]
    return [k.shape[1:].numel() * k.element_size() + v.shape[1:].numel() * v.element_size()
            for k, v in zip(pool.k_buffer, pool.v_buffer)]

