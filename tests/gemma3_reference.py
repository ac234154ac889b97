"""A float64 reference of Gemma 3 (`Gemma3ForCausalLM`, a sliding-window hybrid) under a drop,
in plain torch: what SGLang with the torch_native adapter (`uniprefill_sglang/backends/torch_native.py`)
must answer for a prompt and the positions that survive each drop.

Prefill. Every layer runs on the tokens that reached it and keeps their KV. At a drop layer,
right after its attention (which, with its KV write, still sees every token that reached it),
the request keeps its survivors: positions given by the caller, or selected by the project's
rule (`kernels/reference.py` in float64) from that layer's own last queries and keys. From there
on every sublayer (that layer's MLP, every later attention and MLP) runs on the survivors only,
at their original positions: RoPE rotates by the original position, and a query at original
position i sees the key at original position j iff j <= i and, on a sliding-window layer of
window W (Hugging Face's `sliding_window`), i - W < j. That is Hugging Face's mask
(`masking_utils.sliding_window_overlay`: kv_idx > q_idx - W) and SGLang's (its RadixAttention
holds W - 1 and torch_native keeps j >= i - (W - 1)), each read on original positions.
(SGLang 0.5.17's Triton backend, which serves Gemma 3 dense, prefills so too but decodes a
sliding layer over the last W - 1 tokens only: `update_sliding_window_buffer` keeps
min(seq_len, W - 1) keys. Its decoded logits are then not transformers': on a random model
shaped as tests/test_gemma3_reference.py's, under TRITON_INTERPRET=1, they were this
reference's to 4e-6 with the decode window set to W - 1, and 0.45 off from the first decode
step with W.)

Decode (greedy). A new token at position p runs through every layer and, in each, attends to
the KV that layer holds (all the prompt's tokens up to the first drop layer, the survivors after
it) plus the tokens decoded before it, with the window by original positions on sliding layers.

Weights are read from a Hugging Face folder (config.json + safetensors) and computed with in
float64. Gemma 3 as transformers writes it: embeddings scaled by sqrt(hidden), RMSNorm
x / rms(x) * (1 + w), q/k norms per head before RoPE, the scale query_pre_attn_scalar ** -0.5,
local (sliding) and global RoPE bases, gelu-tanh gated MLP, norms after attention and after
the MLP, tied (or separate) LM head, optional final logit soft-capping.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from uniprefill_sglang import kernels

SLIDING = "sliding_attention"
DTYPE = torch.float64


@dataclasses.dataclass
class Layer:
    sliding: bool
    q: torch.Tensor  # [Hq * D, hidden]
    k: torch.Tensor  # [Hkv * D, hidden]
    v: torch.Tensor
    o: torch.Tensor  # [hidden, Hq * D]
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor
    gate: torch.Tensor  # [inter, hidden]
    up: torch.Tensor
    down: torch.Tensor  # [hidden, inter]
    input_norm: torch.Tensor  # [hidden]
    post_attention_norm: torch.Tensor
    pre_feedforward_norm: torch.Tensor
    post_feedforward_norm: torch.Tensor


@dataclasses.dataclass
class Gemma3:
    layers: List[Layer]
    embed: torch.Tensor  # [vocab, hidden]
    lm_head: torch.Tensor  # [vocab, hidden]
    norm: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    eps: float
    window: int  # Hugging Face's sliding_window: a query sees itself and the W - 1 keys before
    rope_theta_global: float
    rope_theta_local: float
    final_softcap: Optional[float]

    @classmethod
    def from_pretrained(cls, folder) -> "Gemma3":
        from safetensors.torch import load_file

        folder = Path(folder)
        cfg = json.loads((folder / "config.json").read_text())
        cfg = cfg.get("text_config", cfg)
        weights = {}
        for f in sorted(folder.glob("*.safetensors")):
            weights.update(load_file(str(f)))
        w = {k.removeprefix("language_model."): t.to(DTYPE) for k, t in weights.items()}
        rope = cfg.get("rope_parameters") or {}
        glob = (rope.get("full_attention") or {}).get("rope_theta", cfg.get("rope_theta", 1e6))
        local = (rope.get("sliding_attention") or {}).get(
            "rope_theta", cfg.get("rope_local_base_freq", 1e4))
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]

        def layer(i: int) -> Layer:
            p = f"model.layers.{i}."
            return Layer(
                sliding=cfg["layer_types"][i] == SLIDING,
                q=w[p + "self_attn.q_proj.weight"], k=w[p + "self_attn.k_proj.weight"],
                v=w[p + "self_attn.v_proj.weight"], o=w[p + "self_attn.o_proj.weight"],
                q_norm=w[p + "self_attn.q_norm.weight"], k_norm=w[p + "self_attn.k_norm.weight"],
                gate=w[p + "mlp.gate_proj.weight"], up=w[p + "mlp.up_proj.weight"],
                down=w[p + "mlp.down_proj.weight"],
                input_norm=w[p + "input_layernorm.weight"],
                post_attention_norm=w[p + "post_attention_layernorm.weight"],
                pre_feedforward_norm=w[p + "pre_feedforward_layernorm.weight"],
                post_feedforward_norm=w[p + "post_feedforward_layernorm.weight"])

        embed = w["model.embed_tokens.weight"]
        return cls(
            layers=[layer(i) for i in range(cfg["num_hidden_layers"])], embed=embed,
            lm_head=w.get("lm_head.weight", embed), norm=w["model.norm.weight"],
            num_heads=cfg["num_attention_heads"], num_kv_heads=cfg["num_key_value_heads"],
            head_dim=head_dim, scale=cfg["query_pre_attn_scalar"] ** -0.5,
            eps=cfg.get("rms_norm_eps", 1e-6), window=cfg["sliding_window"],
            rope_theta_global=glob, rope_theta_local=local,
            final_softcap=cfg.get("final_logit_softcapping"))


# ---- the pieces ---------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [n, H, D] rotated by each row's position (the two halves of D paired, as Gemma's
    rotate_half does)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=DTYPE) / d)
    angles = positions.to(DTYPE)[:, None] * inv_freq[None, :]  # [n, D/2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def visible(query_pos: torch.Tensor, key_pos: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    """[n, m]: may the query at original position i attend to the key at original position j?
    j <= i, and on a sliding-window layer i - window < j."""
    i, j = query_pos[:, None], key_pos[None, :]
    mask = j <= i
    if window is not None:
        mask &= j > i - window
    return mask


def attend(q, k, v, mask, scale) -> torch.Tensor:
    """q [n, Hq, D], k/v [m, Hkv, D], mask [n, m] -> [n, Hq * D]; query head h reads kv head
    h // (Hq / Hkv)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    logits = torch.einsum("nhd,mhd->hnm", q, k) * scale
    logits = logits.masked_fill(~mask[None], float("-inf"))
    out = torch.einsum("hnm,mhd->nhd", torch.softmax(logits, dim=-1), v)
    return out.reshape(q.shape[0], -1)


@dataclasses.dataclass
class LayerKV:
    """The KV one layer holds: keys after norm and RoPE, at their original positions."""
    positions: torch.Tensor  # [m]
    k: torch.Tensor  # [m, Hkv, D]
    v: torch.Tensor

    def append(self, positions, k, v) -> None:
        self.positions = torch.cat([self.positions, positions])
        self.k, self.v = torch.cat([self.k, k]), torch.cat([self.v, v])


@dataclasses.dataclass(frozen=True)
class Drop:
    """At `layer`'s attention: keep `keep` (original positions), or, without it, select by the
    project's rule: blocks of `block_size` candidates scored by the last `last_queries` queries,
    a fixed `keep_ratio` of them (> 0) or the top-p blocks, plus positions below `sink_tokens`
    and the last `last_queries` candidates."""
    layer: int
    keep: Optional[Sequence[int]] = None
    block_size: int = 64
    sink_tokens: int = 128
    last_queries: int = 128
    keep_ratio: float = 0.0
    top_p: float = 1.0

    def select(self, q, q_pos, k, k_pos, scale):
        """(keep [m] bool, scores [m] or None) over the keys: every token that reached the
        layer, in position order; the scores are the attention mass the last queries pay each
        (None when the caller gave the survivors)."""
        if self.keep is not None:
            return torch.isin(k_pos, torch.as_tensor(list(self.keep), dtype=k_pos.dtype)), None
        n = min(self.last_queries, q.shape[0])
        scores = kernels.score_segment_reference(q[-n:], q_pos[-n:], k, k_pos, scale,
                                                 compute_dtype=DTYPE)
        keep = kernels.select_segment_reference(
            scores, k_pos, self.block_size, self.top_p, self.keep_ratio, self.sink_tokens,
            self.last_queries, compute_dtype=DTYPE)
        return keep, scores


def _mlp(layer: Layer, x: torch.Tensor) -> torch.Tensor:
    return (F.gelu(x @ layer.gate.T, approximate="tanh") * (x @ layer.up.T)) @ layer.down.T


@dataclasses.dataclass
class Generation:
    tokens: List[int]  # greedy, one per step (the first from the prefill)
    logits: List[torch.Tensor]  # [vocab] float64 per step
    kept: List[List[int]]  # per drop, the surviving original positions
    scores: List[Optional[torch.Tensor]]  # per drop, the candidates' scores (if it selected)
    kv: List[LayerKV]  # per layer, what it holds after the last step


class Runner:
    """One request through the reference: `prefill`, then `decode` one token at a time."""

    def __init__(self, model: Gemma3, drops: Sequence[Drop] = ()):
        self.model = model
        self.drops: Dict[int, Drop] = {d.layer: d for d in drops}
        self.kv: List[Optional[LayerKV]] = [None] * len(model.layers)
        self.kept: List[List[int]] = []
        self.scores: List[Optional[torch.Tensor]] = []

    def _layer(self, i: int, h: torch.Tensor, positions: torch.Tensor, prefill: bool):
        """One decoder layer on rows `h` at original `positions`; returns (h, positions): the
        survivors' rows and positions after a drop layer in prefill."""
        m, layer = self.model, self.model.layers[i]
        n, hd = h.shape[0], m.head_dim
        x = rms_norm(h, layer.input_norm, m.eps)
        q = rms_norm((x @ layer.q.T).view(n, m.num_heads, hd), layer.q_norm, m.eps)
        k = rms_norm((x @ layer.k.T).view(n, m.num_kv_heads, hd), layer.k_norm, m.eps)
        v = (x @ layer.v.T).view(n, m.num_kv_heads, hd)
        theta = m.rope_theta_local if layer.sliding else m.rope_theta_global
        q, k = rope(q, positions, theta), rope(k, positions, theta)
        if self.kv[i] is None:
            self.kv[i] = LayerKV(positions, k, v)
        else:
            self.kv[i].append(positions, k, v)
        kv = self.kv[i]
        mask = visible(positions, kv.positions, m.window if layer.sliding else None)
        attn = attend(q, kv.k, kv.v, mask, m.scale) @ layer.o.T
        h = h + rms_norm(attn, layer.post_attention_norm, m.eps)
        if prefill and i in self.drops:
            keep, scores = self.drops[i].select(q, positions, k, positions, m.scale)
            self.kept.append(positions[keep].tolist())
            self.scores.append(scores)
            h, positions = h[keep], positions[keep]
        h = h + rms_norm(_mlp(layer, rms_norm(h, layer.pre_feedforward_norm, m.eps)),
                         layer.post_feedforward_norm, m.eps)
        return h, positions

    def _logits(self, h_last: torch.Tensor) -> torch.Tensor:
        m = self.model
        logits = rms_norm(h_last, m.norm, m.eps) @ m.lm_head.T
        if m.final_softcap:
            logits = torch.tanh(logits / m.final_softcap) * m.final_softcap
        return logits

    def _run(self, tokens: Sequence[int], start: int, prefill: bool) -> torch.Tensor:
        m = self.model
        ids = torch.as_tensor(list(tokens), dtype=torch.int64)
        positions = torch.arange(start, start + ids.numel())
        h = m.embed[ids] * math.sqrt(m.embed.shape[1])
        for i in range(len(m.layers)):
            h, positions = self._layer(i, h, positions, prefill)
        return self._logits(h[-1])  # the last token always survives

    def prefill(self, prompt: Sequence[int]) -> torch.Tensor:
        self.length = len(prompt)
        return self._run(prompt, 0, prefill=True)

    def decode(self, token: int) -> torch.Tensor:
        logits = self._run([token], self.length, prefill=False)
        self.length += 1
        return logits


def generate(model: Gemma3, prompt: Sequence[int], drops: Sequence[Drop] = (),
             max_new_tokens: int = 1) -> Generation:
    """Greedy generation of `max_new_tokens` tokens after `prompt` under `drops`."""
    with torch.no_grad():
        runner = Runner(model, drops)
        logits = [runner.prefill(prompt)]
        tokens = [int(logits[-1].argmax())]
        while len(tokens) < max_new_tokens:
            logits.append(runner.decode(tokens[-1]))
            tokens.append(int(logits[-1].argmax()))
    return Generation(tokens, logits, runner.kept, runner.scores, runner.kv)

