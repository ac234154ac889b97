"""The GPU test modules' answer checks (tests/gpu/engine_harness.py), on fresh random records:
which differences between two greedy runs rounding explains, and the random-weight model's
stored dtype. CPU only, no engine."""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))

from engine_harness import first_unexplained_difference, within_block  # noqa: E402


def _run(rng: random.Random, steps: int) -> dict:
    """A greedy run's record: token ids and, per step, its two best log-probabilities."""
    top2 = []
    for _ in range(steps):
        best = -rng.uniform(0.5, 3.0)
        top2.append([best, best - rng.uniform(0.2, 1.0)])  # clear margins
    return {"output_ids": [rng.randrange(1000) for _ in range(steps)], "top2": top2}


def _perturbed(run: dict, rng: random.Random, noise: float) -> dict:
    """The same run as another batch composition would round it."""
    return {"output_ids": list(run["output_ids"]),
            "top2": [[v + rng.uniform(-noise, noise) for v in step] for step in run["top2"]]}


@pytest.fixture
def rng():
    return random.Random()  # fresh inputs each run


def test_agreeing_runs_have_no_difference(rng):
    a = _run(rng, 16)
    assert first_unexplained_difference(a, _perturbed(a, rng, 1e-3)) is None
    assert first_unexplained_difference(a, a) is None


def test_a_flipped_near_tie_after_rounding_is_explained(rng):
    a, step = _run(rng, 16), rng.randrange(2, 16)
    b = _perturbed(a, rng, 1e-2)
    b["top2"][0][0] = a["top2"][0][0] + 1e-2  # the rounding the two runs show
    best = a["top2"][step][0]
    a["top2"][step] = [best, best - 5e-3]  # a near tie at `step`
    b["output_ids"][step:] = [i + 1 for i in a["output_ids"][step:]]
    assert first_unexplained_difference(a, b) is None


def test_a_flip_after_differences_beyond_rounding_is_not_explained(rng):
    """Runs whose log-probabilities already differ by more than rounding can (a batch reading
    another request's KV, say) have no near tie to blame."""
    a, step = _run(rng, 16), rng.randrange(2, 16)
    b = _perturbed(a, rng, 1e-3)
    b["top2"][0][1] = a["top2"][0][1] + rng.uniform(0.6, 2.0)
    a["top2"][step] = [a["top2"][step][0], a["top2"][step][0] - 0.05]
    b["output_ids"][step] += 1
    assert first_unexplained_difference(a, b) == step


def test_a_flip_at_a_clear_margin_is_not_explained(rng):
    a, step = _run(rng, 16), rng.randrange(1, 16)
    b = _perturbed(a, rng, 1e-3)
    b["output_ids"][step] += 1
    assert first_unexplained_difference(a, b) == step


def test_a_flip_without_earlier_rounding_is_not_explained(rng):
    """Bit-identical steps before it leave a flip no rounding to blame; so does the first
    step, which has no steps before it."""
    a = _run(rng, 16)
    a["top2"][0] = [a["top2"][0][0], a["top2"][0][0] - 1e-6]
    b = json.loads(json.dumps(a))
    b["output_ids"][0] += 1
    assert first_unexplained_difference(a, b) == 0
    step = rng.randrange(1, 16)
    c = json.loads(json.dumps(a))
    a["top2"][step] = [a["top2"][step][0], a["top2"][step][0] - 1e-6]
    c["top2"][step] = list(a["top2"][step])
    c["output_ids"][step] += 1
    assert first_unexplained_difference(a, c) == step


def test_nan_never_passes(rng):
    a, step = _run(rng, 16), rng.randrange(16)
    b = _perturbed(a, rng, 1e-3)
    b["top2"][step][rng.randrange(2)] = math.nan
    assert first_unexplained_difference(a, b) == step
    assert first_unexplained_difference(b, a) == step


def test_runs_of_different_lengths_differ_where_the_shorter_ends(rng):
    a = _run(rng, 16)
    b = {"output_ids": a["output_ids"][:9], "top2": a["top2"][:9]}
    assert first_unexplained_difference(a, b) == 9


def test_kept_counts_within_a_block():
    assert within_block([3000, 928, 592], [3000, 928, 592], 16)
    assert within_block([1900, 592, 400], [1900, 592, 384], 16)
    assert not within_block([1900, 592, 417], [1900, 592, 400], 16)
    assert not within_block([1900, 592], [1900, 592, 384], 16)


def test_random_model_is_stored_in_the_dtype_asked(tmp_path):
    """gpt-oss in SGLang builds its projections in the checkpoint's dtype: the GPU modules
    store bfloat16 weights for their bfloat16 engines."""
    import safetensors.torch
    import torch

    from uniprefill_sglang.tools.model_zoo import random_model

    config = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=64,
                  hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    stored = {}
    for dtype in ("float32", "bfloat16"):
        folder = Path(random_model(tmp_path / dtype, config, seed=3, dtype=dtype))
        assert json.loads((folder / "config.json").read_text())["torch_dtype"] == dtype
        (weights,) = folder.glob("*.safetensors")
        stored[dtype] = safetensors.torch.load_file(str(weights))
        assert {t.dtype for t in stored[dtype].values()} == {getattr(torch, dtype)}
    # The same seeded weights, rounded once.
    for name, tensor in stored["float32"].items():
        assert torch.equal(tensor.to(torch.bfloat16), stored["bfloat16"][name]), name
