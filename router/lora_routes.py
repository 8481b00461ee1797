"""The LoRA adapters the cluster serves, as the router keeps them: each adapter's PEFT folder, and which replicas
hold it. Clients name an adapter in the OpenAI `model` field (gRPC: GenerateRequest.model); the request's KV is
then salted with it (engine/kv/prefix_cache.py kv_salt), so every replica's prefix cache, the router's index and
a transfer's blocks keep it apart from the base model's and other adapters'.

Every replica starts with the manifest's adapters (ReplicaInfo.lora_adapters). One loaded at run time
(POST /v1/load_lora_adapter) is loaded on every replica then; a replica that joins later, or that missed it, is
loaded right before it first serves a request of that adapter: each replica's API is wrapped (wrap()) so that its
prefill, reserve, generate and resume calls make sure of their adapter first. The router thus never sends a
request to a replica that cannot compute it, whichever replica the routing picked."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Callable, Iterable

_log = logging.getLogger(__name__)


class UnknownAdapter(LookupError):
    """A LoRA adapter the cluster does not serve."""


class LoRARoutes:
    def __init__(self, paths: dict[str, str] | None = None):
        self.paths: dict[str, str] = dict(paths or {})  # name -> PEFT folder, as every node reads it
        self.holders: dict[str, set[str]] = {}  # name -> the replicas that serve it now
        self.loads_on_demand = 0  # adapters loaded onto a replica right before its request

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.paths) | set(self.holders)))

    def serves(self, name: str) -> bool:
        return name in self.paths or name in self.holders

    def wrap(self, replica) -> None:
        """Counts what a replica (router/replicas.py Replica) serves, from its info, and makes its API load an
        adapter before it first serves it."""
        for name in (replica.info.lora_adapters if replica.info is not None else ()):
            self.holders.setdefault(name, set()).add(replica.name)
        if not isinstance(replica.api, _AdapterAware):
            replica.api = _AdapterAware(replica.api, self, replica.name)

    def forget(self, replica_name: str) -> None:
        for holders in self.holders.values():
            holders.discard(replica_name)

    async def ensure(self, api: Any, replica_name: str, name: str) -> None:
        """Loads adapter `name` onto the replica unless it serves it. Raises UnknownAdapter for one the cluster
        does not serve, ValueError from the replica (a bad adapter, no LoRA there)."""
        if replica_name in self.holders.get(name, ()):
            return
        path = self.paths.get(name)
        if path is None:
            raise UnknownAdapter(f"no LoRA adapter named {name!r} is served")
        await api.load_lora(name, path)
        self.holders.setdefault(name, set()).add(replica_name)
        self.loads_on_demand += 1
        _log.info("loaded LoRA adapter %s onto %s for a request", name, replica_name)

    async def load(self, name: str, path: str, replicas: Iterable) -> dict[str, float]:
        """Loads the adapter on every replica; returns each replica's check seconds. Raises ValueError for a name
        served from another folder (a name stays bound to its folder: cached KV is keyed by it), or with the first
        replica's reason when one refuses it (the others keep it)."""
        if self.paths.get(name, path) != path:
            raise ValueError(f"LoRA adapter {name!r} is served from {self.paths[name]}: give another folder another "
                             "name")
        replicas = list(replicas)
        results = await asyncio.gather(*(r.api.load_lora(name, path) for r in replicas), return_exceptions=True)
        failed = [(r.name, e) for r, e in zip(replicas, results) if isinstance(e, BaseException)]
        loaded = {r.name: float(s) for r, s in zip(replicas, results) if not isinstance(s, BaseException)}
        if loaded or not replicas:
            self.paths[name] = path
            self.holders[name] = set(loaded)
        if failed:
            replica, error = failed[0]
            raise ValueError(f"LoRA adapter {name!r} could not be loaded on {replica}: {_reason(error)}")
        return loaded

    async def unload(self, name: str, replicas: Iterable) -> None:
        """Stops serving the adapter everywhere. Raises UnknownAdapter if it is not served, ValueError when a
        replica refuses (it still has requests of it: nothing is forgotten then)."""
        if not self.serves(name):
            raise UnknownAdapter(f"no LoRA adapter named {name!r} is served")
        holding = [r for r in replicas if r.name in self.holders.get(name, ())]
        results = await asyncio.gather(*(r.api.unload_lora(name) for r in holding), return_exceptions=True)
        for replica, result in zip(holding, results):
            if isinstance(result, BaseException):
                raise ValueError(f"LoRA adapter {name!r} could not be unloaded on {replica.name}: {_reason(result)}")
        self.paths.pop(name, None)
        self.holders.pop(name, None)


def _reason(error: BaseException) -> str:
    """A replica's refusal as its own message (Ray wraps an actor's exception in RayTaskError)."""
    cause = getattr(error, "cause", None)
    return str(cause if cause is not None else error)


class _AdapterAware:
    """A replica's API whose request calls load the request's adapter first (LoRARoutes.ensure); every other
    attribute is the wrapped API's."""

    def __init__(self, inner: Any, routes: LoRARoutes, name: str):
        self._inner, self._routes, self._name = inner, routes, name

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._inner, attribute)

    async def _ensure(self, params) -> None:
        if params.lora is not None:
            await self._routes.ensure(self._inner, self._name, params.lora)

    async def prefill(self, request_id, prompt_token_ids, params, descriptor, **kwargs):
        await self._ensure(params)
        return await self._inner.prefill(request_id, prompt_token_ids, params, descriptor, **kwargs)

    async def reserve(self, request_id, prompt_token_ids, params, **kwargs):
        await self._ensure(params)
        return await self._inner.reserve(request_id, prompt_token_ids, params, **kwargs)

    def generate(self, request_id, prompt_token_ids, params, **kwargs) -> AsyncIterator:
        return self._stream(params, lambda: self._inner.generate(request_id, prompt_token_ids, params, **kwargs))

    def resume(self, request_id, prompt_token_ids, params, *args, **kwargs) -> AsyncIterator:
        return self._stream(params, lambda: self._inner.resume(request_id, prompt_token_ids, params, *args, **kwargs))

    async def _stream(self, params, open_stream: Callable[[], AsyncIterator]) -> AsyncIterator:
        await self._ensure(params)
        async for item in open_stream():
            yield item
