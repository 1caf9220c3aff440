"""While the bench's load mode runs, engine requests other than its own clients' get a 429.

A load level measures what its clients get; a request from elsewhere would join their batch
and its tokens would not be counted, so the figures would be wrong without saying so. The
level's clients carry the run's token in a header; everything else that would run on an
engine (generation, classification, embeddings) is told to come back later."""

from __future__ import annotations

import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import APIError

HEADER = "X-Duet-Bench-Load"
ENGINE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses",
                          "/v1/embeddings", "/v1/classifications"})
RETRY_AFTER_S = 10


class LoadGate:
    """The running load bench's token (None when none runs): app.state's, set by the bench."""

    def __init__(self) -> None:
        self.token: str | None = None

    def open(self) -> str:
        self.token = secrets.token_hex(16)
        return self.token

    def close(self) -> None:
        self.token = None


def bench_running() -> APIError:
    return APIError(
        429, "a load benchmark is running on this server (POST /bench with clients); its "
        f"levels measure only their own clients: retry in {RETRY_AFTER_S} s",
        type="rate_limit_error", code="bench_running",
        headers={"Retry-After": str(RETRY_AFTER_S)})


class BenchLoadGate:
    def __init__(self, app: ASGIApp, gate: LoadGate):
        self.app, self.gate = app, gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        token = self.gate.token
        if (token is not None and scope["type"] == "http" and scope["method"] == "POST"
                and scope["path"] in ENGINE_PATHS
                and dict(scope.get("headers") or []).get(HEADER.lower().encode())
                != token.encode()):
            await bench_running().response()(scope, receive, send)
            return
        await self.app(scope, receive, send)
