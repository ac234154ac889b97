"""Adapters that teach SGLang attention backends the per-stage (sparse) KV views."""
