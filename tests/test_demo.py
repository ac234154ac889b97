"""The README's demo, run as printed but on a short prompt: SmolLM2 on the CPU engine, one
request each way (one engine start-up)."""

from __future__ import annotations

import pytest

from uniprefill_sglang.tools import demo

pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(demo._has_cuda(), reason="the demo serves on the GPU here")]


def test_demo_serves_dense_and_uniprefill(smollm2_path, capsys):
    # No --model-path: the SmolLM2 conversion the fixture cached is the demo's default model.
    result = demo.main(["--tokens", "600", "--repeats", "1"])
    report = capsys.readouterr().out

    assert result["model_path"] == smollm2_path
    kept = result["uniprefill"]["kept_tokens"]
    # The tokens scored, then the rows left after each drop layer.
    assert kept[0] == result["prompt_tokens"] and len(kept) >= 2, result["uniprefill"]
    assert all(0 < after <= before for before, after in zip(kept, kept[1:])), kept
    assert set(result["answers"]) == {"dense", "UniPrefill"}
    assert all(answer for answer in result["answers"].values()), result["answers"]
    assert "device:   CPU (SGLang CPU engine)" in report
    assert "UniPrefill tokens kept per stage:" in report and "TTFT dense / UniPrefill" in report
