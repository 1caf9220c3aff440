#!/usr/bin/env python3
"""Compare uvicorn's two HTTP parsers under duet's edge: the request-smuggling probe (a request
with both Content-Length and Transfer-Encoding hiding a second request in its body) and the
latency of small requests on one keep-alive connection. Prints a table and writes it to
docs/http_parsers.md. httptools is optional: install it where this runs to measure it.

  .venv/bin/python scripts/http_parsers.py --requests 2000
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SMUGGLED = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: duet\r\nContent-Type: application/json\r\n"
    b"Content-Length: 47\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    b"GET /v1/models HTTP/1.1\r\nHost: duet\r\n\r\n"
)
MODELS = '[[models]]\nid = "tiny"\nsource = "path:/unused"\nengine = "torch"\n'


def probe(port: int) -> tuple[list[int], bool]:
    """Statuses answered to the smuggling request, and whether the connection was closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(SMUGGLED)
        data, closed = b"", True
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except TimeoutError:
            closed = False
    statuses = [int(line.split()[1]) for line in data.split(b"\r\n")
                if line.startswith(b"HTTP/1.1 ")]
    return statuses, closed


def latency_us(port: int, n: int) -> float:
    """Median microseconds of GET /health, one keep-alive connection, one request at a time."""
    request = b"GET /health HTTP/1.1\r\nHost: duet\r\n\r\n"
    times = []
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        for _ in range(n):
            start = time.perf_counter()
            sock.sendall(request)
            data = b""
            while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
                data += sock.recv(65536)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(http: str, n: int) -> dict:
    from engines.fake import FakeEngine
    from server.app import create_app
    from server.settings import Settings
    from tests.live_server import LiveServer

    class Factory:
        names = ("torch",)

        def available(self, name):
            return True

        def create(self, name, spec):
            return FakeEngine(name)

    models = Path(tempfile.mkdtemp()) / "models.toml"
    models.write_text(MODELS)
    app = create_app(Settings(models_file=models), Factory())
    with LiveServer(app, http=http) as server:
        statuses, closed = probe(server.port)
        return {"parser": http, "answers": statuses, "closed": closed,
                "health_us": latency_us(server.port, n)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--out", default=str(ROOT / "docs" / "http_parsers.md"))
    args = parser.parse_args()
    parsers = ["h11"]
    try:
        import httptools  # noqa: F401

        parsers.append("httptools")
    except ImportError:
        print("httptools is not installed: measuring h11 only")
    rows = [measure(p, args.requests) for p in parsers]
    lines = [
        f"`scripts/http_parsers.py`, {dt.date.today().isoformat()}, {platform.system()} "
        f"{platform.machine()}, {os.cpu_count()} CPU cores; median of {args.requests} "
        "`GET /health` on one keep-alive connection.", "",
        "| parser | answers to the smuggling request | connection closed | GET /health (us) |",
        "|---|---|---|---|",
    ]
    lines += [f"| {r['parser']} | {', '.join(map(str, r['answers'])) or 'none'} | "
              f"{'yes' if r['closed'] else 'no'} | {r['health_us']:.0f} |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text("# HTTP parsers\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
