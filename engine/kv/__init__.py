"""The KV cache: the paged tensor store each rank holds (kv_cache.py), the pool of its blocks (block_pool.py),
the prefix cache that finds a prompt's blocks by chained content hash (prefix_cache.py) and the events it
publishes for the router's cache-aware routing (kv_events.py). Which sequence holds which blocks is the
scheduler's KV cache manager's business (engine/core/kv_cache_manager.py)."""
