"""Router: the front doors (gRPC in grpc_service.py; OpenAI-compatible HTTP in http_service.py over
openai_bodies.py, openai_requests.py, openai_responses.py and openai_errors.py; what both share in serving.py:
auth, metrics, accounting), request parsing, the request lifecycle across prefill and decode replicas
(lifecycle.py, calling them through replica/contract.py's Protocols), cache-aware routing (routing.py,
policy.py, the prefix index kv_index.py fed by kv_feed.py), the router actor, the Python client, and mock
replicas for tests and benchmarks (mocks/). Nothing here imports torch: the router needs the model's
tokenizer and config, never its runtime."""
