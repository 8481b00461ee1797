"""One serving replica, whichever its role: the contract the router and the control plane call it through
(contract.py, torch-free), the typed view of a replica's Ray actor (remote.py), what a replica is built from
(spec.py) and the shell that runs its engine and answers what every replica answers (shell.py). The role-specific
halves live in prefill_worker/ and decode_worker/.

Import the modules, not this package: the router imports contract.py and remote.py without the model runtime."""
