"""Two guards on the HTTP front door's connections that uvicorn lacks, as its h11 protocol class with two
overrides (start_http_server passes it as uvicorn's `http`):

- A request's headers must arrive within the limits' body_timeout_s, counted from the connection's opening (or,
  on a kept-alive connection, from the next request's first byte). A client that sends them slowly, or nothing
  at all, holds a connection and a little memory forever otherwise (slowloris); past the timeout it gets 408 and
  the connection is closed. The body has its own timeout of the same length (http_service.py).
- At most max_connections_per_client connections are open from one client address. A connection past the cap is
  answered 429 (an OpenAI error body naming the setting) as soon as its request's headers have arrived, then
  closed: a server that closed it unread could reset it before the client saw why.
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.h11_impl import H11Protocol

from tandem.router.limits import RequestLimits


def _error_body(message: str, kind: str, code: str) -> bytes:
    """An OpenAI error object (openai_errors.py's shape)."""
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


def _raw_response(status: str, body: bytes) -> bytes:
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def _refusal_app(body: bytes):
    """An ASGI app answering every request with body's JSON as 429, closing the connection."""
    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 429,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                (b"retry-after", b"1")]})
        await send({"type": "http.response.body", "body": body})
    return app


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the header timeout and the per-address connection cap. Built per server by
    guarded_protocol(), which sets the class attributes below."""

    header_timeout_s: float = 30.0
    max_per_client: int = 1024
    open_per_client: dict[str, int] = {}

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._host = self.client[0] if self.client else None
        self._counted = self._host is not None and self.open_per_client.get(self._host, 0) < self.max_per_client
        if self._counted:
            self.open_per_client[self._host] = self.open_per_client.get(self._host, 0) + 1
        elif self._host is not None:
            message = (f"too many connections from {self._host}: this server takes at most {self.max_per_client} "
                       f"open connections per client address (router.limits.max_connections_per_client)")
            self.app = _refusal_app(_error_body(message, "rate_limit_error", "too_many_connections"))
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and not self._in_request():
            self._arm()  # the next request on a kept-alive connection: its headers have the same time
        super().data_received(data)
        if self._in_request():
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._counted:
            self._counted = False
            left = self.open_per_client[self._host] - 1
            if left:
                self.open_per_client[self._host] = left
            else:
                del self.open_per_client[self._host]
        super().connection_lost(exc)

    def _in_request(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self._in_request() or self.transport.is_closing():
            return
        message = (f"the request's headers did not arrive within {self.header_timeout_s:g} s "
                   f"(router.limits.body_timeout_s)")
        self.transport.write(_raw_response("408 Request Timeout",
                                           _error_body(message, "invalid_request_error", "request_timeout")))
        self.transport.close()


def guarded_protocol(limits: RequestLimits) -> type[GuardedH11Protocol]:
    """The protocol class for one server: its own count of open connections per address, limits' timeout and
    cap."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {
        "header_timeout_s": limits.body_timeout_s, "max_per_client": limits.max_connections_per_client,
        "open_per_client": {}})
