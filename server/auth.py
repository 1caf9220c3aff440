"""Optional API keys: a Bearer token checked in constant time on every path but /health.

A middleware rather than a per-route dependency, so that every endpoint added later (and
/metrics, /docs and unknown paths) is covered without anyone remembering to opt in.
"""

from __future__ import annotations

import hmac
import ipaddress

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import APIError

# Liveness probes (Docker, launchd, load balancers) carry no key.
OPEN_PATHS = frozenset({"/health"})


def unauthorized(message: str) -> APIError:
    return APIError(
        401, message, code="invalid_api_key",
        headers={"WWW-Authenticate": 'Bearer realm="duet"'},
    )


def key_matches(token: str, keys: frozenset[bytes]) -> bool:
    candidate = token.encode()
    # Compare with every key, without stopping at a match, so timing says nothing about which.
    found = False
    for key in keys:
        found |= hmac.compare_digest(candidate, key)
    return found


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: frozenset[str]):
        self.app = app
        self.keys = frozenset(k.encode() for k in keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            error = unauthorized(
                "this server needs an API key: send it as 'Authorization: Bearer KEY' "
                "(the openai client's api_key)"
            )
        elif not key_matches(token.strip(), self.keys):
            error = unauthorized("the API key is not valid")
        else:
            await self.app(scope, receive, send)
            return
        await error.response()(scope, receive, send)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, has_keys: bool) -> str | None:
    """The loud warning printed when the server is reachable from a network without a key."""
    if has_keys or is_loopback(host):
        return None
    bar = "!" * 78
    return (
        f"{bar}\n"
        f"!! WARNING: duet is binding {host}, which other machines can reach, and no API key\n"
        f"!! is set: ANYONE on the network can use this server and its models.\n"
        f"!! Set one with --api-key KEY, --api-key-file FILE or DUET_API_KEY, or bind\n"
        f"!! 127.0.0.1 (the default).\n"
        f"{bar}"
    )
