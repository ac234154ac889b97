"""Readable torch references of the Gated DeltaNet layer's two sequence operators, as SGLang
0.5.17's GDN backend calls them (`layers/attention/linear/gdn_backend.py`): the short causal
convolution and the gated delta rule, over variable-length sequences packed in one batch, each
sequence's state read from and written back to a slot of SGLang's mamba pool.

They serve two purposes: the CPU engine runs Qwen3-Next with them (the test-only `sgl_kernel`
stand-in, tests/stubs, forwards the CPU kernels SGLang calls to these functions), and the tests
check, against them, that after a drop a linear layer's recurrence ran over the survivors only
(what `linear_attention.py`, beside this module, arranges).

Layouts (SGLang's): a conv state slot is [dim, width - 1] (the last inputs, oldest first); a
recurrent state slot is [HV, V, K] (value heads, value dim, key dim). Query and key heads are
shared by HV / HK value heads each.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def _activate(x: torch.Tensor, activation) -> torch.Tensor:
    if activation in ("silu", "swish", True):
        return F.silu(x)
    if activation in (None, False):
        return x
    raise ValueError(f"unknown activation {activation!r}")


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         conv_states: torch.Tensor, query_start_loc: torch.Tensor,
                         cache_indices: torch.Tensor, has_initial_state: Optional[torch.Tensor],
                         activation="silu", **_ignored) -> torch.Tensor:
    """x [dim, T] (sequences packed along T) -> [dim, T]. Sequence b convolves its inputs,
    preceded by its slot's state when `has_initial_state[b]` (else zeros); the slot then holds
    its last width - 1 inputs."""
    dim, width = weight.shape
    out = torch.zeros_like(x)  # a skipped sequence (slot -1) gets zeros
    bounds = query_start_loc.tolist()
    for b, slot in enumerate(cache_indices.tolist()):
        start, end = bounds[b], bounds[b + 1]
        if slot < 0:
            continue
        initial = (conv_states[slot].to(x.dtype)
                   if has_initial_state is not None and bool(has_initial_state[b])
                   else x.new_zeros(dim, width - 1))
        seq = torch.cat([initial, x[:, start:end]], dim=1)  # [dim, width - 1 + n]
        windows = seq.unfold(1, width, 1)  # [dim, n, width]
        y = (windows.float() * weight.float().unsqueeze(1)).sum(-1)
        if bias is not None:
            y = y + bias.float().unsqueeze(1)
        out[:, start:end] = _activate(y, activation).to(x.dtype)
        conv_states[slot] = seq[:, -(width - 1):].to(conv_states.dtype)
    return out


def causal_conv1d_step(x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor,
                       bias: Optional[torch.Tensor], activation="silu",
                       conv_state_indices: Optional[torch.Tensor] = None,
                       **_ignored) -> torch.Tensor:
    """One decode token per row: x [B, dim] -> [B, dim], each row a sequence of one token that
    starts from its slot's state."""
    rows = x.shape[0]
    slots = (conv_state_indices if conv_state_indices is not None
             else torch.arange(rows, device=x.device))
    one_each = torch.arange(rows + 1, device=x.device)
    return causal_conv1d_varlen(x.T, weight, bias, conv_states, one_each, slots,
                                torch.ones(rows, dtype=torch.bool), activation).T


def gdn_gating(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor,
               softplus_beta: float = 1.0, softplus_threshold: float = 20.0):
    """(g, beta), each [1, T, HV]: g = -exp(A_log) * softplus(a + dt_bias) (float32, the log of
    the state's decay), beta = sigmoid(b) (b's dtype)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float(), beta=softplus_beta,
                                          threshold=softplus_threshold)
    return g.unsqueeze(0), torch.sigmoid(b.float()).to(b.dtype).unsqueeze(0)


def gated_delta_rule_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, initial_state: torch.Tensor,
                            initial_state_indices: torch.Tensor, cu_seqlens: torch.Tensor,
                            scale: Optional[float] = None, use_qk_l2norm_in_kernel: bool = True,
                            **_ignored):
    """The gated delta rule over packed sequences: q, k [1, T, HK, K], v [1, T, HV, V], g and
    beta [1, T, HV]. Sequence b starts from state slot `initial_state_indices[b]` and leaves its
    final state there. Per value head, with S [V, K] and (l2-normalised) q_t, k_t:

        S <- exp(g_t) S;  S <- S + beta_t (v_t - S k_t) k_t^T;  o_t = S (scale q_t)

    Returns (o [1, T, HV, V], None, None), the shape of SGLang's kernel dispatcher's result."""
    hk, dk = q.shape[-2:]
    hv = v.shape[-2]
    scale = dk ** -0.5 if scale is None else scale
    qf, kf = q[0].float(), k[0].float()
    if use_qk_l2norm_in_kernel:
        qf = qf / qf.norm(dim=-1, keepdim=True).clamp_min(1e-6)
        kf = kf / kf.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    groups = hv // hk
    qf = qf.repeat_interleave(groups, dim=1) * scale  # [T, HV, K]
    kf = kf.repeat_interleave(groups, dim=1)
    vf, gf, bf = v[0].float(), g[0].float(), beta[0].float()
    out = torch.zeros(v.shape[1:], dtype=torch.float32, device=v.device)
    bounds = cu_seqlens.tolist()
    for b, slot in enumerate(initial_state_indices.tolist()):
        if slot < 0:
            continue
        state = initial_state[slot].float()  # [HV, V, K]
        for t in range(bounds[b], bounds[b + 1]):
            state = state * gf[t].exp()[:, None, None]
            error = vf[t] - torch.einsum("hvk,hk->hv", state, kf[t])
            state = state + bf[t][:, None, None] * error[:, :, None] * kf[t][:, None, :]
            out[t] = torch.einsum("hvk,hk->hv", state, qf[t])
        initial_state[slot] = state.to(initial_state.dtype)
    return out.to(v.dtype).unsqueeze(0), None, None


def gated_delta_rule_decode(A_log, dt_bias, q, k, v, a, b, initial_state_source,
                            initial_state_indices, cu_seqlens=None,
                            use_qk_l2norm_in_kernel: bool = True, softplus_beta: float = 1.0,
                            softplus_threshold: float = 20.0, **_ignored) -> torch.Tensor:
    """One decode step per request (q, k [1, B, HK, K], v [1, B, HV, V], a and b [B, HV]): the
    gating and the rule fused, as SGLang's decode kernel does. Returns o [1, B, HV, V]."""
    g, beta = gdn_gating(A_log, a, b, dt_bias, softplus_beta, softplus_threshold)
    rows = torch.arange(q.shape[1] + 1, device=q.device)
    out, _, _ = gated_delta_rule_varlen(q, k, v, g, beta, initial_state_source,
                                        initial_state_indices, rows,
                                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return out
