"""Control plane: manifest schema, launcher (`tandem up/down/status`), autoscaler, health and the `tandem` CLI."""
