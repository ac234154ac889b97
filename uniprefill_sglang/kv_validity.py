"""Which KV slots hold valid KV for which layers.

Layers are grouped into stages by the drop schedule: stage 0 is layers 0..d0 (the first drop
layer's own attention still sees every token), stage k is layers d(k-1)+1..dk, and the last stage
runs to the top of the model. A token dropped at drop layer dk has KV in stages 0..k only.

One int8 per KV slot, kept beside the KV pool, records that: `slot_stage[slot] = k` means "valid
for layers of stage <= k"; `FULL` (= number of drops) means valid everywhere. Every forward resets
the slots it writes to FULL before the model runs, so a freed and reused slot never carries stale
validity; slots held by the radix cache keep theirs, so a cached prefix is reused with exactly the
KV its layers hold.

`KVGaps` mirrors, on the host, how many slots each request lacks per stage, so decode steps can
size per-stage views (FlashInfer plans on the host) without reading the device. A forward's
requests carry what they hold per stage on its drop context (`ForwardKV`, `DropContext.kv`),
which the attention-backend adapters read. The functions at the bottom build per-stage views on
the device, shared by those adapters.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from uniprefill_sglang.device import to_device
from uniprefill_sglang.errors import CheckFailed


class LayerStages:
    """The static layer -> stage table of a drop schedule."""

    def __init__(self, drop_layers: Sequence[int], num_layers: int):
        self.drop_layers = tuple(drop_layers)
        self.num_layers = num_layers
        self.num_drops = len(self.drop_layers)
        # stage(l) = number of drop layers strictly before l.
        self.stage_of_layer = [
            bisect.bisect_left(self.drop_layers, l) for l in range(num_layers)
        ]
        self.drop_index = {l: k for k, l in enumerate(self.drop_layers)}

    def stage(self, layer_id: int) -> int:
        return self.stage_of_layer[layer_id]


class SlotStages:
    """Per-slot survival stage beside the token-to-KV pool, and where each stage keeps a slot's
    KV: under the staged layout (stage_pools.py, `pools`) the layers after a drop address their
    own smaller pools, so every view hands the attention kernels stage slots; under the shared
    layout (`pools` None) a slot is the same index in every layer."""

    def __init__(self, num_slots: int, num_drops: int, device, pools=None):
        if num_drops > 126:
            raise ValueError("at most 126 drop layers fit the int8 stage map")
        self.full = num_drops
        self.num_slots = num_slots
        self.slot_stage = torch.full((num_slots,), num_drops, dtype=torch.int8, device=device)
        self.stages_after_first = torch.arange(1, num_drops + 1, dtype=torch.int8, device=device)
        self.pools = pools

    @property
    def staged(self) -> bool:
        return self.pools is not None

    def pool_slots(self, slots: torch.Tensor, stage: int) -> torch.Tensor:
        """Where the layers of `stage` keep the KV of `slots`."""
        if self.pools is None or stage == 0:
            return slots
        return self.pools.stage_slots(slots, stage)

    def pool_slots_after_first(self, slots: torch.Tensor) -> torch.Tensor:
        """[D, n]: row k is where stage k + 1 keeps the KV of `slots`."""
        if self.pools is None:
            return slots.unsqueeze(0).expand(self.full, slots.shape[0])
        return self.pools.maps[:, slots.to(torch.int64)].to(slots.dtype)

    def mark_written(self, slots: torch.Tensor) -> None:
        """Slots a forward is about to write hold full KV until a drop says otherwise."""
        # index_fill_ takes the value as a scalar argument: `t[idx] = value` would copy a CPU
        # scalar tensor to the GPU, which synchronises (a stall in every decode step).
        if slots is not None and slots.numel():
            self.slot_stage.index_fill_(0, slots.to(torch.int64), self.full)

    def mark_dropped(self, slots: torch.Tensor, stage: int, release: bool = True) -> None:
        """Slots whose KV the layers after `stage` will not hold. `release`: their slots in
        those stages' pools go back now; a chunk parked at the first drop keeps them for its
        rejoining."""
        if slots.numel():
            self.slot_stage.index_fill_(0, slots.to(torch.int64), stage)
            if release and self.pools is not None:
                self.pools.release(slots, stage + 1)

    def mark_dropped_where(self, slots: torch.Tensor, dropped: torch.Tensor, stage: int) -> None:
        """`mark_dropped(slots[dropped], stage)`, without a host sync where no stage pool takes
        slots back (`slots` distinct)."""
        if self.pools is not None:
            self.mark_dropped(slots[dropped], stage)
        elif slots.numel():
            slots = slots.to(torch.int64)
            current = self.slot_stage.index_select(0, slots)
            self.slot_stage.index_copy_(0, slots, torch.where(dropped, stage, current))

    def valid_mask(self, slots: torch.Tensor, stage: int) -> torch.Tensor:
        return self.slot_stage[slots] >= stage

    def valid_counts(self, slots: torch.Tensor, row: torch.Tensor, bs: int) -> torch.Tensor:
        """[bs, full + 1]: per segment (`row` = segment of each slot), the slots valid at each
        stage."""
        st = self.slot_stage[slots.to(torch.int64)].to(torch.int64)
        hist = torch.zeros(bs * (self.full + 1), dtype=torch.int64, device=slots.device)
        if slots.numel():
            hist.index_add_(0, row * (self.full + 1) + st, torch.ones_like(st))
        # Valid at stage s = slots whose stage is >= s: a reversed cumulative sum.
        return hist.view(bs, self.full + 1).flip(1).cumsum(1).flip(1)

    def valid_slots(self, req_slots: torch.Tensor, stage: int, count: Optional[int] = None):
        """(slots, positions) of a request's KV that layers of `stage` hold, in position order.
        `count`: how many there are, when the host knows it; without it, one device sync."""
        valid = self.valid_mask(req_slots, stage)
        if count is None:
            positions = torch.nonzero(valid, as_tuple=True)[0]
        else:
            n = valid.shape[0]
            positions = compact(torch.arange(n, device=valid.device), _on([0, n], valid.device),
                                valid)[2][:count]
        return req_slots[positions], positions


class KVGaps:
    """Host mirror of the KV each request lacks: per req-pool row, per stage 1..D, the number of
    the request's slots that stage holds no KV for.

    Set when an extend of the row ends (from the host-known kept counts, runtime.py); decode
    tokens have KV in every layer, so a row's gaps hold until its next extend, and a stage's KV
    length in decode is `seq_len - gap`. A row is stale when the host cannot know its gaps (the
    radix cache pointed it at another request's slots, or an inconsistency was caught); the next
    decode reads them back from the device.
    """

    def __init__(self, max_reqs: int, num_drops: int):
        self.none = (0,) * num_drops
        self.by_row: List[Tuple[int, ...]] = [self.none] * max_reqs
        self.stale: set = set()

    def set(self, row: int, gaps: Sequence[int]) -> None:
        gaps = tuple(int(g) for g in gaps)
        if any(g < 0 for g in gaps):
            raise ValueError(f"UniPrefill: negative KV gap {gaps} for request row {row}")
        self.by_row[row] = gaps if any(gaps) else self.none
        self.stale.discard(row)

    def invalidate(self, row: int) -> None:
        self.stale.add(row)

    def is_stale(self, row: int) -> bool:
        return row in self.stale

    def get(self, row: int) -> Tuple[int, ...]:
        return self.by_row[row]


@dataclasses.dataclass
class ForwardKV:
    """The KV one forward's requests hold per stage, as the attention adapters read it (set
    when the forward begins, runtime.py; a drop, a parking chunk and a moved prefix update it)."""
    # Per request: does it hold KV missing in some layer (sparse prefix or a drop this step)?
    sparse: Optional[List[bool]] = None
    # Extend, per request and stage 0..D: slots of its cached prefix holding KV for that stage.
    prefix_valid: Optional[List[List[int]]] = None
    # Decode, per request: the KV it lacks at stages 1..D (host mirror, `KVGaps`).
    gaps: Optional[List[tuple]] = None
    # Attention adapters' per-forward views (planned once, run by every layer of a stage).
    views: Dict[str, dict] = dataclasses.field(default_factory=dict)


class RequestStageKV:
    """Per request, how much KV each stage holds: counted on the device from the slot map,
    mirrored on the host as gaps (what decode plans with), and compared on demand."""

    def __init__(self, slots: SlotStages, gaps: KVGaps, req_to_token: torch.Tensor):
        self.slots, self.gaps, self.req_to_token = slots, gaps, req_to_token

    def valid_counts(self, req_pool_indices, seq_lens, n: int) -> torch.Tensor:
        """[bs, D + 1] on the device: per request, how many slots of positions [0, seq_len)
        hold KV for each stage (n = the lengths' sum, host-known)."""
        seq = gather_seq_slots(self.req_to_token, req_pool_indices, seq_lens, n)
        return self.slots.valid_counts(seq.slots, seq.row, req_pool_indices.shape[0])

    def prefix_valid(self, req_pool_indices, prefix_lens: List[int]) -> List[List[int]]:
        """Per request, per stage 0..D: the slots of its prefix holding KV for that stage (one
        device read when some request has a prefix)."""
        valid = [[plen] * (self.slots.full + 1) for plen in prefix_lens]
        with_prefix = [b for b, plen in enumerate(prefix_lens) if plen > 0]
        if not self.slots.full or not with_prefix:
            return valid
        device = req_pool_indices.device
        lens = [prefix_lens[b] for b in with_prefix]
        counts = self.valid_counts(req_pool_indices[_on(with_prefix, device)],
                                   _on(lens, device), sum(lens)).tolist()
        for b, c in zip(with_prefix, counts):
            valid[b] = c
        return valid

    def record_extend(self, row: int, seq_len: int, prefix_valid: List[int],
                      entered: List[int], corrupt: bool = False) -> bool:
        """After an extend: the row's gap at stage s is its sequence minus the valid prefix and
        the rows that entered the stage. An inconsistent (negative) count leaves the row stale,
        read back from the device before its next decode; False then. `corrupt` (test only)
        makes the count inconsistent."""
        gaps = [seq_len - prefix_valid[s] - entered[s - 1] - (seq_len + 1 if corrupt else 0)
                for s in range(1, self.slots.full + 1)]
        if any(g < 0 for g in gaps):
            self.gaps.invalidate(row)
            return False
        self.gaps.set(row, gaps)
        return True

    def refresh_stale(self, rows: List[int], req_pool_indices, seq_lens, seq_lens_cpu) -> None:
        """Decode: recount the gaps of stale rows from the device slot map (one sync)."""
        stale = [b for b, r in enumerate(rows) if self.gaps.is_stale(r)]
        if not stale:
            return
        idx = _on(stale, req_pool_indices.device)
        host_lens = seq_lens_cpu[stale].to(torch.int64)
        valid = self.valid_counts(req_pool_indices[idx], seq_lens[idx], int(host_lens.sum())).cpu()
        for i, b in enumerate(stale):
            self.gaps.set(rows[b], (host_lens[i] - valid[i, 1:]).tolist())

    def check_decode(self, req_pool_indices, seq_lens, seq_lens_cpu, gaps) -> None:
        """Debug: the host gaps of a decode batch agree with the device's slot stages."""
        bs = len(gaps)
        host_lens = seq_lens_cpu[:bs].to(torch.int32)
        device = self.valid_counts(req_pool_indices[:bs], seq_lens[:bs],
                                   int(host_lens.sum()))[:, 1:]
        host = host_lens.unsqueeze(1) - torch.tensor(gaps, dtype=torch.int32)
        check_kv_lens(host, device, "decode, valid KV per request and stage from the host gaps")

    def check_extend(self, req_pool_indices, seq_lens, seq_lens_cpu: List[int],
                     stage_lens: List[int], stage: int) -> None:
        """Debug: after a drop, each request holds for `stage` the KV the views assume."""
        device = self.valid_counts(req_pool_indices, seq_lens, sum(seq_lens_cpu))
        check_kv_lens(torch.tensor(stage_lens), device[:, stage],
                      f"extend after a drop, stage {stage}")


def _on(values: List[int], device) -> torch.Tensor:
    return to_device(values, torch.int64, device)


def check_kv_lens(host: torch.Tensor, device_counts: torch.Tensor, what: str) -> None:
    """Debug (UNIPREFILL_CHECK_KV_LENS=1, one sync): the host lengths a plan uses must equal
    the KV the view (or the slot map) really holds."""
    got = device_counts.cpu().to(torch.int32)
    if not torch.equal(host.to(torch.int32), got):
        raise CheckFailed(f"UniPrefill: {what}: host KV lengths {host.tolist()} != "
                           f"device {got.tolist()}")


# ---- per-stage views on the device (no host sync) -------------------------------------------
def segment_ids(lens: torch.Tensor, n: int) -> torch.Tensor:
    """[0,0,1,2,2,2,...]: the segment of each of the n = sum(lens) elements."""
    bs = lens.shape[0]
    return torch.repeat_interleave(
        torch.arange(bs, device=lens.device), lens.to(torch.int64), output_size=n
    )


class SeqSlots(NamedTuple):
    """The slots of several requests' sequences, concatenated."""
    slots: torch.Tensor   # [n]
    row: torch.Tensor     # [n] the request (segment) of each slot
    bounds: torch.Tensor  # [bs + 1] int64: segment b is slots[bounds[b]:bounds[b + 1]]
    pos: torch.Tensor     # [n] int64: each slot's position in its sequence


def gather_seq_slots(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     seq_lens: torch.Tensor, n: int,
                     starts: Optional[torch.Tensor] = None) -> SeqSlots:
    """The slots of positions [start, seq_len) of each request (`starts` [bs], default 0;
    n = the spans' sum, host-known)."""
    bs = req_pool_indices.shape[0]
    ends = seq_lens[:bs].to(torch.int64)
    lens = ends if starts is None else ends - starts[:bs].to(torch.int64)
    row = segment_ids(lens, n)
    bounds = torch.zeros(bs + 1, dtype=torch.int64, device=lens.device)
    torch.cumsum(lens, 0, out=bounds[1:])
    col = torch.arange(n, device=lens.device) - bounds[row]
    if starts is not None:
        col += starts[:bs].to(torch.int64)[row]
    slots = req_to_token[req_pool_indices.to(torch.int64)[row], col]
    return SeqSlots(slots, row, bounds, col)


def compact(slots: torch.Tensor, bounds: torch.Tensor, keep: torch.Tensor,
            out: Optional[torch.Tensor] = None, indptr_out: Optional[torch.Tensor] = None,
            dtype: Optional[torch.dtype] = None):
    """Keep `slots[keep]`, segment by segment, without a host sync and without atomics.

    `keep` is [n] (one view) or [V, n] (V views of the same positions, e.g. one per stage);
    `slots` is [n], or [V, n] when each view names the positions by its own slots (the stage
    pools' slots).
    Returns (counts [V, bs] int32, indptr [V, bs + 1] int32, indices [V, >= n + 1]), without
    the V dimension for a 1-D `keep`. Kept entries land at their compacted position; the others
    are scattered to the last element of their row (a dump slot), so `out` needs n + 1 columns.
    """
    one_view = keep.dim() == 1
    keep = keep.view(1, -1) if one_view else keep
    views, n = keep.shape
    bs = bounds.numel() - 1
    device = slots.device
    # kept_before[:, i]: kept entries among the first i; the segment bounds pick the indptr.
    kept_before = torch.zeros(views, n + 1, dtype=torch.int32, device=device)
    torch.cumsum(keep, 1, dtype=torch.int32, out=kept_before[:, 1:])
    indptr = kept_before.index_select(1, bounds)
    if indptr_out is not None:
        indptr_out = indptr_out.view(views, -1)[:, : bs + 1]
        indptr_out.copy_(indptr)
        indptr = indptr_out
    counts = indptr[:, 1:] - indptr[:, :-1]
    if out is None:
        out = torch.empty(views, n + 1, dtype=dtype or slots.dtype, device=device)
    out = out.view(views, -1)
    if out.shape[1] < n + 1:
        raise RuntimeError(f"UniPrefill: KV index buffer of {out.shape[1]} entries is too small "
                           f"for {n} candidate slots")
    if n:
        dest = torch.where(keep, kept_before[:, :n].to(torch.int64), out.shape[1] - 1)
        out.scatter_(1, dest, slots.to(out.dtype).expand(views, n))
    if one_view:
        return counts[0], indptr[0], out[0]
    return counts, indptr, out


def stage_views(slot_stages: SlotStages, req_to_token, req_pool_indices, seq_lens,
                n: int, raw_bs: int, outs=None, indptr_outs=None, dtype=None,
                window: Optional[int] = None, positions: bool = False):
    """The KV list of the first `seq_lens` positions of each request (a decode step's
    sequences, an extend's cached prefixes) at every stage after the first, in one pass:
    (counts [V, bs], indptr [V, bs + 1], indices [V, >= n + 1]), row k for stage k + 1
    (`outs` / `indptr_outs`: static [V, ...] buffers to fill). V is D, the later stages, or
    2D + 1 with a sliding `window`: row D + s then lists, of stage s's KV (stage 0 included,
    where every slot is valid), the positions a query at the last position sees (`window`
    positions back at most, counted in original positions, as the torch_native adapter masks
    them). With `positions`, a fourth tensor [V, >= n + 1] holds each listed slot's position.

    A request without dropped KV has every slot at FULL, so it keeps its whole sequence by the
    same rule; the padding rows of a CUDA-graph batch (index >= raw_bs) point at arbitrary
    slots and are kept whole explicitly."""
    bs = req_pool_indices.shape[0]
    seq = gather_seq_slots(req_to_token, req_pool_indices, seq_lens, n)
    st = slot_stages.slot_stage[seq.slots.to(torch.int64)]
    keep = st.unsqueeze(0) >= slot_stages.stages_after_first.unsqueeze(1)
    if raw_bs < bs:
        keep |= (seq.row >= raw_bs).unsqueeze(0)
    slots = slot_stages.pool_slots_after_first(seq.slots)
    if window is not None:
        last = seq_lens[:bs].to(torch.int64)[seq.row] - 1
        recent = (seq.pos >= last - window).unsqueeze(0)
        keep = torch.cat([keep, recent, keep & recent])
        slots = torch.cat([slots, seq.slots.to(slots.dtype).unsqueeze(0), slots])
    views = compact(slots, seq.bounds, keep, out=outs, indptr_out=indptr_outs, dtype=dtype)
    if not positions:
        return views
    _, _, pos = compact(seq.pos.expand(keep.shape[0], n), seq.bounds, keep)
    return (*views, pos)


def window_views(slot_stages: SlotStages, req_to_token, req_pool_indices, seq_lens,
                 window: int, n: int, raw_bs: int, outs=None, indptr_outs=None, pos_outs=None):
    """A decode step's sliding-window lists at every stage after the first: row k lists, of
    stage k + 1's KV, the positions a query at each sequence's last position sees (at most
    `window` positions back, in original positions), with each listed slot's position:
    (counts [D, bs], indptr [D, bs + 1], indices [D, >= n + 1], pos [D, >= n + 1]).

    The same lists as `stage_views(..., window=window)`'s windowed rows, gathered from the
    window's span only (n = the spans' sum, `min(seq_len, window + 1)` per request, host-known),
    so static buffers hold `max_bs * (window + 1) + 1` entries per stage, not a whole batch's
    sequences. Padding rows of a CUDA-graph batch (index >= raw_bs) keep their whole span."""
    bs = req_pool_indices.shape[0]
    ends = seq_lens[:bs].to(torch.int64)
    seq = gather_seq_slots(req_to_token, req_pool_indices, ends, n,
                           starts=torch.clamp(ends - (window + 1), min=0))
    keep = (slot_stages.slot_stage[seq.slots.to(torch.int64)].unsqueeze(0)
            >= slot_stages.stages_after_first.unsqueeze(1))
    if raw_bs < bs:
        keep |= (seq.row >= raw_bs).unsqueeze(0)
    counts, indptr, indices = compact(slot_stages.pool_slots_after_first(seq.slots), seq.bounds,
                                      keep, out=outs, indptr_out=indptr_outs)
    _, _, pos = compact(seq.pos.expand(keep.shape[0], n), seq.bounds, keep, out=pos_outs)
    return counts, indptr, indices, pos


def extend_stage_slots(slot_stages: SlotStages, req_to_token, req_pool_indices, seq_lens,
                       n: int, stage: int):
    """Extend at `stage`: every position of each request's sequence (SeqSlots, named by the
    stage pool's slots) and whether the stage holds its KV."""
    seq = gather_seq_slots(req_to_token, req_pool_indices, seq_lens, n)
    valid = slot_stages.slot_stage[seq.slots.to(torch.int64)] >= stage
    return seq._replace(slots=slot_stages.pool_slots(seq.slots, stage)), valid
