"""One `python -m sglang.bench_serving` run against a running server, and what it measured.

Shared by `bench_serving_sweep.py` and `stage_kv_serving.py`: the command line (random-ids
prompts of one exact length, all sent at once up to a concurrency), the run with its output
appended to a log, the result row bench_serving wrote, and the share of the scored prompt tokens
the server kept meanwhile (from its cumulative `uniprefill` counters read before and after).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Optional

METRICS = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "median_itl_ms",
           "p99_itl_ms", "mean_e2e_latency_ms", "request_throughput", "input_throughput",
           "output_throughput", "duration", "completed")


def bench_serving_command(url: str, model: str, length: int, output_len: int, num_prompts: int,
                          conc: int, seed: int, out_file: Path, extra: tuple = ()) -> list:
    """`sglang.bench_serving` on `num_prompts` random-ids prompts of exactly `length` tokens."""
    return [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang",
            "--base-url", url, "--dataset-name", "random-ids", "--tokenize-prompt",
            "--tokenizer", model, "--model", model,
            "--random-input-len", str(length), "--random-output-len", str(output_len),
            "--random-range-ratio", "1", "--num-prompts", str(num_prompts),
            "--max-concurrency", str(conc), "--request-rate", "inf", "--disable-tqdm",
            "--seed", str(seed), "--output-file", str(out_file), *extra]


def run_bench_serving(cmd: list, out_file: Path, log_path: Path, timeout: float) -> dict:
    """Run `cmd` (its command line and output appended to `log_path`); the result it appended
    last to `out_file`. Raises if it fails or runs past `timeout` seconds."""
    with open(log_path, "a") as log:
        log.write(f"\n$ {shlex.join(cmd)}\n")
        log.flush()
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=timeout)
    return json.loads(Path(out_file).read_text().strip().splitlines()[-1])


def kept_fraction(before: Mapping, after: Mapping) -> Optional[float]:
    """Kept / scored prompt tokens between two reads of the scheduler's cumulative `uniprefill`
    counters (None when nothing was scored: a dense server, or no prompt long enough)."""
    scored = after.get("scored_tokens", 0) - before.get("scored_tokens", 0)
    kept = after.get("kept_tokens", 0) - before.get("kept_tokens", 0)
    return kept / scored if scored else None
