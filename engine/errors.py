"""Errors a user can act on. The CLI prints their message without a traceback."""


class TandemError(Exception):
    """Base of every error whose message alone tells the user what went wrong and what to do."""


class ModelLoadError(TandemError, ValueError):
    """A model path, file or configuration could not be turned into a runnable model."""


class UnsupportedModelError(ModelLoadError):
    """The model is well formed but uses an architecture or feature tandem does not implement."""


class RequestRejectedError(TandemError, ValueError):
    """A request that can never be served with this engine's limits (context length, KV pool size)."""


class ReplicaFailedError(TandemError, RuntimeError):
    """A rank of a replica that spans processes died or raised; the replica has been shut down."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an error; every open stream receives it and new requests are refused (a
    replica whose engine is dead is dead to the router: engine/core/async_engine.py raises it)."""
