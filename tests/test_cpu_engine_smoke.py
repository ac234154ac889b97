"""Stock SGLang (no UniPrefill) on the CPU engine with the real SmolLM2-135M-Instruct.

Checks the test infrastructure itself: greedy generation, a ~2K-token prompt, radix-cache reuse
and chunked prefill. Two engine start-ups: the default one (one prefill step per prompt) and
one with ``chunked_prefill_size=256``.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.engine

GREEDY = {"temperature": 0.0, "max_new_tokens": 16}


def _long_text(n_sentences: int, seed: int = 0) -> str:
    import random

    rng = random.Random(seed)
    subjects = ["The cat", "A farmer", "My neighbour", "The old clock", "A red bus", "The river"]
    verbs = ["watched", "carried", "painted", "forgot", "followed", "repaired"]
    objects = ["the fence", "a letter", "the garden", "an umbrella", "the bridge", "a song"]
    return " ".join(
        f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}."
        for _ in range(n_sentences)
    )


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def _ids_of_length(tokenizer, n_tokens: int, seed: int) -> list[int]:
    ids = tokenizer(_long_text(n_tokens // 4 + 16, seed), add_special_tokens=False)["input_ids"]
    assert len(ids) >= n_tokens
    return ids[:n_tokens]


@pytest.fixture(scope="module")
def prompt_1k(tokenizer):
    return _ids_of_length(tokenizer, 1024, seed=1)


@pytest.fixture(scope="module")
def dense(module_engine_factory):
    """Default CPU engine: chunked_prefill_size=8192 (no chunking), radix cache on."""
    return module_engine_factory()


def test_short_greedy_generation(dense):
    out = dense.generate("The capital of France is", GREEDY)
    assert out["meta_info"]["completion_tokens"] == 16
    assert "Paris" in out["text"], out["text"]
    again = dense.generate("The capital of France is", GREEDY)
    assert again["output_ids"] == out["output_ids"]


def test_2k_prompt(dense, tokenizer):
    prompt = _long_text(315, seed=2) + "\n\nWhich vehicle is red?"
    n = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert 1800 <= n <= 2300, n
    out = dense.generate(prompt, dict(GREEDY, ignore_eos=True))  # EOS may come first here
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == n
    assert meta["completion_tokens"] == 16
    assert out["text"].strip()


def test_radix_cache_reuse(dense, tokenizer):
    ids = _ids_of_length(tokenizer, 600, seed=3)
    first = dense.generate(input_ids=ids, sampling_params=GREEDY)
    second = dense.generate(input_ids=ids, sampling_params=GREEDY)
    assert first["meta_info"]["cached_tokens"] == 0
    # The whole prompt but its last token comes from the radix cache.
    assert second["meta_info"]["cached_tokens"] >= len(ids) - 1 > 0
    assert second["output_ids"] == first["output_ids"]


@pytest.fixture(scope="module")
def unchunked_1k(dense, prompt_1k):
    dense.flush_cache()
    out = dense.generate(input_ids=prompt_1k, sampling_params=GREEDY)
    assert out["meta_info"]["cached_tokens"] == 0
    return out


def test_chunked_prefill_matches_unchunked(unchunked_1k, prompt_1k, module_engine_factory, dense):
    # Shut the default engine down first: engines of this module must not overlap.
    module_engine_factory.shutdown_all()
    chunked = module_engine_factory(chunked_prefill_size=256)
    out = chunked.generate(input_ids=prompt_1k, sampling_params=GREEDY)
    assert out["meta_info"]["prompt_tokens"] == len(prompt_1k)
    assert out["meta_info"]["cached_tokens"] == 0
    assert out["output_ids"] == unchunked_1k["output_ids"], (out["text"], unchunked_1k["text"])
