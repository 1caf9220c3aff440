"""The edge of every HTTP request: framing, body size and time, disconnects and shutdown.

- A request with both Content-Length and Transfer-Encoding is refused and its connection
  closed (RFC 9112 6.3): a proxy in front may read its body differently, and a request hidden
  in that body must never be answered.
- Each body is read up front within max_body_bytes (else 413) and body_timeout_s (else 408);
  a request refused before its body was read closes its connection (after draining it for
  up to LINGER_S, so the client reads the answer), so the unread rest can never be taken for
  a next request.
- The request then runs in its own task while the connection is watched: when the client goes
  away before its response is done, the task is cancelled, which closes the generation's event
  stream, which tells the engine to stop at its next step.
- When the server's shutdown grace period expires (ShutdownNotice), every request still running
  is ended cleanly: one that has not answered yet gets a JSON 503, an event stream an error
  event and `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError, shutting_down
from .streaming import DONE, ResponseShape, sse

CLOSE = {"Connection": "close"}
LINGER_S = 2.0


def body_too_large(limit: int) -> APIError:
    return APIError(
        413, f"the request body is larger than {limit} bytes (DUET_MAX_BODY_BYTES)",
        code="request_too_large", headers=CLOSE,
    )


def body_too_slow(limit_s: float) -> APIError:
    return APIError(
        408, f"the request body did not arrive within {limit_s:g} s (DUET_BODY_TIMEOUT_S)",
        code="request_timeout", headers=CLOSE,
    )


def ambiguous_length() -> APIError:
    return APIError(
        400, "the request has both Content-Length and Transfer-Encoding, so its length is "
        "ambiguous (RFC 9112 6.3); the connection is closed", param=None,
        code="invalid_request_framing", headers=CLOSE,
    )


class ShutdownNotice:
    """Set when the server's shutdown grace period has run out. One app may be served from
    several event loops over its life (tests do), so each loop gets an event of its own."""

    def __init__(self) -> None:
        self.is_expired = False
        self._events: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    async def wait(self) -> None:
        event = self._events.setdefault(asyncio.get_running_loop(), asyncio.Event())
        if not self.is_expired:
            await event.wait()

    def expire(self) -> None:
        self.is_expired = True
        for event in list(self._events.values()):
            event.set()


class RequestGuard:
    def __init__(self, app: ASGIApp, max_body_bytes: int, body_timeout_s: float = 30.0,
                 shutdown: ShutdownNotice | None = None):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.shutdown = shutdown or ShutdownNotice()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        names = {name for name, _ in scope.get("headers") or []}
        if b"content-length" in names and b"transfer-encoding" in names:
            await ambiguous_length().response()(scope, receive, send)
            return
        try:
            body = await asyncio.wait_for(self._read_body(scope, receive), self.body_timeout_s)
        except TimeoutError:
            body = body_too_slow(self.body_timeout_s)
        if isinstance(body, APIError):
            if body.status == 413:
                await self._linger(receive)
            await body.response()(scope, receive, send)
            return
        if body is None:  # the client left while sending
            return
        await self._run(scope, body, receive, send)

    async def _run(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        inbox: asyncio.Queue[Message] = asyncio.Queue()
        inbox.put_nowait({"type": "http.request", "body": body, "more_body": False})
        response = _ResponseState()

        async def tracked_send(message: Message) -> None:
            await send(message)
            response.update(message)  # after: a send cancelled in its wait wrote nothing

        async def watch() -> None:
            while True:
                message = await receive()
                inbox.put_nowait(message)  # the app may listen for it too (StreamingResponse)
                if message["type"] == "http.disconnect":
                    return

        task = asyncio.ensure_future(self.app(scope, inbox.get, tracked_send))
        watcher = asyncio.ensure_future(watch())
        expiry = asyncio.ensure_future(self.shutdown.wait())
        try:
            await asyncio.wait({task, watcher, expiry}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done() and not response.finished:
                task.cancel()  # the client left, or the server is closing: stop the work
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if expiry.done() and not watcher.done() and not response.finished:
                await self._end_for_shutdown(response, scope, receive, send)
        finally:
            # Also reached when this request itself is cancelled (uvicorn's last resort at
            # shutdown): nothing of ours may outlive it.
            for t in (task, watcher, expiry):
                t.cancel()
            await asyncio.gather(task, watcher, expiry, return_exceptions=True)

    @staticmethod
    async def _end_for_shutdown(response: "_ResponseState", scope: Scope, receive: Receive,
                                send: Send) -> None:
        err = shutting_down()
        if not response.started:
            await err.response()(scope, receive, send)
            return
        tail = ""
        if response.event_stream:
            tail = sse(ResponseShape.error_event(err.message, err.type, err.code)) + DONE
        await send({"type": "http.response.body", "body": tail.encode(), "more_body": False})

    @staticmethod
    async def _linger(receive: Receive) -> None:
        """Read and drop what the client is still sending, for a moment, before answering and
        closing: closing a socket with unread data resets it, and the client would see a
        broken connection instead of the 413 (nginx's lingering close)."""
        async def drain() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect" or not message.get("more_body", False):
                    return

        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(drain(), LINGER_S)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | APIError | None:
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return body_too_large(self.max_body_bytes)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:  # a chunked body that never declared its length
                return body_too_large(self.max_body_bytes)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class _ResponseState:
    """What a request has sent so far."""

    def __init__(self) -> None:
        self.started = False
        self.finished = False
        self.event_stream = False

    def update(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            content_type = dict(message.get("headers") or []).get(b"content-type", b"")
            self.event_stream = content_type.startswith(b"text/event-stream")
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.finished = True
