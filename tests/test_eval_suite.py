"""The long-context evaluation suite: deterministic cases, and a ~2-minute end-to-end smoke run.

The smoke run is `benchmarks/eval_suite.py` itself (its `main`) on SGLang's CPU engine with
SmolLM2-135M-Instruct: one engine, four short cases, dense and UniPrefill (top-p 0.99) each.
"""

from __future__ import annotations

import json

import pytest

from uniprefill_sglang.tools.tasks import TASKS, fingerprint, make_case, make_cases

from benchmark_script import load_benchmark


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def test_cases_are_deterministic_and_fit_their_budget(tokenizer):
    grid = dict(tasks=TASKS, lengths=(700, 1500), depths=(0.1, 0.9), seeds=(0, 1))
    a, b = make_cases(tokenizer, **grid), make_cases(tokenizer, **grid)
    assert fingerprint(a) == fingerprint(b)
    assert [c.input_ids for c in a] == [c.input_ids for c in b]
    assert len(a) == len(TASKS) * 2 * 2 * 2
    for c in a:
        assert c.n_tokens <= c.target_tokens
        assert c.n_tokens > 0.9 * c.target_tokens, (c.name, c.n_tokens)  # the budget is used
        for ans in c.answers:
            assert ans in c.prompt  # every answer is in the context ...
        assert c.check(" " + ", ".join(c.answers) + ".")  # ... and the checker accepts it
        assert not c.check(" I do not know.")
    # The seed changes the needle; the depth moves it (same needle, other place).
    s0 = make_case(tokenizer, "niah_number", 1024, 0.5, seed=0)
    s1 = make_case(tokenizer, "niah_number", 1024, 0.5, seed=1)
    assert s0.answers != s1.answers
    early = make_case(tokenizer, "niah_number", 1024, 0.1, seed=0)
    late = make_case(tokenizer, "niah_number", 1024, 0.9, seed=0)
    assert early.answers == late.answers
    assert early.prompt.index(early.answers[0]) < 0.3 * len(early.prompt)
    assert late.prompt.index(late.answers[0]) > 0.7 * len(late.prompt)


def test_checker_matches_whole_answers_only(tokenizer):
    c = make_case(tokenizer, "niah_multivalue", 800, 0.5)
    assert len(c.answers) == 4
    partial = " " + ", ".join(c.answers[:3])
    assert not c.check(partial) and c.recall(partial) == 0.75
    n = make_case(tokenizer, "niah_number", 800, 0.5)
    assert not n.check(" " + n.answers[0] + "1")  # a longer number is not the answer


@pytest.mark.engine
@pytest.mark.extended  # offline tooling end to end; its parts are tested above
def test_suite_end_to_end_on_the_cpu_engine(tmp_path, tokenizer):
    suite = load_benchmark("eval_suite")
    out = tmp_path / "smoke.json"
    result = suite.main(["--tasks", "niah_number,qa", "--lengths", "640,2048", "--depths", "0.5",
                         "--sweep", "default", "--out", str(out), "--no-progress"])
    # JSON written and complete.
    data = json.loads(out.read_text())
    assert data["meta"]["n_cases"] == 4 and len(data["cases"]) == 4
    assert data["meta"]["case_fingerprint"] == fingerprint(
        make_cases(tokenizer, ["niah_number", "qa"], [640, 2048], [0.5]))
    assert data["summary"] == json.loads(json.dumps(result["summary"]))
    # Per case: dense and UniPrefill both ran, on the full prompt (no radix-cache reuse).
    for row in data["cases"]:
        dense, up = row["dense"], row["runs"]["uniprefill"]
        assert dense["prompt_tokens"] == up["prompt_tokens"] == row["n_tokens"]
        assert dense["cached_tokens"] == 0 and up["cached_tokens"] == 0
        assert dense["enabled"] is False and dense["reason"] == "disabled by the request"
        assert up["enabled"] is True and up["reason"] is None
        assert up["kept_tokens"][0] == row["n_tokens"] and dense["kept_tokens"] == [row["n_tokens"]]
        assert dense["ttft_s"] > 0 and up["ttft_s"] > 0 and dense["e2e_s"] >= dense["ttft_s"]
    # The summary agrees with the per-case records.
    cells = data["summary"]["uniprefill"]
    overall = cells["all"]["all"]
    assert overall["n"] == 4
    assert overall["dense_correct"] == sum(r["dense"]["correct"] for r in data["cases"])
    assert overall["uniprefill_correct"] == sum(r["runs"]["uniprefill"]["correct"]
                                                for r in data["cases"])
    assert overall["dense_acc"] == overall["dense_correct"] / 4
    agree = sum(r["runs"]["uniprefill"]["correct"] for r in data["cases"] if r["dense"]["correct"])
    assert overall["agree"] == agree
    if overall["dense_correct"]:
        assert overall["agreement"] == agree / overall["dense_correct"]
    # SmolLM2 finds a 640-token needle dense (the check is real, not vacuous).
    assert cells["niah_number"]["640"]["dense_correct"] == 1
    # On the 2K-token prompts the engine's schedule (SmolLM2's shipped profile) really drops
    # tokens, at every drop layer, monotonically over the stages.
    from uniprefill_sglang.config import find_shipped_profile

    schedule = find_shipped_profile(["LlamaForCausalLM"], 30, 576)
    assert schedule is not None
    for task in ("niah_number", "qa"):
        kept = cells[task]["2048"]["kept_ratio_per_stage"]
        assert len(kept) == len(schedule.drop_layers) and kept[-1] < 1.0, kept
        assert all(x >= y for x, y in zip(kept, kept[1:])), kept
    # The heat map is a real, small PNG.
    png = out.with_suffix(".png")
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert 5_000 < png.stat().st_size < 200_000
    assert data["meta"]["pngs"] == [str(png)]


def test_sweep_values_replace_a_sweeps_own():
    suite = load_benchmark("eval_suite")
    assert [c["value"] for c in suite.configs_for("top_p")] == list(suite.SWEEP_VALUES["top_p"])
    per_drop = suite.configs_for("top_p", "0.975;0.94,0.995")
    assert [c["custom"] for c in per_drop] == [{"uniprefill_top_p": 0.975},
                                               {"uniprefill_top_p": "0.94,0.995"}]
    assert [c["name"] for c in per_drop] == ["top_p=0.975", "top_p=0.94,0.995"]
    window = suite.configs_for("last_queries", "32;64")
    assert [c["engine"] for c in window] == [{"uniprefill_last_queries": 32},
                                             {"uniprefill_last_queries": 64}]


def test_custom_configurations_are_the_request_knobs_they_send():
    suite = load_benchmark("eval_suite")
    configs = suite.configs_for("custom", '{"uniprefill_block_sparse_top_p": 0.9, '
                                          '"uniprefill_keep_ratio": 1.0};'
                                          ' {"uniprefill_block_sparse_top_p": 0.95};')
    assert [c["custom"] for c in configs] == [
        {"uniprefill_block_sparse_top_p": 0.9, "uniprefill_keep_ratio": 1.0},
        {"uniprefill_block_sparse_top_p": 0.95}]
    assert [c["name"] for c in configs] == ["block_sparse_top_p=0.9,keep_ratio=1.0",
                                            "block_sparse_top_p=0.95"]
    assert all(c["engine"] == {} and c["param"] == "custom" for c in configs)
    # Checked as the server checks them: a typo or a value out of range fails before the run.
    with pytest.raises(ValueError, match="unknown UniPrefill knob"):
        suite.configs_for("custom", '{"uniprefill_block_sparse_topp": 0.9}')
    with pytest.raises(ValueError, match="mutually exclusive"):
        suite.configs_for("custom", '{"uniprefill_block_sparse_top_p": 0.9, '
                                    '"uniprefill_block_sparse_density": 0.1}')
    with pytest.raises(ValueError, match="non-empty JSON object"):
        suite.configs_for("custom", "0.9")


def test_block_sparse_density_is_recorded_and_averaged():
    suite = load_benchmark("eval_suite")
    chunk = {"text": " 42", "meta_info": {"prompt_tokens": 9, "uniprefill": [
        {"enabled": True, "reason": None, "kept_tokens": [9, 9], "dropped_mass": [0.0],
         "block_sparse_density": 0.25}]}}
    assert suite._result(chunk, 0.1, 0.2)["block_sparse_density"] == 0.25
    dense = {"correct": True, "recall": 1.0, "ttft_s": 1.0, "score": 1.0, "bench_correct": True}

    def run(density):
        return {"correct": True, "recall": 1.0, "ttft_s": 0.5, "score": 1.0,
                "bench_correct": True, "kept_tokens": [100, 100], "reason": None,
                "enabled": True, "block_sparse_density": density}

    rows = [{"task": "t", "target_tokens": 100, "n_tokens": 100, "dense": dense,
             "runs": {"a": run(d), "b": run(None)}} for d in (0.2, 0.4)]
    configs = [{"name": "a"}, {"name": "b"}]
    summary = suite.summarize(rows, configs)
    assert summary["a"]["all"]["all"]["block_sparse_density"] == pytest.approx(0.3)
    assert summary["a"]["all"]["all"]["block_sparse_n"] == 2
    assert summary["b"]["all"]["all"]["block_sparse_density"] is None
    table = suite.sweep_markdown(summary, configs, "benchmark").splitlines()
    assert table[0].endswith("block-sparse density |")
    assert table[2].endswith("| 0.300 |") and table[3].endswith("| - |")


def test_dense_answers_are_reused_only_for_the_same_cases_run_whole(tmp_path, tokenizer):
    suite = load_benchmark("eval_suite")
    cases = make_cases(tokenizer, ["niah_number", "niah_multikey"], [700], [0.5], [0, 1])
    rows = [{"name": c.name, "n_tokens": c.n_tokens, "answers": list(c.answers),
             "dense": {"text": f"dense {k}", "prompt_tokens": c.n_tokens}}
            for k, c in enumerate(cases)]
    rows[1]["n_tokens"] += 1  # another prompt under the same name (tokenizer or generator moved)
    rows[2]["answers"] = ["0"]  # another needle
    rows[3]["dense"] = {"text": "", "prompt_tokens": 1}  # refused by an engine with less room
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"meta": {"model": "/a/m"}, "cases": rows}))
    assert suite.reusable_dense([str(earlier)], cases, "/b/m") == {cases[0].name: rows[0]["dense"]}
    assert suite.reusable_dense([str(earlier)], cases[1:], "m") == {}
    with pytest.raises(ValueError, match="a result of /a/m, not of other"):
        suite.reusable_dense([str(earlier)], cases, "other")
    # A second file fills in what the first lacks; the first holding a case wins.
    fixed = [{**rows[0], "dense": {"text": "other", "prompt_tokens": cases[0].n_tokens}},
             {**rows[3], "dense": {"text": "dense 3", "prompt_tokens": cases[3].n_tokens}}]
    later = tmp_path / "later.json"
    later.write_text(json.dumps({"meta": {"model": "m"}, "cases": fixed}))
    assert suite.reusable_dense([str(earlier), str(later)], cases, "m") == {
        cases[0].name: rows[0]["dense"], cases[3].name: fixed[1]["dense"]}


def test_an_aborted_request_fails_the_run_instead_of_counting_as_wrong():
    suite = load_benchmark("eval_suite")
    done = {"text": " 42", "meta_info": {"prompt_tokens": 9, "finish_reason": {"type": "stop"}}}
    assert suite._result(done, 0.1, 0.2)["text"] == " 42"
    refused = {"text": "", "meta_info": {"prompt_tokens": 1, "finish_reason": {
        "type": "abort", "message": "Input length (7599 tokens) exceeds the maximum allowed "
                                    "length (7231 tokens)."}}}
    with pytest.raises(RuntimeError, match="exceeds the maximum allowed length"):
        suite._result(refused, 0.1, 0.2)
