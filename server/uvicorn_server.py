"""The uvicorn server duet runs under: its connection limits, and its way of shutting down."""

from __future__ import annotations

import asyncio
import sys

import uvicorn

from .connections import protocol_class
from .settings import Settings

# uvicorn's own cancellation after the grace period is only a last resort: duet ends every
# request itself when the grace period expires, and that takes well under this margin.
SHUTDOWN_BACKSTOP_S = 5.0
# How long a thread may keep the GIL while another waits for it. The engine's loop thread
# waits on the device with the GIL released, then needs it back at once to launch the next
# step; at CPython's default of 5 ms the event loop, busy with many streams, kept it that
# long (H200, llama-3.2-1b, 64 clients: 4.3 ms steps in the server against 1.4 ms alone;
# 2.9 ms at 0.5 ms). On a fake engine of 1.5 ms steps and 64 clients here, 0.2 ms gave
# 19.0k tok/s against 17.3k at 0.5 ms.
GIL_SWITCH_INTERVAL_S = 0.0002


class DuetServer(uvicorn.Server):
    """On SIGTERM or Ctrl-C, in-flight requests get shutdown_timeout_s to finish; then the
    app's ShutdownNotice expires and each is ended cleanly (a stream with an error event and
    [DONE], a waiting request with a 503), which stops its engine at the next step."""

    def __init__(self, config: uvicorn.Config, grace_s: float):
        super().__init__(config)
        self.grace_s = grace_s

    async def shutdown(self, sockets=None) -> None:
        notice = self.config.app.state.shutdown
        expire = asyncio.get_running_loop().call_later(self.grace_s, notice.expire)
        try:
            await super().shutdown(sockets)
        finally:
            expire.cancel()


def build_server(app, settings: Settings, *, port: int | None = None,
                 http: str = "auto") -> DuetServer:
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port if port is None else port,
        log_level=settings.log_level,
        http=protocol_class(http, header_timeout_s=settings.header_timeout_s,
                            max_connections=settings.max_connections),
        timeout_keep_alive=settings.keep_alive_timeout_s,
        timeout_graceful_shutdown=settings.shutdown_timeout_s + SHUTDOWN_BACKSTOP_S,
    )
    return DuetServer(config, settings.shutdown_timeout_s)
