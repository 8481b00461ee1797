"""Prefill worker: a Ray actor group that runs one tensor-parallel prefill replica (filled by a later issue)."""
