"""KV transfer: connector state machine, UCX transport, layout re-sharding and integrity checks (filled by a later issue)."""
