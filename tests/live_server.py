"""Run an app under duet's own uvicorn server (connection limits, shutdown) on a free loopback
port, in a background thread."""

from __future__ import annotations

import socket
import threading
import time

from server.uvicorn_server import build_server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, app, startup_timeout: float = 300.0, http: str = "auto"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        settings = app.state.settings.model_copy(update={"host": "127.0.0.1",
                                                          "log_level": "warning"})
        self._server = build_server(app, settings, port=self.port, http=http)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._timeout = startup_timeout

    def __enter__(self) -> "LiveServer":
        self._thread.start()
        deadline = time.time() + self._timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.time() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
