"""Connection limits below the ASGI app: how many connections, and how long a client may take
to send a request's headers.

uvicorn closes a keep-alive connection that stays idle after a response (timeout_keep_alive),
but it holds a freshly opened connection that sends nothing, or trickles its headers a byte at a
time, for ever. ConnectionLimits, mixed into uvicorn's HTTP protocol class, closes such a
connection once header_timeout_s has passed since it opened or since its last response, and
refuses connections beyond max_connections with a 503 in duet's error shape before reading
anything from them.
"""

from __future__ import annotations

import asyncio
import json

from .errors import APIError


def _raw_response(status: int, reason: str, message: str, code: str,
                  type_: str = "invalid_request_error") -> bytes:
    """An error written straight to the socket, before any request exists to answer."""
    body = json.dumps(APIError(status, message, type=type_, code=code).body()).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


class ConnectionLimits:
    """Mixin for uvicorn's H11Protocol / HttpToolsProtocol (class attributes set by
    protocol_class)."""

    header_timeout_s: float = 10.0
    max_connections: int = 512

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_started = False  # some bytes of the next request's head have come
        if len(self.connections) > self.max_connections:  # type: ignore[attr-defined]
            transport.write(_raw_response(
                503, "Service Unavailable",
                f"the server has {self.max_connections} open connections, its limit "
                "(DUET_MAX_CONNECTIONS); retry later", "too_many_connections", "server_error"))
            transport.close()
            return
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._awaiting_head():
            self._head_started = True
        super().data_received(data)  # type: ignore[misc]

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)  # type: ignore[misc]

    def _awaiting_head(self) -> bool:
        cycle = self.cycle  # type: ignore[attr-defined]
        return cycle is None or cycle.response_complete

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_started = False
        if not self.transport.is_closing():  # type: ignore[attr-defined]
            loop = asyncio.get_running_loop()
            self._head_timer = loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        transport = self.transport  # type: ignore[attr-defined]
        if not self._awaiting_head() or transport.is_closing():
            return  # a request is being served: its body and run have limits of their own
        if self._head_started:  # half a request: say why before closing
            transport.write(_raw_response(
                408, "Request Timeout", f"the request's headers did not arrive within "
                f"{self.header_timeout_s:g} s (DUET_HEADER_TIMEOUT_S)", "request_timeout"))
        transport.close()


def protocol_class(http: str, *, header_timeout_s: float, max_connections: int) -> type:
    """uvicorn's protocol class for `http` ("auto", "h11" or "httptools") with the limits."""
    base = _load(http)
    return type(f"Limited{base.__name__}", (ConnectionLimits, base),
                {"header_timeout_s": header_timeout_s, "max_connections": max_connections})


def _load(http: str) -> type:
    """As uvicorn picks: httptools when installed, else h11."""
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    name = http
    if http == "auto":
        try:
            import httptools  # noqa: F401

            name = "httptools"
        except ImportError:
            name = "h11"
    return import_from_string(HTTP_PROTOCOLS[name])
