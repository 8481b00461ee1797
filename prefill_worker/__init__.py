"""Prefill worker: the Ray actor that runs one prefill replica (TP ranks) and pushes each prompt's KV into the decode
replica's reservation layer by layer (replica.py)."""
