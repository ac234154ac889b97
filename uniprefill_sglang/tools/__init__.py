"""Tooling around the plugin, not needed to serve with it: the search for drop schedules
(`calibrate`, `python -m uniprefill_sglang.tools.calibrate`), the demo, the long-context task
generator and its haystacks, the small-model converter, the CPU-engine setup and the Prepacking
baseline. No module outside this folder imports it.

Counted with `wc -l` when `calibrate` moved here: these tools are 4,044 of the 11,600 Python lines
under uniprefill_sglang/; the serving core (the rest, profiles/ holding JSON only) is 7,556, and
kernels/ (1,912) and patches/ (1,686) install beside it."""
