"""Control plane: the manifest (schema in manifest.py and manifest_checks.py, YAML loading in manifest_yaml.py),
the replicas it asks for (replica_plans.py), the controller actor that starts them and the router on Ray
(controller.py), `tandem up/down/status` (launcher.py, commands.py) and the `tandem` CLI (cli.py)."""
