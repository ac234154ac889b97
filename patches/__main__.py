"""`python -m uniprefill_sglang.patches`: print every change the plugin makes to SGLang.

`--check`: exit 1, naming them, when hooked functions of the installed SGLang have other
parameters than the plugin was written for; `--record`: record the installed ones.
"""

import argparse
import json
import sys

import sglang

from uniprefill_sglang.patches import all_hooks
from uniprefill_sglang.patches.hook_table import SIGNATURES, parameters, signature_changes, signed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m uniprefill_sglang.patches")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args(argv)
    rows = all_hooks()
    if args.record:
        lines = [f" {json.dumps(t)}: {json.dumps(parameters(t))}" for t in signed(rows)]
        SIGNATURES.write_text("{\n" + ",\n".join(lines) + "\n}\n")
        return 0
    if args.check:
        changes = signature_changes(rows)
        for target, change in changes.items():
            print(f"{target}: {change}")
        print(f"SGLang {sglang.__version__}: {len(changes)} hooked function(s) changed")
        return 1 if changes else 0
    print(f"uniprefill-sglang: {len(rows)} changes to SGLang {sglang.__version__}\n")
    for hook in rows:
        where = f" (where {hook.backend} serves)" if hook.backend else ""
        print(f"{hook.kind:8} {hook.target}{where}\n         {hook.function_name}\n"
              f"         {hook.why}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
