"""Float64 torch reference of attention masked by original token positions.

After tokens are dropped, a request's KV holds only the surviving positions, scattered over a
paged pool.  The mask is therefore stated on the positions each entry had in the original
sequence, never on the entries' order or count:

    key j is visible to query i  iff  kv_pos[j] <= q_pos[i]
                                      and (window < 0 or kv_pos[j] >= q_pos[i] - window)

``window`` counts original positions, as SGLang's ``sliding_window_size`` does (a Hugging Face
``sliding_window`` of W is ``window = W - 1``).  ``window < 0`` is a full causal layer.

``sinks`` (gpt-oss's learned attention sinks): one logit per query head that joins every row's
softmax denominator and contributes no value, so a row's weights over its keys sum to less than
one: softmax over [logits, sink], the sink's column left out.
"""

from __future__ import annotations

import torch


def positional_attention_reference(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    q_indptr: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_pos: torch.Tensor,
    sm_scale: float,
    window: int = -1,
    logit_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each request's queries over its own keys, in float64, one request at a time.

    q:          [Nq, Hq, D]; request b owns the rows q_indptr[b]:q_indptr[b+1].
    q_pos:      [Nq] int, original positions of the query rows.
    q_indptr:   [B+1] int.
    k_buffer:   [S, Hkv, D] and v_buffer [S, Hkv, Dv]: the KV pool, indexed by slot; Hq % Hkv == 0,
                query head h reads kv head h // (Hq // Hkv).
    kv_indptr:  [B+1] int; request b's keys are the entries kv_indptr[b]:kv_indptr[b+1] of
    kv_indices: (slots in the pool) and of
    kv_pos:     (their original positions; indexed like kv_indices, not by slot).
    sm_scale:   logits = (q . k) * sm_scale.
    window:     see the module docstring; < 0 for no window.
    logit_cap:  > 0: logits = logit_cap * tanh(logits / logit_cap) before the softmax.
    sinks:      optional [Hq] sink logits (not scaled by sm_scale), see the module docstring.
    Returns [Nq, Hq, Dv] in q's dtype.  A row with no visible key, and a row no request owns,
    is zero.
    """
    nq, hq, d = q.shape
    hkv = k_buffer.shape[1]
    assert hq % hkv == 0, (hq, hkv)
    group = hq // hkv
    dv = v_buffer.shape[2]
    f64 = torch.float64
    out = torch.zeros(nq, hq, dv, dtype=f64, device=q.device)
    q_bounds = q_indptr.tolist()
    kv_bounds = kv_indptr.tolist()
    for b in range(len(q_bounds) - 1):
        q0, q1 = q_bounds[b], q_bounds[b + 1]
        k0, k1 = kv_bounds[b], kv_bounds[b + 1]
        if q1 <= q0 or k1 <= k0:
            continue
        slots = kv_indices[k0:k1].long()
        kp = kv_pos[k0:k1].long()
        qp = q_pos[q0:q1].long()
        # [Hq, n, D] keys and values of this request, each query head with its kv head
        keys = k_buffer[slots].to(f64).repeat_interleave(group, dim=1).transpose(0, 1)
        values = v_buffer[slots].to(f64).repeat_interleave(group, dim=1).transpose(0, 1)
        queries = q[q0:q1].to(f64).transpose(0, 1)  # [Hq, m, D]

        visible = kp[None, :] <= qp[:, None]  # [m, n]
        if window >= 0:
            visible &= kp[None, :] >= qp[:, None] - window

        logits = torch.matmul(queries, keys.transpose(1, 2)) * sm_scale  # [Hq, m, n]
        if logit_cap > 0:
            logits = logit_cap * torch.tanh(logits / logit_cap)
        logits = logits.masked_fill(~visible, float("-inf"))
        row_max = logits.amax(dim=-1, keepdim=True)
        if sinks is not None:
            sink = sinks.to(device=q.device, dtype=f64).view(hq, 1, 1)
            row_max = torch.maximum(row_max, sink)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        weights = torch.exp(logits - row_max)  # masked entries: exp(-inf) = 0
        mass = weights.sum(dim=-1, keepdim=True)
        if sinks is not None:
            # a row that sees no key keeps zero weights (the sink alone has no value)
            mass = mass + torch.exp(sink - row_max)
        weights = weights / torch.where(mass > 0, mass, torch.ones_like(mass))
        out[q0:q1] = torch.matmul(weights, values).transpose(0, 1)
    return out.to(q.dtype)
