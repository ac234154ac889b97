"""The soak on the CPU: `benchmarks/soak.py` against a real `launch_server --enable-uniprefill`.

One server (SGLang's CPU engine, SmolLM2-135M-Instruct, 127.0.0.1 and a free port, chunked
prefill 512, 8 running requests, `SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY=1`) takes 120
requests from 16 clients: mostly short prompts that run dense, a few long ones that drop, three
chunked, six sharing a 400-token document through the radix cache, UniPrefill on/off and
per-request top-p or keep ratios, streams closed mid-way, aborts before the first token and in
decode. Then: no failed request, every pool back to idle (ours and SGLang's checks), nothing
parked, and each greedy request that reused no cached prefix gives the same output token ids
when replayed alone after a cache flush (the rule is in the soak's docstring). The soak stops
its server's process group at the end, also when it fails. About 2-3 minutes on 2 idle cores;
the plan is seeded, so the counts below hold run after run (what depends on timing, such as an
abort landing after the answer, is bounded loosely).
"""

from __future__ import annotations

import pytest

from benchmark_script import load_benchmark


def soak_run(test):
    """A test of the soak's result: it starts a server (minutes), so CI runs it extended."""
    return pytest.mark.engine(pytest.mark.extended(test))


@pytest.fixture(scope="module")
def result(smollm2_path, tmp_path_factory):
    from conftest import USE_CPU_ENGINE

    if not USE_CPU_ENGINE:
        pytest.skip("the CPU soak needs a machine without CUDA (or UNIPREFILL_CPU_ENGINE=1)")
    soak = load_benchmark("soak")
    log_dir = tmp_path_factory.mktemp("soak")
    args, extra = soak.parse_args(["--cpu", "--model-path", smollm2_path,
                                   "--log-dir", str(log_dir)])
    res = soak.soak(args, extra)
    soak.print_table(res)
    return res


@soak_run
def test_no_request_failed(result):
    s = result["summary"]
    assert s["failures"] == 0, result["failures"][:10]
    assert s["served"] + s["aborted"] + s["disconnected"] == s["requests"], s


@soak_run
def test_the_traffic_had_every_ingredient(result):
    """A soak that dropped nothing, aborted nothing or never chunked would prove little."""
    s, cfg = result["summary"], result["config"]
    assert s["dropped"] >= 4 and s["dense"] >= 80, s
    assert s["aborted"] + s["abort_too_late"] == 6 and s["aborted"] >= 3, s
    assert s["aborted_in_decode"] >= 2, s
    assert s["disconnected"] >= 2 and s["streamed"] >= 20, s
    assert s["cached_prefix"] >= 1, s  # the shared document was reused
    chunked = [r["prompt_tokens"] for r in result["requests"] if r["kind"] == "chunked"]
    assert len(chunked) == 3 and min(chunked) > cfg["chunked_prefill_size"], chunked
    assert cfg["concurrency"] > cfg["max_running_requests"], cfg


@soak_run
def test_pools_back_to_idle_nothing_parked(result):
    assert result["problems"] == [], result["problems"]
    assert result["summary"]["leaked_slots"] == 0
    for when in ("after_traffic", "after_replay"):
        state = result["pools"][when]["state"]
        assert state["idle"] and state["protected_kv_tokens"] == 0, state
        assert state["available_kv_tokens"] + state["evictable_kv_tokens"] == (
            state["max_total_num_tokens"]), state
        assert state["free_req_slots"] == state["req_slots"], state
        assert state["parked_requests"] == 0, state
        flushed = result["pools"][when]["after_flush"]
        assert flushed["available_kv_tokens"] == flushed["max_total_num_tokens"], flushed


@soak_run
def test_replay_alone_gives_the_same_outputs(result):
    replay = result["replay"]
    assert replay["errors"] == [], replay["errors"][:5]
    assert replay["not_replayed_time_limit"] == 0, replay
    assert replay["replayed"] == replay["comparable"] >= 70, replay
    assert replay["mismatches"] == [], replay["mismatches"][:3]
    assert replay["drop_mismatches"] == [], replay["drop_mismatches"][:3]
    # Requests that dropped tokens are among those compared, so the comparison covers the drop.
    assert replay["replayed_dropped"] >= 3, replay


def test_a_server_that_stopped_answering_is_a_recorded_problem():
    """The checks of a server that is gone return a problem (written to the result file), not
    an exception that loses the soak's figures."""
    from uniprefill_sglang.tools.server_process import free_port

    soak = load_benchmark("soak")
    checks = soak.check_server(f"http://127.0.0.1:{free_port()}", None, idle_timeout_s=2.0)
    assert checks["unreachable"] and checks["problems"][0].startswith("server unreachable"), checks
