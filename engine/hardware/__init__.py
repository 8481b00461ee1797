"""What the engine learns about the machine it runs on: the CPU's instruction sets (cpu_features.py), the
host CPUs a process is pinned to (cpu_affinity.py), the compute device and where each rank runs (device.py),
and kernel choices timed on this machine and cached per machine (kernel_tuning.py, cache_dir.py)."""
