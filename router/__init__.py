"""Router: the front doors (gRPC in grpc_service.py; OpenAI-compatible HTTP in http_service.py over
openai_protocol.py; what both share in serving.py: auth, metrics, accounting), request parsing, the request
lifecycle across prefill and decode replicas (lifecycle.py), cache-aware routing (routing.py, policy.py, the
prefix index kv_index.py fed by kv_feed.py), the router actor and the Python client."""
