"""Test doubles of the router's replicas, shared by tests and benches: deterministic replicas (replicas.py),
replicas with a step loop and a cost model (batching.py) and both front doors over them (front.py). Nothing
in production imports them."""
