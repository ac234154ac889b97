"""The README's demo command for CI: `command` prints it as the README prints it (the first line
of the first ```bash block that installs the `demo` extra), so that CI runs exactly what a reader
copies; `check LOG` holds the demo's output to what the README promises: an answer and a time to
first token each way, and the tokens kept after each drop layer."""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def command(readme: str) -> str:
    for block in re.findall(r"```bash\n(.*?)```", readme, flags=re.S):
        for line in block.splitlines():
            if line.startswith("pip install") and ".[demo]" in line:
                return line
    raise SystemExit(f"{README}: no ```bash block installs the demo extra")


RUN = re.compile(r"^\s*(dense|UniPrefill): TTFT\s+(\d+\.\d+) s \| answer '(.+)' \((right|wrong)\)$")
KEPT = re.compile(r"^UniPrefill tokens kept per stage: (\d+(?: -> \d+)+) ")


def check(log: str) -> list[str]:
    """What the demo's output lacks (empty: all there)."""
    runs = {m.group(1): m for line in log.splitlines() if (m := RUN.match(line))}
    problems = [f"no '{name}: TTFT ... | answer ...' line" for name in ("dense", "UniPrefill")
                if name not in runs]
    problems += [f"{name}: a TTFT of zero" for name, m in runs.items() if float(m.group(2)) <= 0]
    kept = next((m for line in log.splitlines() if (m := KEPT.match(line))), None)
    if kept is None:
        problems.append("no 'UniPrefill tokens kept per stage' line (nothing dropped)")
    else:
        counts = [int(n) for n in kept.group(1).split(" -> ")]
        if any(after > before for before, after in zip(counts, counts[1:])) or counts[-1] <= 0:
            problems.append(f"kept tokens do not shrink: {counts}")
    if "Traceback (most recent call last)" in log:
        problems.append("a traceback in the demo's output")
    return problems


def main(argv: list[str]) -> int:
    if argv == ["command"]:
        print(command(README.read_text()))
        return 0
    if len(argv) == 2 and argv[0] == "check":
        problems = check(Path(argv[1]).read_text())
        for problem in problems:
            print(f"README demo: {problem}", file=sys.stderr)
        return 1 if problems else 0
    print("usage: readme_demo.py command | check LOG", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
