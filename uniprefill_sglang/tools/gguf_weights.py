"""A GGUF file's weights as a Hugging Face state dict, read with `gguf` alone.

transformers can load a GGUF, but how it does so moves between releases: 5.12 dequantises it
into a plain model, 5.19 wants `accelerate` for any GGUF load and keeps the GGUF quantization on
the loaded model, which then refuses `save_pretrained`. The model zoo needs only the
dequantised tensors under Hugging Face names, so it reads them here: `gguf.GGUFReader` for the
tensors, `gguf.quants.dequantize` for their values (exact in float32: every quant type stores
fp16 scales and small integers), and two facts of llama.cpp's converter undone:

* Llama-family Q and K projections are stored with their rows permuted, each head's two RoPE
  halves interleaved (llama.cpp's kernels rotate adjacent pairs, Hugging Face's rotate halves):
  `unpermute_rope_rows` puts them back.
* Gemma's RMSNorm multiplies by (1 + w) and llama.cpp stores 1 + w: the norms get 1 subtracted.

`NAMES` maps the per-layer GGUF names of the two families the zoo converts; tensors with no
Hugging Face counterpart (llama.cpp's precomputed `rope_freqs`) are skipped, and an unknown
name is an error rather than a silently missing weight.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

# GGUF tensor name (per layer: `blk.{i}.` + key) -> Hugging Face name (per layer: `model.layers.{i}.` + value).
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Where the families name the norms around the MLP differently.
FFN_NORMS = {
    "llama": {"ffn_norm": "post_attention_layernorm"},
    # Gemma 3 normalises before and after each sublayer.
    "gemma3": {"post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}
# The Hugging Face class of each GGUF architecture (config.json's `architectures`).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "gemma3": "Gemma3ForCausalLM"}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                "output": "lm_head"}
SKIPPED = {"rope_freqs"}
_LAYER = re.compile(r"^blk\.(\d+)\.(.+)\.(weight|bias)$")
_GLOBAL = re.compile(r"^(.+)\.(weight|bias)$")


def hf_name(gguf_name: str, arch: str) -> str | None:
    """The Hugging Face name of a GGUF tensor of `arch` (None: no counterpart, skip it)."""
    layer_names = {**LAYER_NAMES, **FFN_NORMS[arch]}
    if m := _LAYER.match(gguf_name):
        index, key, kind = m.groups()
        if key in SKIPPED:
            return None
        if key not in layer_names:
            raise KeyError(f"GGUF tensor {gguf_name!r} of {arch}: no Hugging Face name known")
        return f"model.layers.{index}.{layer_names[key]}.{kind}"
    m = _GLOBAL.match(gguf_name)
    if m and m.group(1) in SKIPPED:
        return None
    if m and m.group(1) in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise KeyError(f"GGUF tensor {gguf_name!r} of {arch}: no Hugging Face name known")


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's row order of a Q or K projection ([n_heads * head_dim, hidden]): within
    each head it stores the rows as pairs (i, i + head_dim/2); Hugging Face keeps the halves."""
    rows = weight.shape[0]
    half = rows // n_heads // 2
    return (weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2)
            .reshape(weight.shape))


def permute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's order from Hugging Face's (the inverse of `unpermute_rope_rows`)."""
    rows = weight.shape[0]
    half = rows // n_heads // 2
    return (weight.reshape(n_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2)
            .reshape(weight.shape))


def metadata(reader, key: str):
    """One scalar or string field of the GGUF header (None if absent)."""
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.parts[field.data[0]]
    if field.types and field.types[0].name == "STRING":
        return bytes(value).decode("utf-8")
    return value.item() if value.size == 1 else value.tolist()


def read_state_dict(gguf_path: str | Path) -> tuple[str, dict[str, np.ndarray]]:
    """(`general.architecture`, {Hugging Face name: float32 array}) of a GGUF file."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    arch = metadata(reader, "general.architecture")
    if arch not in FFN_NORMS:
        raise ValueError(f"{gguf_path}: GGUF architecture {arch!r}; the zoo converts "
                         f"{sorted(FFN_NORMS)}")
    n_heads = metadata(reader, f"{arch}.attention.head_count")
    n_kv_heads = metadata(reader, f"{arch}.attention.head_count_kv") or n_heads
    tensors = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name, arch)
        if name is None:
            continue
        # `shape` is GGML's order (fastest axis first); numpy's is the reverse.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        values = np.ascontiguousarray(values, dtype=np.float32).reshape(shape)
        if arch == "llama" and name.endswith("q_proj.weight"):
            values = unpermute_rope_rows(values, n_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            values = unpermute_rope_rows(values, n_kv_heads)
        elif arch == "gemma3" and "norm" in name:
            values = values - np.float32(1.0)
        tensors[name] = values
    return arch, tensors


def write_safetensors(tensors: dict[str, np.ndarray], folder: str | Path, dtype) -> None:
    """`model.safetensors` in `folder`, each tensor cast to the torch `dtype`."""
    import torch
    from safetensors.torch import save_file

    save_file({name: torch.from_numpy(values).to(dtype).contiguous()
               for name, values in tensors.items()},
              str(Path(folder) / "model.safetensors"), metadata={"format": "pt"})
