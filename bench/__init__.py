"""Benchmarks and load generators. Every script prints its results as one JSON object on its last line."""
