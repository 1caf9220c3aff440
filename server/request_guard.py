"""The body-size limit and disconnect cancellation, for every request of the app.

Each body is read up front (at most max_body_bytes, else 413), then the request runs in its own
task while the connection is watched: when the client goes away before its response is done,
the task is cancelled, which closes the generation's event stream, which tells the engine to
stop at its next decode step. This covers plain and streaming responses of every endpoint alike.
"""

from __future__ import annotations

import asyncio
import contextlib

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError


def body_too_large(limit: int) -> APIError:
    return APIError(
        413, f"the request body is larger than {limit} bytes (DUET_MAX_BODY_BYTES)",
        code="request_too_large",
    )


class RequestGuard:
    def __init__(self, app: ASGIApp, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body = await self._read_body(scope, receive, send)
        if body is None:
            return
        inbox: asyncio.Queue[Message] = asyncio.Queue()
        inbox.put_nowait({"type": "http.request", "body": body, "more_body": False})
        finished = False

        async def tracked_send(message: Message) -> None:
            nonlocal finished
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True

        async def watch() -> None:
            while True:
                message = await receive()
                inbox.put_nowait(message)  # the app may listen for it too (StreamingResponse)
                if message["type"] == "http.disconnect":
                    return

        task = asyncio.ensure_future(self.app(scope, inbox.get, tracked_send))
        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done() and not finished:
                task.cancel()  # the client left: nobody will read what this request makes
            with contextlib.suppress(asyncio.CancelledError):
                await task
        finally:
            # Also reached when this request itself is cancelled (the server's shutdown timeout).
            for t in (task, watcher):
                t.cancel()
            await asyncio.gather(task, watcher, return_exceptions=True)

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await body_too_large(self.max_body_bytes).response()(scope, receive, send)
            return None
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:  # a chunked body that never declared its length
                await body_too_large(self.max_body_bytes).response()(scope, receive, send)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
