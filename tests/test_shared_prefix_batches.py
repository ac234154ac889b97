"""Many chat prompts at once with the radix cache on: a short common prefix (the chat template's
system turn), chunked prefill, and UniPrefill knobs that drop nothing, the default, and a mix.

A chunk parked at the first drop layer used to enter the radix tree: where another request had
inserted the same leading tokens first, SGLang pointed the chunk at the shared slots and the
final chunk counted them twice, which killed the scheduler at top-p 1.0 (a negative KV gap) and
silently miscounted at lower top-p. Every engine here checks the host KV lengths against the
device at each drop and decode step (UNIPREFILL_CHECK_KV_LENS), which catches such a miscount.

The second part forces UniPrefill's own code to fail (UNIPREFILL_TEST_FAULT, a test-only switch):
the engine must answer every request (dense, saying why) and keep serving.
"""

from __future__ import annotations

import os
import random

import pytest

from uniprefill_sglang.tools.cpu_engine import flush_cache, idle_state

pytestmark = pytest.mark.engine
# Every engine of this module checks the host KV lengths against the device at each drop and
# decode step; a failed check is never recovered from, so a miscount fails the test.
os.environ["UNIPREFILL_CHECK_KV_LENS"] = "1"

GREEDY = {"temperature": 0.0, "max_new_tokens": 12}
CHUNK = 512  # several prompts per prefill step, the last one of a step chunked


def _document(seed: int, sentences: int) -> str:
    rng = random.Random(seed)
    names = ["Ada", "Bruno", "Chen", "Dana", "Emil", "Farah"]
    places = ["the harbour", "the library", "a small farm", "the old mill", "the station"]
    return " ".join(f"{rng.choice(names)} walked to {rng.choice(places)} on day "
                    f"{rng.randint(1, 300)}." for _ in range(sentences))


@pytest.fixture(scope="module")
def chat_prompts(smollm2_path):
    """Eight chat prompts of about 350-1100 tokens sharing the template's system turn."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    prompts = []
    for i in range(8):
        messages = [{"role": "user", "content": _document(i, 25 + 10 * i)
                     + "\nWho walked to the library last?"}]
        prompts.append(tok.apply_chat_template(messages, tokenize=False,
                                               add_generation_prompt=True))
    return prompts


def _engine(factory, **kwargs):
    return factory(enable_uniprefill=True, chunked_prefill_size=CHUNK, max_prefill_tokens=CHUNK,
                   uniprefill_prefix_checkpoint=True, **kwargs)


def _generate(engine, prompts, knobs):
    """One call with every prompt (they are scheduled together), per-request knobs, then an
    empty radix cache so the next call starts cold again."""
    params = [{**GREEDY, "custom_params": k} for k in knobs]
    outs = engine.generate(prompts, params)
    flush_cache(engine)
    return outs


def _texts(outs):
    return [o["text"] for o in outs]


def _reasons(out):
    return [e["reason"] for e in out["meta_info"]["uniprefill"] if e["reason"] != "decode"]



def _assert_idle_without_leak(engine):
    from uniprefill_sglang.tools.server_process import idle_pool_problems

    state = idle_state(engine, timeout_s=30)
    assert idle_pool_problems(state) == [], state


@pytest.fixture(scope="module")
def baseline(module_engine_factory, chat_prompts):
    """One healthy engine (server default top-p 1.0): every batch the tests compare against."""
    engine = _engine(module_engine_factory, uniprefill_top_p=1.0)
    n = len(chat_prompts)
    runs = {
        "dense": _generate(engine, chat_prompts, [{"uniprefill": False}] * n),
        "top_p_one": _generate(engine, chat_prompts, [{}] * n),
        "keep_all": _generate(engine, chat_prompts, [{"uniprefill_keep_ratio": 1.0}] * n),
        "mixed": _generate(engine, chat_prompts, MIXED_KNOBS),
        "keep_half": _generate(engine, chat_prompts[:4], [KEEP_HALF] * 4),
    }
    _assert_idle_without_leak(engine)
    module_engine_factory.shutdown_all()
    return runs


MIXED_KNOBS = [{"uniprefill_top_p": 0.9}, {"uniprefill": False}, {},
               {"uniprefill_keep_ratio": [0.5, 0.8]}, {"uniprefill_keep_ratio": 1.0},
               {"uniprefill_top_p": 0.99}, {}, {"uniprefill": False}]
DROPS_NOTHING = ({}, {"uniprefill": False}, {"uniprefill_keep_ratio": 1.0})
KEEP_HALF = {"uniprefill_keep_ratio": 0.5}


def test_shared_prefix_batches_with_every_knob(baseline, chat_prompts):
    dense = _texts(baseline["dense"])
    assert dense.count(dense[0]) < len(dense), "the prompts should not all get one answer"
    # Nothing dropped: token-identical to dense (the common prefix is inside the sinks).
    assert _texts(baseline["top_p_one"]) == dense
    assert _texts(baseline["keep_all"]) == dense
    for i, knob in enumerate(MIXED_KNOBS):
        if knob in DROPS_NOTHING:
            assert baseline["mixed"][i]["text"] == dense[i], (i, knob)
    # The knobs that drop did drop.
    kept = [o["meta_info"]["uniprefill"][-1]["kept_tokens"]
            for o, k in zip(baseline["mixed"], MIXED_KNOBS) if k not in DROPS_NOTHING]
    assert any(k[-1] < k[0] for k in kept), kept
    # Some requests reused the cached system turn; some were chunked and their parked chunks
    # rejoined (the final step scored more tokens than one chunk holds).
    outs = baseline["top_p_one"] + baseline["mixed"]
    assert any(o["meta_info"]["cached_tokens"] > 0 for o in outs)
    assert any(o["meta_info"]["uniprefill"][-1]["kept_tokens"][0] > CHUNK for o in outs)


@pytest.mark.parametrize("fault", ["drop", "kv_gaps"])
def test_a_fault_in_uniprefill_never_fails_a_request(engine_factory, baseline, chat_prompts,
                                                     monkeypatch, fault):
    """'drop': every drop raises; the forward runs again dense and each request says why.
    'kv_gaps': every extend records inconsistent host KV gaps; they are never used but read
    back from the device, so the outputs are those of a healthy engine."""
    monkeypatch.setenv("UNIPREFILL_TEST_FAULT", fault)
    prompts = chat_prompts[:4]
    engine = _engine(engine_factory, uniprefill_top_p=1.0)
    outs = _generate(engine, prompts, [KEEP_HALF] * len(prompts))
    after = engine.generate(prompts[0], {**GREEDY, "custom_params": KEEP_HALF})  # still serving
    want_dense = _texts(baseline["dense"][:4])
    # The next request is answered as usual (alone, it may be chunked elsewhere than in the
    # batch, so its tokens are not compared with the batch's).
    assert after["meta_info"]["finish_reason"]["type"] in ("length", "stop"), after["meta_info"]
    assert len(after["output_ids"]) > 0
    if fault == "drop":
        assert _texts(outs) == want_dense
        for out in outs + [after]:
            assert any("UniPrefill error, re-prefilled dense: UniPrefillError" in (r or "")
                       for r in _reasons(out)), out["meta_info"]["uniprefill"]
    else:
        want = _texts(baseline["keep_half"])
        assert want != want_dense, "keep 0.5 should change some answer of the healthy engine"
        assert _texts(outs) == want
        kept = after["meta_info"]["uniprefill"][-1]["kept_tokens"]
        assert kept[-1] < kept[0], kept
    _assert_idle_without_leak(engine)
