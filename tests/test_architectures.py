"""One integration, several model families: Qwen2 and Qwen3 (Llama is SmolLM2 elsewhere, Gemma 3
in test_gemma3.py, the mixtures of experts in test_moe_families.py); and an architecture without
an integration, served dense.

Small random-weight models (`load_format="dummy"`) built from a config.json at test time, served
by SGLang's CPU engine with the SmolLM2 tokenizer. Random weights make attention near-uniform,
so the drops are forced with a keep ratio. Within one engine the dense baseline is the same
request with UniPrefill switched off.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from uniprefill_sglang.tools.cpu_engine import make_cpu_engine

pytestmark = pytest.mark.engine

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


def _model_dir(tmp_path: Path, smollm2_path: str, architecture: str, model_type: str,
               **extra) -> str:
    folder = tmp_path / model_type
    folder.mkdir()
    for name in TOKENIZER_FILES:
        src = Path(smollm2_path) / name
        if src.exists():
            shutil.copy(src, folder / name)
    config = {
        "architectures": [architecture], "model_type": model_type, "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": 49152,
        "tie_word_embeddings": False, "torch_dtype": "float32", "hidden_act": "silu",
        "bos_token_id": 1, "eos_token_id": 2, **extra,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize("architecture, model_type", [
    ("Qwen2ForCausalLM", "qwen2"),
    ("Qwen3ForCausalLM", "qwen3"),
])
def test_family_drops_and_matches_dense_at_full_keep(tmp_path, smollm2_path, architecture,
                                                     model_type):
    path = _model_dir(tmp_path, smollm2_path, architecture, model_type)
    engine = make_cpu_engine(path, load_format="dummy", enable_uniprefill=True,
                             uniprefill_drop_layers="1,3", context_length=4096,
                             disable_radix_cache=True)  # the same prompt three times
    prompt = " ".join(f"token{i % 97} word{i % 13}." for i in range(450))
    greedy = {"temperature": 0.0, "max_new_tokens": 8}
    try:
        dense = engine.generate(prompt, dict(greedy, custom_params={"uniprefill": False}))
        full = engine.generate(prompt, dict(greedy, custom_params={"uniprefill_keep_ratio": 1.0}))
        half = engine.generate(prompt, dict(greedy, custom_params={"uniprefill_keep_ratio": 0.5}))
    finally:
        engine.shutdown()
    assert full["output_ids"] == dense["output_ids"]
    kept = half["meta_info"]["uniprefill"][0]["kept_tokens"]
    assert len(kept) == 3 and kept[0] == half["meta_info"]["prompt_tokens"]
    assert kept[2] < kept[1] < kept[0], kept
    assert len(half["output_ids"]) == greedy["max_new_tokens"]


def test_unsupported_architecture_is_served_dense_and_says_why(tmp_path, smollm2_path, capfd):
    """Phi-3 has no table entry (architectures.py): every request runs dense, says why in
    meta_info, even when it asks for a keep ratio, and the scheduler says it once at start-up."""
    path = _model_dir(tmp_path, smollm2_path, "Phi3ForCausalLM", "phi3")
    engine = make_cpu_engine(path, load_format="dummy", enable_uniprefill=True,
                             context_length=4096, disable_radix_cache=True, log_level="warning")
    prompt = " ".join(f"token{i % 97} word{i % 13}." for i in range(450))
    greedy = {"temperature": 0.0, "max_new_tokens": 8}
    try:
        dense = engine.generate(prompt, dict(greedy, custom_params={"uniprefill": False}))
        forced = engine.generate(prompt, dict(greedy, custom_params={"uniprefill_keep_ratio": 0.3}))
    finally:
        engine.shutdown()
    info = forced["meta_info"]["uniprefill"]
    assert len(info) == 1 and info[0]["enabled"] is False
    assert info[0]["reason"].startswith("unsupported architecture Phi3ForCausalLM"), info
    assert info[0]["kept_tokens"] == [forced["meta_info"]["prompt_tokens"]]
    assert forced["output_ids"] == dense["output_ids"]
    assert dense["meta_info"]["uniprefill"][0]["reason"] == "disabled by the request"
    logs = capfd.readouterr()
    assert "UniPrefill: unsupported architecture Phi3ForCausalLM" in logs.out + logs.err
