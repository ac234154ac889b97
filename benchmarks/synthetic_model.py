"""A model folder for `--load-format dummy` serving benchmarks: a config and a word-level tokenizer.

`sglang.launch_server` and `sglang.bench_serving` both load a tokenizer, while the shipped
config folders (benchmarks/models/*) hold only `config.json`. This writes, next to a copy of the
config, a tokenizer whose token i is the word `t{i}` (so any id sequence round-trips exactly);
the weights stay random (`--load-format dummy`), nothing is downloaded.

    python benchmarks/synthetic_model.py benchmarks/models/llama-3.1-8b /tmp/llama-3.1-8b
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def write_wordlevel_tokenizer(folder: Path, vocab_size: int, max_length: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)},
                                     unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    special = {"unk_token": "t0", "bos_token": "t1", "eos_token": "t2", "pad_token": "t0"}
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
         **special}))
    (folder / "special_tokens_map.json").write_text(json.dumps(special))


def prepare(config_dir: str, out_dir: str) -> str:
    """Copy `config_dir/config.json` to `out_dir` and give it a tokenizer; returns out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(config_dir) / "config.json", out / "config.json")
    cfg = json.loads((out / "config.json").read_text())
    if not (out / "tokenizer.json").exists():
        write_wordlevel_tokenizer(out, cfg["vocab_size"], cfg.get("max_position_embeddings", 4096))
    return str(out)


if __name__ == "__main__":
    print(prepare(sys.argv[1], sys.argv[2]))
