"""Prepacking baseline (Zhao et al., 2024) for Hugging Face causal LMs, written from the paper's idea.

Prefilling a batch of prompts of very different lengths by padding them to the longest wastes
compute and memory on pad tokens. Prepacking instead packs several prompts into one row:

1. **Bin packing** (``first_fit_decreasing``): prompt lengths are items, rows are bins of a fixed
   capacity (by default the longest prompt, so no row is wider than the padded batch would be).
   Items are sorted longest first and each goes into the first row that still has room; a new
   row is opened when none has. First-fit decreasing uses at most 11/9 OPT + 6/9 rows.
2. **Packed batch** (``build_packed_batch``): each row is the concatenation of its prompts,
   right-padded to the widest row. Position ids restart at 0 for every prompt, and an additive
   4D attention mask ``(rows, 1, W, W)`` in the model dtype is *block-diagonal causal*: a token
   attends to a key iff both belong to the same prompt and the key is not after it (0 = attend,
   ``finfo(dtype).min`` = masked). Tail padding tokens attend only to themselves, so no mask row
   is empty (an all-masked row would turn into NaN with ``-inf``).
3. **One forward** of the base model over the packed rows; each prompt's last-token hidden state
   is read at its packed offset ``(row, start + length - 1)`` and only those rows go through the
   LM head (``run_packed``).

For comparison ``build_padded_batch`` / ``run_padded`` is the ordinary batch: padding to the
longest prompt (right by default, left with ``side="left"`` as ``generate`` needs), a 2D attention
mask, positions counting real tokens only. ``run_one_by_one`` runs each prompt alone without
padding: the reference both must match.

Time to first token as the paper defines it (its ``TTFT_with_prepacking``): prefill every prompt
but its last token packed, **unpack** the packed KV cache into the ordinary left-padded cache
(``unpack_kv``), then run one step over the last tokens against that cache and take the first
generated token (``ttft_packed``). Its baseline (``TTFT_with_baseline``: ``generate`` with
``max_new_tokens=1`` on the left-padded batch) is ``ttft_padded``: one forward over the
left-padded prompts that keeps the KV cache, logits for the last position only, argmax. Our
unpack gathers each layer's keys and values with one indexing op per tensor (the paper's loops
over prompts and layers in Python) and releases each packed layer as soon as it is unpacked.

How transformers 5.x takes the custom mask (read from the installed source, 5.12):
``masking_utils._preprocess_mask_arguments`` returns any 4D tensor mask as-is ("already prepared,
or custom"), and Llama's ``eager_attention_forward`` adds it to the scores while the ``sdpa`` path
passes it as ``attn_mask`` to ``torch.nn.functional.scaled_dot_product_attention``; both treat a
float mask as additive. So the mask must be float in the model dtype (not bool) for ``eager``, and
an additive float mask works for both; ``flash_attention_*`` implementations ignore 4D masks and
are not supported here.

All runners compute logits only for the positions they return (hidden states are gathered before
the LM head): a full ``(batch, L, vocab)`` logits tensor would dominate memory for no purpose.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = [
    "first_fit_decreasing",
    "PackedBatch",
    "PaddedBatch",
    "build_packed_batch",
    "build_padded_batch",
    "run_packed",
    "run_padded",
    "run_one_by_one",
    "prefill_padded",
    "prefill_packed",
    "unpack_kv",
    "ttft_padded",
    "ttft_packed",
]


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Pack items (prompt lengths) into bins (rows) of ``capacity`` tokens, first-fit decreasing.

    Returns the bins as lists of item indices into ``lengths``; every index appears in exactly one
    bin and no bin's total length exceeds ``capacity``. Bins are in opening order; inside a bin,
    items are in the order they were placed (longest first). Ties in length keep input order, so
    the result is deterministic.

    Because it is first fit, any two bins together hold more than ``capacity`` (an item in a later
    bin would have fitted in an earlier one otherwise), i.e. at most one bin is half full or less.
    Raises ``ValueError`` for an item longer than ``capacity`` or a non-positive length.
    """
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    for i, n in enumerate(lengths):
        if n <= 0:
            raise ValueError(f"length {i} is {n}; every prompt needs at least one token")
        if n > capacity:
            raise ValueError(f"length {i} is {n}, more than the row capacity {capacity}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + lengths[i] <= capacity:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:  # no open bin has room: open a new one
            bins.append([i])
            loads.append(lengths[i])
    return bins


@dataclass
class PackedBatch:
    """Prompts packed into rows (see the module docstring).

    ``index[i] = (row, start, length)`` locates prompt ``i`` (input order) in the packed rows.
    """

    input_ids: torch.Tensor  # (rows, W) int64
    position_ids: torch.Tensor  # (rows, W) int64, restarting at 0 per prompt
    attention_mask: torch.Tensor  # (rows, 1, W, W) additive, model dtype
    index: list[tuple[int, int, int]]
    capacity: int

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]

    @property
    def real_tokens(self) -> int:
        return sum(n for _, _, n in self.index)

    @property
    def fill_ratio(self) -> float:
        """Real tokens over the tokens the forward computes (rows x width)."""
        return self.real_tokens / (self.num_rows * self.width)


@dataclass
class PaddedBatch:
    input_ids: torch.Tensor  # (n, L) int64, right- or left-padded
    attention_mask: torch.Tensor  # (n, L) int64, 1 for real tokens
    lengths: list[int]
    side: str = "right"

    @property
    def position_ids(self) -> torch.Tensor:
        """0, 1, ... over each prompt's real tokens (pads get 0), as ``generate`` computes them."""
        return (self.attention_mask.cumsum(-1) - 1).clamp(min=0)

    @property
    def last_columns(self) -> list[int]:
        """Column of each prompt's last token."""
        if self.side == "left":
            return [self.input_ids.shape[1] - 1] * len(self.lengths)
        return [n - 1 for n in self.lengths]

    @property
    def real_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def padded_tokens(self) -> int:
        return self.input_ids.numel() - self.real_tokens


def _as_lists(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    out = [list(map(int, p)) for p in prompts]
    if not out:
        raise ValueError("no prompts")
    return out


def build_packed_batch(
    prompts: Sequence[Sequence[int]],
    dtype: torch.dtype = torch.float32,
    capacity: int | None = None,
    pad_token_id: int = 0,
    device: torch.device | str | None = None,
) -> PackedBatch:
    """Pack token-id prompts into rows by first-fit decreasing; build ids, positions and mask.

    ``capacity`` defaults to the longest prompt. The rows are as wide as the fullest row (at most
    ``capacity``). The mask is built on ``device`` directly (it is rows x W x W elements).
    """
    prompts = _as_lists(prompts)
    lengths = [len(p) for p in prompts]
    capacity = max(lengths) if capacity is None else int(capacity)
    bins = first_fit_decreasing(lengths, capacity)
    width = max(sum(lengths[i] for i in b) for b in bins)
    rows = len(bins)

    input_ids = torch.full((rows, width), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((rows, width), dtype=torch.long)
    # segment[r, t]: which prompt (0, 1, ... within the row) token t of row r belongs to;
    # tail padding gets a distinct id per token (-1 - t) so it only ever sees itself.
    segment = -1 - torch.arange(width).repeat(rows, 1)
    index: list[tuple[int, int, int] | None] = [None] * len(prompts)
    for r, b in enumerate(bins):
        start = 0
        for k, i in enumerate(b):
            n = lengths[i]
            input_ids[r, start:start + n] = torch.tensor(prompts[i], dtype=torch.long)
            position_ids[r, start:start + n] = torch.arange(n)
            segment[r, start:start + n] = k
            index[i] = (r, start, n)
            start += n

    segment = segment.to(device)
    same_prompt = segment[:, :, None] == segment[:, None, :]  # (rows, q, k)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    allowed = same_prompt & causal
    mask = torch.zeros((rows, 1, width, width), dtype=dtype, device=device)
    mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    return PackedBatch(
        input_ids=input_ids.to(device),
        position_ids=position_ids.to(device),
        attention_mask=mask,
        index=index,  # type: ignore[arg-type]
        capacity=capacity,
    )


def build_padded_batch(
    prompts: Sequence[Sequence[int]],
    pad_token_id: int = 0,
    device: torch.device | str | None = None,
    side: str = "right",
) -> PaddedBatch:
    """Pad every prompt to the longest (``side`` "right" or "left"); a 2D mask marks real tokens."""
    if side not in ("right", "left"):
        raise ValueError(f"side must be 'right' or 'left', got {side!r}")
    prompts = _as_lists(prompts)
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        cols = slice(0, len(p)) if side == "right" else slice(width - len(p), width)
        input_ids[i, cols] = torch.tensor(p, dtype=torch.long)
        attention_mask[i, cols] = 1
    return PaddedBatch(input_ids.to(device), attention_mask.to(device), lengths, side)


def _base_and_head(model):
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    head = model.get_output_embeddings()
    if base is None or head is None:
        raise ValueError(f"{type(model).__name__}: cannot find the decoder and the LM head")
    return base, head


def _check_attn_impl(model) -> None:
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in ("eager", "sdpa"):
        raise ValueError(
            f"attn_implementation {impl!r}: a custom 4D mask needs 'eager' or 'sdpa'"
        )


@torch.inference_mode()
def run_packed(model, batch: PackedBatch) -> torch.Tensor:
    """One forward over the packed rows; returns ``(n_prompts, vocab)`` last-token logits."""
    return prefill_packed(model, batch, use_cache=False)[0]


@torch.inference_mode()
def run_padded(model, batch: PaddedBatch) -> torch.Tensor:
    """One forward over the padded batch; returns ``(n_prompts, vocab)`` last-token logits."""
    return prefill_padded(model, batch, use_cache=False)[0]


@torch.inference_mode()
def run_one_by_one(
    model, prompts: Sequence[Sequence[int]], device: torch.device | str | None = None
) -> torch.Tensor:
    """Each prompt alone, no padding, no mask: the reference last-token logits ``(n, vocab)``."""
    base, head = _base_and_head(model)
    prompts = _as_lists(prompts)
    out = None
    for i, p in enumerate(prompts):
        ids = torch.tensor([p], dtype=torch.long, device=device)
        h = base(input_ids=ids, use_cache=False).last_hidden_state[0, -1]
        logits = head(h)
        if out is None:  # NaN-filled so that a row this loop never wrote cannot pass a check
            out = torch.full((len(prompts), logits.shape[-1]), float("nan"),
                             dtype=logits.dtype, device=logits.device)
        out[i] = logits
    return out


# ---------------------------------------------------------------------------- with the KV cache


def _base_forward(model, batch, use_cache: bool):
    """The model body over a padded or packed batch: (its output, the LM head)."""
    base, head = _base_and_head(model)
    out = base(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
               position_ids=batch.position_ids, use_cache=use_cache)
    return out, head


@torch.inference_mode()
def prefill_padded(model, batch: PaddedBatch, use_cache: bool = True):
    """Forward over the padded batch: ``(last-token logits (n, vocab), KV cache or None)``."""
    out, head = _base_forward(model, batch, use_cache)
    hidden = out.last_hidden_state
    rows = torch.arange(len(batch.lengths), device=hidden.device)
    cols = torch.tensor(batch.last_columns, device=hidden.device)
    return head(hidden[rows, cols]), (out.past_key_values if use_cache else None)


@torch.inference_mode()
def prefill_packed(model, batch: PackedBatch, use_cache: bool = True, logits: bool = True):
    """Forward over the packed rows: ``(last-token logits (n, vocab) or None, KV cache or None)``.

    The cache is the packed one: per layer, keys and values of shape ``(rows, kv_heads, W, d)``.
    """
    _check_attn_impl(model)
    out, head = _base_forward(model, batch, use_cache)
    cache = out.past_key_values if use_cache else None
    if not logits:
        return None, cache
    hidden = out.last_hidden_state
    rows = torch.tensor([r for r, _, _ in batch.index], device=hidden.device)
    cols = torch.tensor([s + n - 1 for _, s, n in batch.index], device=hidden.device)
    return head(hidden[rows, cols]), cache


def _cache_tensors(cache) -> list:
    """Per layer ``[keys, values]`` of a transformers cache (DynamicCache or legacy tuples)."""
    if hasattr(cache, "layers"):
        return [[layer.keys, layer.values] for layer in cache.layers]
    return [[k, v] for k, v in cache]


def unpack_kv(packed_kv: list, batch: PackedBatch):
    """Packed per-layer ``[keys, values]`` -> the left-padded cache of the prompts, input order.

    ``packed_kv[layer] = [keys, values]`` of shape ``(rows, kv_heads, W, d)`` (``_cache_tensors``);
    the list is emptied as it goes (each packed layer is released once unpacked). Returns
    ``(DynamicCache with (n, kv_heads, M, d) per layer, attention_mask (n, M) int64)`` with ``M``
    the longest prompt; prompt ``i``'s entries fill the last ``length_i`` columns. The pad
    columns hold keys of other tokens; the mask hides them.
    """
    from transformers import DynamicCache

    device = packed_kv[0][0].device
    r = torch.tensor([r for r, _, _ in batch.index], device=device)
    s = torch.tensor([s for _, s, _ in batch.index], device=device)
    m = torch.tensor([n for _, _, n in batch.index], device=device)
    width_out = int(m.max())
    off = torch.arange(width_out, device=device)[None, :] - (width_out - m)[:, None]
    mask = (off >= 0).long()
    rows = r[:, None].expand(-1, width_out)
    cols = s[:, None] + off.clamp(min=0)
    cache = DynamicCache()
    for layer in range(len(packed_kv)):
        k, v = packed_kv[layer]
        packed_kv[layer] = None
        # (rows, h, W, d)[rows_idx, :, cols_idx] -> (n, M, h, d): indexed dims first
        k = k[rows, :, cols].transpose(1, 2)
        v = v[rows, :, cols].transpose(1, 2)
        cache.update(k, v, layer)
        del k, v
    return cache, mask


@torch.inference_mode()
def ttft_padded(model, prompts: Sequence[Sequence[int]], pad_token_id: int = 0,
                device: torch.device | str | None = None) -> torch.Tensor:
    """The paper's baseline TTFT: ``generate(max_new_tokens=1)`` on the left-padded batch.

    One forward that builds the KV cache of every prompt; the last position's logits give the
    first token. Returns those logits ``(n, vocab)`` (their argmax is the first token).
    """
    batch = build_padded_batch(prompts, pad_token_id=pad_token_id, device=device, side="left")
    logits, cache = prefill_padded(model, batch, use_cache=True)
    del cache
    return logits


@torch.inference_mode()
def ttft_packed(model, prompts: Sequence[Sequence[int]], dtype: torch.dtype = torch.float32,
                device: torch.device | str | None = None) -> torch.Tensor:
    """The paper's Prepacking TTFT: packed prefill of all but the last token, unpack, one step.

    Returns the first step's logits ``(n, vocab)``; every prompt needs at least 2 tokens.
    """
    prompts = _as_lists(prompts)
    if min(map(len, prompts)) < 2:
        raise ValueError("ttft_packed needs prompts of at least 2 tokens")
    batch = build_packed_batch([p[:-1] for p in prompts], dtype=dtype, device=device)
    _, cache = prefill_packed(model, batch, use_cache=True, logits=False)
    packed_kv = _cache_tensors(cache)
    del cache
    cache, mask = unpack_kv(packed_kv, batch)
    dev = mask.device
    n = len(prompts)
    last = torch.tensor([[p[-1]] for p in prompts], dtype=torch.long, device=dev)
    mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=dev)], dim=1)
    pos = torch.tensor([[len(p) - 1] for p in prompts], dtype=torch.long, device=dev)
    out = model(input_ids=last, attention_mask=mask, position_ids=pos, past_key_values=cache,
                use_cache=True, logits_to_keep=1)
    return out.logits[:, -1]
