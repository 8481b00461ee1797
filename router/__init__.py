"""Router: gRPC and OpenAI-compatible HTTP front door with cache-aware routing (filled by a later issue)."""
