"""Decode worker: a Ray actor group that runs one pipeline- and expert-parallel decode replica (filled by a later issue)."""
