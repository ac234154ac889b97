"""`python -m uniprefill_sglang.patches`: print every change the plugin makes to SGLang."""

import sglang

from uniprefill_sglang.patches import hook_table


def main() -> None:
    rows = hook_table()
    print(f"uniprefill-sglang: {len(rows)} changes to SGLang {sglang.__version__}\n")
    for hook in rows:
        where = f" (where {hook.backend} serves)" if hook.backend else ""
        print(f"{hook.kind:8} {hook.target}{where}\n         {hook.function_name}\n"
              f"         {hook.why}\n")


if __name__ == "__main__":
    main()
