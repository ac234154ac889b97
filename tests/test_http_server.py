"""UniPrefill behind the real HTTP server: `python -m sglang.launch_server --enable-uniprefill`.

One server for the module (SGLang's CPU engine, SmolLM2-135M-Instruct, a free port on
127.0.0.1, `--enable-metrics`), stopped at the end by killing its process group. The tests talk
to it over HTTP as a client would:

* `/generate`, `/v1/completions` and `/v1/chat/completions`, streaming and not, with the
  per-request knobs in `sampling_params.custom_params` (`/generate`) or the body's
  `custom_params` (OpenAI; the Python client's `extra_body={"custom_params": ...}`). Prompts are
  about 1.1K tokens, above the 256-token minimum for a drop, and each is sent once per radix-cache
  state, so every long request really prefills (a cached prompt would only extend one token).
* What the client can read about the drop: `meta_info["uniprefill"]` on `/generate` (streamed and
  not) and on non-streaming chat completions with `return_meta_info: true` (SGLang copies the
  whole `meta_info` into the choice). SGLang gives `/v1/completions` and streamed chat no
  `meta_info` at all; there the drop is seen through the server's counters
  (`/get_server_info` -> `internal_states[0]["uniprefill"]`).
* A bad knob is refused with HTTP 400 naming it, on every path, as SGLang refuses a bad
  `top_p`; streamed `/generate` is the exception SGLang makes for its own parameters too (the
  stream has started: status 200, one error event with code 400), checked side by side.
* Prometheus (`/metrics`): requests by UniPrefill outcome and the kept fraction's histogram.
* At the end the KV pools are back to idle size and nothing is parked.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import pytest
import requests

from uniprefill_sglang.metrics import KEPT_FRACTION_BUCKETS
from uniprefill_sglang.tools.server_process import (
    ServerProcess,
    free_port,
    idle_pool_problems,
    run_cpu_env,
    server_command,
)

pytestmark = pytest.mark.engine

REPO_ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 420
META = "uniprefill"
GREEDY = {"temperature": 0.0, "max_new_tokens": 6}
HALF = {"uniprefill_keep_ratio": 0.5}


def _story(seed: int, n_sentences: int = 40) -> str:
    """About 13 tokens a sentence: 40 sentences and the question are about 560 tokens.

    The seed comes first, so two prompts share no cached prefix beyond the first token.
    """
    rng = random.Random(seed)
    names = ["Ada", "Bruno", "Chen", "Dana", "Emil", "Farah", "Goran", "Hana"]
    places = ["the harbour", "the library", "a small farm", "the old mill", "the station"]
    things = ["a red kite", "a brass key", "seven apples", "a blue notebook", "a lantern"]
    story = " ".join(
        f"{rng.choice(names)} walked to {rng.choice(places)} and found {rng.choice(things)}."
        for _ in range(n_sentences))
    return f"{seed}: {story}\n\nQuestion: Who walked to the harbour first?\nAnswer:"


_seeds = iter(range(1000, 2000))


def fresh_prompt() -> str:
    """A long prompt no earlier request shares a cached prefix with."""
    return _story(next(_seeds))


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    cmd = server_command(smollm2_path, free_port(), "--enable-metrics",
                         "--uniprefill-prefix-checkpoint", cpu=True)
    with ServerProcess(cmd, log, run_cpu_env(str(REPO_ROOT))) as srv:
        srv.wait_healthy(START_TIMEOUT_S)
        yield srv


def _prefill_entry(meta_info: dict) -> dict:
    """The request's (last) prefill entry of meta_info["uniprefill"] (decode rows skipped)."""
    assert META in meta_info, f"no {META!r} in meta_info: {sorted(meta_info)}"
    entries = [e for e in meta_info[META] if e["reason"] != "decode"]
    assert entries, meta_info[META]
    return entries[-1]


def _assert_dropped(meta_info: dict) -> dict:
    """The prefill dropped tokens; its first stage held every uncached prompt token."""
    entry = _prefill_entry(meta_info)
    kept = entry["kept_tokens"]
    new_tokens = meta_info["prompt_tokens"] - meta_info["cached_tokens"]
    assert entry["enabled"] and entry["reason"] is None, entry
    assert new_tokens > 256 and len(kept) > 1, (entry, new_tokens)
    if (entry.get("prefix") or {}).get("action") == "re-selected":
        new_tokens = meta_info["prompt_tokens"]  # the cached prefix was scored with them
    assert kept[0] == new_tokens, (kept, meta_info)
    assert all(b <= a for a, b in zip(kept, kept[1:])), kept
    assert kept[-1] < kept[0], kept
    return entry


def _counters(server) -> tuple[int, int]:
    state = server.pool_state()
    return state["scored_tokens"], state["kept_tokens"]


def _generate(server, prompt: str, custom_params: dict | None = None, **kw) -> dict:
    sp = dict(GREEDY) if custom_params is None else {**GREEDY, "custom_params": custom_params}
    r = server.post("/generate", {"text": prompt, "sampling_params": sp, **kw})
    assert r.status_code == 200, r.text
    return r.json()


# --- /generate ------------------------------------------------------------------------------

def test_generate_streamed_and_whole_report_the_same_drop(server):
    prompt = fresh_prompt()
    server.flush_cache()
    whole = _generate(server, prompt, HALF)
    entry = _assert_dropped(whole["meta_info"])
    # Half of the scored blocks at the first drop (sinks and the last window come on top).
    assert entry["kept_tokens"][1] < 0.8 * entry["kept_tokens"][0], entry
    assert whole["text"] and whole["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]

    server.flush_cache()  # the streamed request prefills the same prompt from scratch
    status, events = server.stream("/generate", {
        "text": prompt, "sampling_params": {**GREEDY, "custom_params": HALF}, "stream": True})
    assert status == 200 and events, events
    assert all("error" not in e for e in events), events
    last = events[-1]["meta_info"]
    assert last["finish_reason"] is not None, events[-1]
    assert _assert_dropped(last) == entry
    # Streamed text is cumulative (SGLang's default) or incremental; the answer is the same.
    texts = [e["text"] for e in events]
    assert whole["text"] in (texts[-1], "".join(texts)), (texts, whole["text"])


def test_generate_per_request_off_and_server_default(server):
    # The request's switch wins over everything else, short prompt or long.
    off = _generate(server, "The capital of France is", {"uniprefill": False})
    entry = _prefill_entry(off["meta_info"])
    assert not entry["enabled"] and entry["reason"] == "disabled by the request", entry
    short = _generate(server, "The capital of Italy is")
    entry = _prefill_entry(short["meta_info"])
    assert not entry["enabled"] and entry["reason"] == "prompt under the minimum length", entry
    # No knobs on a long prompt: the server's default (top-p 0.99) scores it.
    before = _counters(server)
    default = _generate(server, fresh_prompt())
    entry = _prefill_entry(default["meta_info"])
    assert entry["enabled"] and entry["reason"] is None, entry
    assert _counters(server)[0] > before[0]


# --- OpenAI API -----------------------------------------------------------------------------

def _chat_body(custom_params: dict, prompt: str | None = None, **kw) -> dict:
    return {"model": "default",
            "messages": [{"role": "user", "content": prompt or fresh_prompt()}],
            "temperature": 0, "max_tokens": GREEDY["max_new_tokens"],
            "custom_params": custom_params, **kw}


def _completion_body(custom_params: dict, **kw) -> dict:
    return {"model": "default", "prompt": fresh_prompt(), "temperature": 0,
            "max_tokens": GREEDY["max_new_tokens"], "custom_params": custom_params, **kw}


def test_chat_completion_returns_meta_info_when_asked(server):
    r = server.post("/v1/chat/completions", _chat_body(HALF, return_meta_info=True))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"]
    _assert_dropped(choice["meta_info"])
    # Without return_meta_info SGLang leaves meta_info out of the response.
    plain = server.post("/v1/chat/completions",
                        _chat_body({"uniprefill": False}, prompt="Say hello.")).json()
    assert "meta_info" not in plain["choices"][0] and plain["choices"][0]["message"]["content"]


@pytest.mark.parametrize("path, stream", [
    ("/v1/completions", False), ("/v1/completions", True), ("/v1/chat/completions", True)],
    ids=["completions", "completions-stream", "chat-stream"])
def test_openai_paths_drop_with_per_request_knobs(server, path, stream):
    """No meta_info on these paths in SGLang: the server's token counters show the drop."""
    body = (_chat_body if "chat" in path else _completion_body)(HALF, stream=stream)
    scored0, kept0 = _counters(server)
    if stream:
        status, events = server.stream(path, body)
        assert status == 200 and events, events
        assert all("error" not in e for e in events), events
        choices = [c for e in events for c in e.get("choices", [])]
        assert "length" in [c.get("finish_reason") for c in choices], events
        assert "".join((c.get("delta") or {}).get("content") or c.get("text") or ""
                       for c in choices), events
    else:
        r = server.post(path, body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["usage"]["prompt_tokens"] > 256 and out["choices"][0]["text"]
        assert out["choices"][0]["finish_reason"] == "length"
    scored1, kept1 = _counters(server)
    scored, kept = scored1 - scored0, kept1 - kept0
    assert scored > 256 and 0 < kept < 0.8 * scored, (scored, kept)


# --- bad knobs ------------------------------------------------------------------------------

BAD_KNOBS = [
    ("uniprefill_top_p", 2),
    ("uniprefill_top_p", -1),
    ("uniprefill_top_p", "abc"),
    ("uniprefill_top_p", None),
    ("uniprefill_keep_ratio", [0.5, 0]),
    ("uniprefill_keep_ratio", [1.5]),
    ("uniprefill", "yes"),
    ("uniprefill_topp", 0.9),
    ("uniprefill_block_sparse_density", 0),
    ("uniprefill_block_sparse_top_p", 1.5),
    ("uniprefill_block_sparse_estimate", "mean"),
]
PATHS = ["/generate", "/v1/completions", "/v1/chat/completions"]


def _short_body(path: str, params: dict, stream: bool) -> str:
    """A short request with extra fields: sampling params for /generate, top level for OpenAI."""
    if path == "/generate":
        body = {"text": "Hello", "sampling_params": {**GREEDY, **params}, "stream": stream}
    elif path == "/v1/completions":
        body = {"model": "default", "prompt": "Hello", "max_tokens": 8, "stream": stream, **params}
    else:
        body = {"model": "default", "messages": [{"role": "user", "content": "Hello"}],
                "max_tokens": 8, "stream": stream, **params}
    return json.dumps(body)


def _refusal(server, path: str, params: dict, stream: bool) -> str:
    """The error message of a refused request, checking its status on the way."""
    body = _short_body(path, params, stream)
    if not stream:
        r = server.post(path, body)
        assert r.status_code == 400, (r.status_code, r.text)
        return r.text
    status, events = server.stream(path, body)
    if path == "/generate":
        # Streamed /generate has answered 200 before SGLang verifies the sampling params; it
        # reports a bad one as a single error event with code 400.
        assert status == 200 and len(events) == 1, (status, events)
        assert events[0]["error"]["code"] == 400, events
        return events[0]["error"]["message"]
    assert status == 400, (status, events)
    return json.dumps(events[0])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("knob, value", BAD_KNOBS, ids=[f"{k}={v!r}" for k, v in BAD_KNOBS])
def test_bad_knob_is_a_400_naming_it(server, path, stream, knob, value):
    message = _refusal(server, path, {"custom_params": {knob: value}}, stream)
    assert f'custom_params[\\"{knob}\\"]' in message or f'custom_params["{knob}"]' in message, (
        message)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path", PATHS)
def test_nan_knob_never_reaches_the_server(server, path, stream):
    """Python's json writes NaN as a bare literal; SGLang's JSON parser refuses the body (400)
    before anything reads it (request_knobs refuses NaN too, for in-process callers)."""
    body = _short_body(path, {"custom_params": {"uniprefill_top_p": math.nan}}, stream)
    assert "NaN" in body
    r = server.post(path, body)
    assert r.status_code == 400 and "JSON decode error" in r.text, (r.status_code, r.text)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path", PATHS)
def test_sglangs_own_bad_sampling_param_gets_the_same_answer(server, path, stream):
    """The reference the knobs are held to: SGLang's answer to a top_p of 2."""
    assert "top_p must be in (0, 1]" in _refusal(server, path, {"top_p": 2}, stream)


# --- Prometheus -----------------------------------------------------------------------------

def _scrape(server) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(server.url + "/metrics", timeout=30).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("sglang:uniprefill"):
                key = (s.name, tuple(sorted((k, v) for k, v in s.labels.items()
                                            if k not in ("model_name", "le"))), s.labels.get("le"))
                samples[key] = s.value
    return samples


def _delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def test_metrics_count_requests_by_outcome_and_the_kept_fraction(server):
    before = _scrape(server)
    dropped = _generate(server, fresh_prompt(), HALF)
    entry = _assert_dropped(dropped["meta_info"])
    _generate(server, "The capital of Spain is", {"uniprefill": False})
    _generate(server, "The capital of Greece is")
    fraction = entry["kept_tokens"][-1] / entry["kept_tokens"][0]
    requests_total = "sglang:uniprefill_requests_total"
    expected = {
        (requests_total, (("outcome", "dropped"), ("reason", "")), None): 1.0,
        (requests_total, (("outcome", "dense"), ("reason", "disabled by the request")), None): 1.0,
        (requests_total, (("outcome", "dense"), ("reason", "prompt under the minimum length")),
         None): 1.0,
        ("sglang:uniprefill_kept_fraction_count", (), None): 1.0,
    }
    deadline = time.monotonic() + 30  # SGLang counts just after it has answered
    while True:
        delta = _delta(_scrape(server), before)
        if all(delta.get(k) == v for k, v in expected.items()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for key, value in expected.items():
        assert delta.get(key) == value, (key, delta)
    assert delta[("sglang:uniprefill_kept_fraction_sum", (), None)] == pytest.approx(fraction)
    buckets = {le for (name, _, le), v in delta.items()
               if name == "sglang:uniprefill_kept_fraction_bucket" and v == 1.0}
    bounds = [*(str(b) for b in KEPT_FRACTION_BUCKETS), "+Inf"]
    assert buckets == {le for le in bounds if float(le) >= fraction}, (fraction, delta)
    assert 0 < fraction < 1


# --- prefix reuse: a frontend program and a multi-turn chat over one document ---------------

@pytest.fixture(scope="module")
def shared_case(smollm2_path):
    from transformers import AutoTokenizer

    from uniprefill_sglang.tools import shared_context

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    return shared_context.make_case(tok, "locker", 1100, num_facts=3, seed=21)


def _flush_cache(server):
    deadline = time.monotonic() + 60
    while server.post("/flush_cache", {}).status_code != 200:
        assert time.monotonic() < deadline, "radix cache flush kept being refused"
        time.sleep(0.2)


def test_frontend_fork_over_a_shared_document_answers_as_dense(server, shared_case):
    """An `sgl.function` that forks after a long shared document, one question per branch,
    through `sgl.RuntimeEndpoint`. The document is cached first with the frontend backend's
    `cache_prefix` (a request generating nothing, as `fork` sends when the text is already
    there), which runs dense under the default policy: each branch answers as dense does."""
    import sglang as sgl

    @sgl.function
    def ask_all(s, document, questions):
        s += document
        forks = s.fork(len(questions))
        for f, q in zip(forks, questions):
            f += "\n\n" + q
            f += sgl.gen("answer", max_tokens=GREEDY["max_new_tokens"], temperature=0)
        return [(f["answer"], f.get_meta_info("answer")) for f in forks]

    questions = [q.text for q in shared_case.questions]
    _flush_cache(server)
    backend = sgl.RuntimeEndpoint(server.url)
    backend.cache_prefix(shared_case.document)
    state = ask_all.run(document=shared_case.document, questions=questions, backend=backend)
    answers = state.ret_value
    _flush_cache(server)
    for (answer, meta), q in zip(answers, questions):
        assert meta["cached_tokens"] > 200, meta  # the branch read the cached document
        dense = _generate(server, shared_case.document + "\n\n" + q, {"uniprefill": False})
        assert answer == dense["text"], (q, answer, dense["text"])
        prefix = _prefill_entry(meta).get("prefix")
        assert prefix is None or prefix["policy"] == "verify", meta
    _flush_cache(server)


def test_openai_multi_turn_chat_over_one_document(server, shared_case):
    """A chat through `/v1/chat/completions` (`custom_params` as the Python client's
    `extra_body` sends it): each turn asks another fact about the document of the first turn,
    hitting the earlier turns in the cache. The assistant turns are the right answers, so every
    run sees the same messages. Re-selecting turns answer exactly as the same messages on a
    flushed cache (each selecting for itself); the default policy says what it did with the
    cached turns; dense answers the same messages for comparison."""
    questions = shared_case.questions
    turns = [shared_case.document + "\n\n" + questions[0].text.split("\n")[0]]
    turns += [q.text.split("\n")[0] for q in questions[1:]]
    messages = []
    for turn, q in zip(turns, questions):
        messages += [{"role": "user", "content": turn},
                     {"role": "assistant", "content": f"The code is {q.answer}."}]

    def chat(k, knobs):
        r = server.post("/v1/chat/completions", {
            "model": "default", "messages": messages[:2 * k + 1], "temperature": 0,
            "max_tokens": 16, "custom_params": knobs, "return_meta_info": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"], _prefill_entry(choice["meta_info"])

    def conversation(knobs, cached: bool):
        _flush_cache(server)
        out = []
        for k in range(len(turns)):
            if not cached:
                _flush_cache(server)
            out.append(chat(k, knobs))
        return out

    reselect = conversation({"uniprefill_prefix_policy": "reselect"}, cached=True)
    alone = conversation({}, cached=False)
    verify = conversation({"uniprefill_prefix_policy": "verify"}, cached=True)
    dense = conversation({"uniprefill": False}, cached=True)
    for k in range(1, len(turns)):
        assert reselect[k][1]["prefix"]["action"] == "re-selected", reselect[k][1]
        assert reselect[k][0] == alone[k][0], (k, reselect[k][0], alone[k][0])
        prefix = verify[k][1]["prefix"]
        assert prefix["policy"] == "verify" and prefix["cached_tokens"] > 200, prefix
        assert prefix["action"] in ("reused", "re-selected") and prefix["why"], prefix
    right = [[q.correct(text) for (text, _), q in zip(run, questions)]
             for run in (dense, alone, verify)]
    print("multi-turn chat, turns answered right (dense, alone, verify):", right)
    # Where dense answers, the cached conversation loses at most one turn.
    lost = sum(d and not v for d, v in zip(right[0], right[2]))
    assert lost <= 1, right
    _flush_cache(server)


# --- the end state --------------------------------------------------------------------------

def test_after_everything_the_pools_are_idle_and_nothing_is_parked(server):
    # Still serving after the refused requests.
    _assert_dropped(_generate(server, fresh_prompt(), HALF)["meta_info"])
    state = server.pool_state()
    assert idle_pool_problems(state) == [], state
    assert server.alive()
