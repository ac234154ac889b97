"""uniprefill-sglang: UniPrefill prefill token dropping as a plugin for stock SGLang."""

__version__ = "0.1.0"
