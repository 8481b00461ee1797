"""Router: the gRPC front door (grpc_service.py), request parsing, the request lifecycle across prefill and decode
replicas (lifecycle.py), replica choice (policy.py), the router actor and the Python client. OpenAI-compatible
HTTP and cache-aware routing come with a later issue."""
