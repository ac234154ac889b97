"""Offline tooling, not needed to serve: the schedule search
(`python -m uniprefill_sglang.tools.calibrate`), the demo, the long-context tasks and haystacks,
the small-model converter, the CPU-engine setup and the Prepacking baseline. No serving module,
patch or kernel imports it (tests/test_import_layers.py).

Counted with `wc -l` when `calibrate` moved here: these tools are 4,050 of the 11,606 Python lines
under uniprefill_sglang/; the serving core (the rest, profiles/ holding JSON only) is 7,556, and
kernels/ (1,912) and patches/ (1,686) install beside it."""
