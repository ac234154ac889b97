"""The one header every result file in benchmarks/results carries, so a figure can be traced.

    from result_header import result_header
    json.dump({"header": result_header(model="Llama-3.1-8B shape, random weights"), **result}, f)

Keys, always all present (None where unknown): ``command`` (the command line as typed, script
path relative to the repository), ``date`` (UTC, ISO), ``commit`` (the repository's HEAD),
``commit_note`` (how sure that commit is: clean tree or not), ``device`` (GPUs by name, or the
CPU), ``sglang`` (the installed version), ``model`` (name or shape), ``note`` (free text).
Result files written before this module existed got the same header by hand from the git
history; their ``commit_note`` says so.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
KEYS = ("command", "date", "commit", "commit_note", "device", "sglang", "model", "note")


def _run(*cmd: str) -> Optional[str]:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=REPO)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def command_line(argv: Optional[Sequence[str]] = None) -> str:
    argv = list(sys.argv if argv is None else argv)
    if argv and argv[0].endswith(".py"):
        try:
            argv[0] = os.path.relpath(Path(argv[0]).resolve(), Path.cwd())
        except ValueError:  # another drive (Windows)
            pass
        argv.insert(0, "python")
    return shlex.join(argv)


def git_commit() -> tuple[Optional[str], str]:
    commit = _run("git", "rev-parse", "HEAD")
    if commit is None:
        return None, "not a git checkout: commit unknown"
    dirty = _run("git", "status", "--porcelain", "--untracked-files=no")
    if dirty:
        return commit, "HEAD when the header was taken; tracked files had uncommitted changes"
    return commit, "HEAD when the header was taken (clean tree)"


def device_name() -> str:
    """GPUs by name (nvidia-smi, so no CUDA context is made here), else the CPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
    if visible:
        query.append(f"--id={visible}")
    names = _run(*query)
    if names:
        gpus = [n.strip() for n in names.splitlines() if n.strip()]
        return f"{len(gpus)}x {gpus[0]}" if len(set(gpus)) == 1 else ", ".join(gpus)
    cpu = platform.processor() or platform.machine()
    return f"CPU {cpu}, {os.cpu_count()} cores, no GPU"


def sglang_version() -> Optional[str]:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # not installed (a CPU-only HF benchmark)
        return None


def result_header(model: Optional[str] = None, note: Optional[str] = None,
                  argv: Optional[Sequence[str]] = None) -> dict:
    """The header of a result file written now by the running script."""
    commit, commit_note = git_commit()
    return {
        "command": command_line(argv),
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "commit": commit,
        "commit_note": commit_note,
        "device": device_name(),
        "sglang": sglang_version(),
        "model": None if model is None else str(model),
        "note": note,
    }


if __name__ == "__main__":
    import json

    print(json.dumps(result_header(), indent=1))
