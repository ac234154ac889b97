"""`python -m uniprefill_sglang.patches`: print every change the plugin makes to SGLang.

`--check`: exit 1, naming them, when hooked functions of the installed SGLang have other
parameters than the plugin was written for (none of those recorded for any version), or when
the installed SGLang is not a supported release (uniprefill_sglang/versions.py);
`--record`: record the installed SGLang's under its version, keeping the other versions' (and
the targets of rows for other releases).
"""

import argparse
import json
import sys

import sglang

from uniprefill_sglang import versions
from uniprefill_sglang.patches import all_hooks, hook_table
from uniprefill_sglang.patches.hook_table import (Version, parameters, recorded_signatures,
                                                  signature_changes, signed)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m uniprefill_sglang.patches")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args(argv)
    rows = all_hooks()
    if args.record:
        recorded = recorded_signatures()
        installed = signed(rows)
        targets = []
        # Targets of rows for other releases only keep what those releases recorded.
        for target in sorted(set(installed) | set(recorded)):
            by_version = dict(recorded.get(target, {}))
            if target in installed:
                by_version[sglang.__version__] = parameters(target)
            lines = ",\n".join(f"  {json.dumps(v)}: {json.dumps(p)}"
                                for v, p in sorted(by_version.items(),
                                                   key=lambda item: Version(item[0])))
            targets.append(f" {json.dumps(target)}: {{\n{lines}\n }}")
        hook_table.SIGNATURES.write_text("{\n" + ",\n".join(targets) + "\n}\n")
        return 0
    if args.check:
        changes = signature_changes(rows)
        for target, change in changes.items():
            print(f"{target}: {change}")
        outside = "" if versions.supported() else f", not a supported release ({versions.SUPPORTED})"
        print(f"SGLang {sglang.__version__}: {len(changes)} hooked function(s) changed{outside}")
        return 1 if changes or outside else 0
    print(f"uniprefill-sglang: {len(rows)} changes to SGLang {sglang.__version__}\n")
    for hook in rows:
        where = f" (where {hook.backend} serves)" if hook.backend else ""
        print(f"{hook.kind:8} {hook.target}{where}\n         {hook.function_name}\n"
              f"         {hook.why}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
