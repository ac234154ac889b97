"""The plugin's own error types (a leaf: imports nothing of the package)."""


class UniPrefillError(RuntimeError):
    """UniPrefill's own code failed in a forward (the forward runs again without it)."""


class CheckFailed(AssertionError):
    """A debug check (UNIPREFILL_CHECK_KV_LENS, UNIPREFILL_CHECK_TP) failed. Never recovered
    from: a check exists to make a bookkeeping bug loud in tests."""
