"""Decode worker: the Ray actor that runs one decode replica (PP stages x EP ranks x TP ranks): reservations for
transferred KV, admission with the prefill replica's first token, local prefill for colocated mode (replica.py)."""
