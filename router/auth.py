"""API-key authentication, the same for the gRPC and the HTTP API: `authorization: Bearer KEY` (gRPC metadata or
HTTP header). Each key belongs to a tenant, and the tenant salts the prefix cache (cache_salt_for), so two
tenants never share cached KV blocks: equal prompts hash differently.

With no keys configured every call is let in as tenant None (no salt: one shared cache)."""

from __future__ import annotations

import hmac
from typing import Mapping


class Unauthenticated(Exception):
    """The call carries no key, or one that is not configured (gRPC UNAUTHENTICATED, HTTP 401)."""


def cache_salt_for(tenant: str | None) -> str | None:
    return None if tenant is None else f"tenant:{tenant}"


class Authenticator:
    def __init__(self, keys: Mapping[str, str] | None = None):
        """keys: API key -> tenant (empty or None: authentication is off)."""
        self._keys = [(key.encode(), tenant) for key, tenant in (keys or {}).items()]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def tenant(self, authorization: str | None) -> str | None:
        """The tenant of an `authorization` value ("Bearer KEY"); None when authentication is off. Raises
        Unauthenticated. Every configured key is compared in constant time, so timing tells nothing about
        which key came close."""
        if not self._keys:
            return None
        if not authorization:
            raise Unauthenticated("missing API key: send `Authorization: Bearer <key>`")
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated("malformed authorization: expected `Bearer <key>`")
        given = key.strip().encode()
        found = None
        for candidate, tenant in self._keys:
            if hmac.compare_digest(candidate, given):
                found = tenant
        if found is None:
            raise Unauthenticated("invalid API key")
        return found
