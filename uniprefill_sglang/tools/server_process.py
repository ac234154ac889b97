"""A `python -m sglang.launch_server` process on 127.0.0.1, started and stopped as a unit, and
the HTTP calls made to it (server info, health, radix-cache flush, streamed responses, the
scheduler's `uniprefill` pool state).

Used by the HTTP tests and the server benchmarks (`benchmarks/soak.py`,
`benchmarks/stage_kv_serving.py`, `benchmarks/bench_serving_sweep.py`):

    port = free_port()
    cmd = server_command(model_path, port, "--enable-metrics", cpu=True)
    with ServerProcess(cmd, log_path, launch_env(cpu=True)) as server:
        server.wait_healthy(420)
        server.post("/generate", {...})

The server runs in a process group of its own (the launcher, its scheduler and its detokenizer),
so `stop()` ends all of them with SIGTERM, then SIGKILL after a grace period; leaving the `with`
block stops it also when the body raised.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Optional, Union

import requests

HOST = "127.0.0.1"
REQUEST_TIMEOUT_S = 180
SSE_DONE = "[DONE]"  # the payload of a stream's last `data:` line


def free_port(host: str = HOST) -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_command(model_path: str, port: int, *extra: str, cpu: bool = False,
                   engine_kwargs: Optional[Mapping] = None, uniprefill: bool = True) -> list[str]:
    """The launcher's command line on `HOST:port`.

    `cpu=True` adds the CPU engine defaults (`cpu_engine.DEFAULT_ENGINE_KWARGS`, overridden by
    `engine_kwargs`), as flags: `True` is a bare flag, `False`/`None` are left out. `extra` comes
    last, so a flag given there wins where argparse keeps the last value.
    """
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path),
           "--host", HOST, "--port", str(port)]
    if uniprefill:
        cmd.append("--enable-uniprefill")
    kwargs: dict = {}
    if cpu:
        from uniprefill_sglang.tools.cpu_engine import DEFAULT_ENGINE_KWARGS

        kwargs.update(DEFAULT_ENGINE_KWARGS)
    kwargs.update(engine_kwargs or {})
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value is not False and value is not None:
            cmd += [flag, str(value)]
    return cmd + list(extra)


class ServerProcess:
    """One launcher process (own process group) and its log file; a few client helpers."""

    def __init__(self, cmd: list[str], log_path: Path, env: Optional[Mapping[str, str]] = None):
        self.cmd = list(cmd)
        self.url = f"http://{HOST}:{cmd[cmd.index('--port') + 1]}"
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ if env is None else env),
                                     start_new_session=True)
        self.startup_seconds: Optional[float] = None

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_healthy(self, timeout_s: float) -> float:
        """Block until `/health` answers 200; the seconds it took. Raises with the log's tail if
        the launcher exits or the time runs out."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if health_status(self.url, timeout=5) == 200:
                    self.startup_seconds = time.monotonic() - t0
                    return self.startup_seconds
            except requests.RequestException:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"server not healthy after {timeout_s} s:\n{self.log_tail()}")

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the process group, SIGKILL after `grace_s`; idempotent."""
        pgid = self.proc.pid
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline:
                self.proc.poll()
                try:
                    os.killpg(pgid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.2)
            else:
                continue
            break
        try:
            self.proc.wait(timeout=30)
        finally:
            if not self._log.closed:
                self._log.close()

    # --- client helpers ---------------------------------------------------------------------
    def post(self, path: str, body, **kw) -> requests.Response:
        data = body if isinstance(body, (str, bytes)) else json.dumps(body)
        kw.setdefault("timeout", REQUEST_TIMEOUT_S)
        return requests.post(self.url + path, data=data,
                             headers={"Content-Type": "application/json"}, **kw)

    def stream(self, path: str, body, max_events: int = 10_000) -> tuple[int, list]:
        """Status and the decoded SSE events of a streamed request (up to `[DONE]`)."""
        with self.post(path, body, stream=True) as r:
            if r.status_code != 200:
                return r.status_code, [r.json()]
            events = []
            for event in sse_events(r.iter_lines(decode_unicode=True)):
                events.append(event)
                if len(events) >= max_events:
                    raise AssertionError(f"more than {max_events} events")
            return r.status_code, events

    def server_info(self) -> dict:
        return server_info(self.url)

    def pool_state(self, idle_timeout_s: float = 30.0) -> dict:
        """`internal_states[0]["uniprefill"]`, once the scheduler reports idle (or at timeout)."""
        return wait_pool_state(self.url, idle_timeout_s)

    def flush_cache(self, timeout_s: float = 60.0) -> None:
        flush_cache(self.url, timeout_s)


def server_info(url: str, timeout: float = 30.0) -> dict:
    """`/server_info`: the server's arguments, the scheduler's limits and its
    `internal_states`."""
    return requests.get(url + "/server_info", timeout=timeout).json()


def health_status(url: str, timeout: float = 30.0) -> int:
    """The status `/health` answers (200: the server generated a token)."""
    return requests.get(url + "/health", timeout=timeout).status_code


def sse_payload(line: Union[str, bytes]) -> Optional[str]:
    """What a server-sent-events `data:` line carries (`SSE_DONE` ends the stream); None for
    any other line."""
    if isinstance(line, bytes):
        line = line.decode(errors="replace")
    line = line.strip()
    if not line.startswith("data:"):
        return None
    return line[len("data:"):].strip()


def sse_events(lines: Iterable[Union[str, bytes]]) -> Iterator[dict]:
    """The decoded JSON events of a streamed response's lines, up to `[DONE]`."""
    for line in lines:
        payload = sse_payload(line)
        if payload == SSE_DONE:
            return
        if payload is not None:
            yield json.loads(payload)


def pool_state(url: str) -> dict:
    return server_info(url)["internal_states"][0]["uniprefill"]


def wait_pool_state(url: str, idle_timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + idle_timeout_s
    while True:
        state = pool_state(url)
        if state["idle"] or time.monotonic() > deadline:
            return state
        time.sleep(0.2)


def flush_cache(url: str, timeout_s: float = 60.0) -> None:
    """`/flush_cache`, retried while SGLang refuses it (it does while requests are in flight)."""
    deadline = time.monotonic() + timeout_s
    while requests.post(url + "/flush_cache", timeout=30).status_code != 200:
        if time.monotonic() > deadline:
            raise TimeoutError(f"radix cache flush kept being refused for {timeout_s} s")
        time.sleep(0.2)


def idle_pool_problems(state: Mapping) -> list[str]:
    """What is wrong with an idle scheduler's `uniprefill` pool state (empty: nothing).

    Idle means: no KV slot protected (held by a request), every slot free or in the radix
    cache, every request slot free, no chunked prefill's hidden state parked.
    """
    problems = []
    if not state["idle"]:
        problems.append("scheduler not idle")
    if state["protected_kv_tokens"] != 0:
        problems.append(f"protected_kv_tokens={state['protected_kv_tokens']} (want 0)")
    if state["available_kv_tokens"] + state["evictable_kv_tokens"] != state["max_total_num_tokens"]:
        problems.append(
            f"available_kv_tokens={state['available_kv_tokens']} + evictable_kv_tokens="
            f"{state['evictable_kv_tokens']} != max_total_num_tokens="
            f"{state['max_total_num_tokens']}")
    if state["free_req_slots"] != state["req_slots"]:
        problems.append(f"free_req_slots={state['free_req_slots']} of {state['req_slots']}")
    if state["parked_requests"] != 0:
        problems.append(f"parked_requests={state['parked_requests']} (want 0)")
    if state.get("private_prefix_slots", 0) != 0:
        problems.append(f"private_prefix_slots={state['private_prefix_slots']} (want 0)")
    # The staged layout: the pools' own invariant check, and no stage pool holding more slots
    # than the cache has tokens (a cached token holds a stage slot only where it survived).
    problems += [f"kv_pool_problems: {p}" for p in state.get("kv_pool_problems") or []]
    for extra in _stage_pool_excess(state):
        problems.append(f"stage pool {extra[0]} holds {extra[1]} slots more than the cache has "
                        "tokens")
    return problems


def _stage_pool_excess(state: Mapping) -> list:
    """(stage, slots) for each stage pool holding more slots than there are cached tokens."""
    out = []
    for pool in (state.get("kv_pools") or [])[1:]:
        held = pool["size"] - pool["free"]
        if held > state["evictable_kv_tokens"]:
            out.append((pool["stage"], held - state["evictable_kv_tokens"]))
    return out


def leaked_slots(state: Mapping) -> int:
    """KV slots (of the full pool, and the most any stage pool holds past the cached tokens)
    plus request slots not accounted free or cached at idle (0 when none leaked)."""
    kv = state["max_total_num_tokens"] - state["available_kv_tokens"] - state["evictable_kv_tokens"]
    stages = max((n for _, n in _stage_pool_excess(state)), default=0)
    return kv + stages + state["req_slots"] - state["free_req_slots"]


def run_cpu_env(repo_root: Optional[str] = None, base: Optional[Mapping[str, str]] = None
                ) -> dict[str, str]:
    """`os.environ` (or `base`) plus the CPU engine's variables, for a spawned CPU server."""
    from uniprefill_sglang.tools.cpu_engine import cpu_engine_env

    base_env = dict(os.environ if base is None else base)
    return {**base_env, **cpu_engine_env(repo_root, base_env)}


def launch_env(cpu: bool = False, repo_root: Optional[str] = None, **extra: str
               ) -> dict[str, str]:
    """The environment of a spawned server: `os.environ`, the CPU engine's variables when
    `cpu`, then `extra`."""
    env = run_cpu_env(repo_root) if cpu else dict(os.environ)
    env.update(extra)
    return env
