"""SGLang plugin entry point (`sglang.srt.plugins` group, see pyproject.toml).

SGLang calls `load()` in the launcher, in `sglang.Engine` and at the start of every scheduler
process. Registering hooks is cheap and inert: nothing changes unless `--enable-uniprefill`.
"""


def load() -> None:
    from uniprefill_sglang.patches import register_all

    register_all()
