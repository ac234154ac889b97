"""Fidelity: UniPrefill (top-p 0.99) agrees with dense SmolLM2 on retrieval cases dense solves.

Pass-key and key-value lookup prompts of 1K-4K tokens (uniprefill_sglang/tools/tasks.py,
generated locally and deterministically) on a reporting seed, one calibration never sees
(`tasks.REPORTING_SEEDS`), greedy decoding, SGLang's CPU engine. Dense is the same engine with
UniPrefill off per request, so that both answers come from one set of weights and kernels; each
side's cases run as one batch. The agreement and the keep ratio realised are printed and
written to `$UNIPREFILL_RESULTS_DIR/fidelity.json` if set.
"""

from __future__ import annotations

import json
import os

import pytest

from uniprefill_sglang.tools.cpu_engine import flush_cache, make_cpu_engine

pytestmark = [pytest.mark.engine, pytest.mark.extended]

LENGTHS = (1024, 2048, 4096)
DEPTHS = (0.1, 0.9)
GREEDY = {"temperature": 0.0, "max_new_tokens": 12}
MIN_DENSE_CORRECT = 6  # fewer and the agreement figure means nothing


@pytest.fixture(scope="module")
def cases(smollm2_path):
    from transformers import AutoTokenizer

    from uniprefill_sglang.tools.tasks import REPORTING_SEEDS, RETRIEVAL_TASKS, make_cases

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    return make_cases(tokenizer, tasks=RETRIEVAL_TASKS, lengths=LENGTHS, depths=DEPTHS,
                      seeds=REPORTING_SEEDS[:1],
                      fmt=os.environ.get("UNIPREFILL_FIDELITY_FORMAT", "chat"))


def test_uniprefill_agrees_with_dense_on_retrieval(smollm2_path, cases):
    engine = make_cpu_engine(smollm2_path, enable_uniprefill=True, uniprefill_top_p=0.99)
    try:
        def answers(custom):
            return engine.generate(input_ids=[c.input_ids for c in cases],
                                   sampling_params=[dict(GREEDY, custom_params=custom)] * len(cases))

        dense = answers({"uniprefill": False})
        flush_cache(engine)  # UniPrefill scores every prompt afresh
        sparse = answers({})
    finally:
        engine.shutdown()
    assert all(d["meta_info"]["uniprefill"][0]["reason"] == "disabled by the request"
               for d in dense)

    solved = [i for i, (c, d) in enumerate(zip(cases, dense)) if c.check(d["text"])]
    agree = [i for i in solved if cases[i].check(sparse[i]["text"])]
    kept = [sparse[i]["meta_info"]["uniprefill"][-1]["kept_tokens"] for i in range(len(cases))]
    final_ratio = sum(k[-1] for k in kept) / sum(k[0] for k in kept)
    per_stage = [sum(k[s] for k in kept) / sum(k[0] for k in kept) for s in range(len(kept[0]))]
    report = {
        "cases": len(cases), "dense_correct": len(solved), "uniprefill_agrees": len(agree),
        "agreement": len(agree) / max(1, len(solved)),
        "uniprefill_correct": sum(c.check(s["text"]) for c, s in zip(cases, sparse)),
        "kept_fraction_per_stage": per_stage, "kept_fraction_final": final_ratio,
        "per_case": [
            {"case": c.name, "tokens": c.n_tokens, "dense": d["text"], "uniprefill": s["text"],
             "dense_ok": c.check(d["text"]), "uniprefill_ok": c.check(s["text"]), "kept": k}
            for c, d, s, k in zip(cases, dense, sparse, kept)
        ],
    }
    print(json.dumps({k: v for k, v in report.items() if k != "per_case"}, indent=1))
    out_dir = os.environ.get("UNIPREFILL_RESULTS_DIR")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "fidelity.json"), "w") as f:
            json.dump(report, f, indent=1)

    assert len(solved) >= MIN_DENSE_CORRECT, report["per_case"]
    assert report["agreement"] >= 0.9, report
    assert final_ratio < 1.0  # top-p actually dropped tokens on these prompts
