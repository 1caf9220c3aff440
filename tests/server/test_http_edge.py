"""The HTTP edge, spoken to over raw sockets: request smuggling, slow and idle connections, the
connection limit and early refusals, each of which must end with the connection closed."""

import json
import socket
import time

import httpx
import pytest

from server.app import create_app
from server.request_guard import LINGER_S
from server.settings import Settings
from tests.live_server import LiveServer
from tests.server.conftest import FakeFactory

SMUGGLED = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: duet\r\nContent-Type: application/json\r\n"
    b"Content-Length: 47\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"0\r\n\r\n"
    b"GET /v1/models HTTP/1.1\r\nHost: duet\r\n\r\n"
)


@pytest.fixture(params=["h11", "httptools"])
def serve(models_file, request):
    """A server on each HTTP parser duet may run under (httptools is the default where it is
    installed, as serving installs it; h11 is uvicorn's pure-Python fallback)."""
    servers = []

    def start(**settings) -> LiveServer:
        app = create_app(Settings(models_file=models_file, **settings), FakeFactory())
        server = LiveServer(app, http=request.param).__enter__()
        server.parser = request.param
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.__exit__(None, None, None)


def connect(server: LiveServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return sock


def read_until_closed(sock: socket.socket, limit_s: float = 10) -> tuple[bytes, bool]:
    """Everything the server sends, and whether it closed the connection within limit_s."""
    sock.settimeout(limit_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        return data, False
    return data, True


def responses(data: bytes) -> list[int]:
    return [int(line.split()[1]) for line in data.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]


def json_body(data: bytes) -> dict:
    return json.loads(data.split(b"\r\n\r\n", 1)[1])


def test_content_length_with_transfer_encoding_is_refused_and_the_connection_closed(serve):
    server = serve()
    with connect(server) as sock:
        sock.sendall(SMUGGLED)
        data, closed = read_until_closed(sock)
    assert closed, data
    assert responses(data) == [400], data  # the hidden GET /v1/models was never answered
    if server.parser == "h11":  # httptools (llhttp) refuses it itself, with a plain-text 400
        err = json_body(data)["error"]
        assert err["code"] == "invalid_request_framing" and "Transfer-Encoding" in err["message"]


def test_an_idle_connection_is_closed_after_the_header_timeout(serve):
    server = serve(header_timeout_s=0.5)
    with connect(server) as sock:
        started = time.monotonic()
        data, closed = read_until_closed(sock)
    assert closed and data == b""  # nothing was asked, nothing is said
    assert 0.4 < time.monotonic() - started < 5


def test_headers_sent_a_byte_at_a_time_get_408_and_a_closed_connection(serve):
    server = serve(header_timeout_s=0.8)
    head = b"GET /v1/models HTTP/1.1\r\nHost: duet\r\nX-Slow: " + b"a" * 40
    with connect(server) as sock:
        started = time.monotonic()
        for byte in head:  # slowloris: always a little more, never the end of the headers
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            time.sleep(0.05)
            if time.monotonic() - started > 3:
                break
        data, closed = read_until_closed(sock)
    assert closed and responses(data) == [408], data
    assert json_body(data)["error"]["code"] == "request_timeout"
    assert time.monotonic() - started < 5


def test_a_keep_alive_connection_gets_the_header_timeout_again_after_a_response(serve):
    server = serve(header_timeout_s=0.6, keep_alive_timeout_s=30)
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: duet\r\n\r\n")
        time.sleep(0.2)
        first = sock.recv(65536)
        assert responses(first) == [200]
        sock.sendall(b"GET /hea")  # then nothing more
        data, closed = read_until_closed(sock)
    assert closed and responses(data) == [408]


def test_a_slow_body_gets_408_and_a_closed_connection(serve):
    server = serve(body_timeout_s=0.5)
    with connect(server) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: duet\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":")
        data, closed = read_until_closed(sock)
    assert closed and responses(data) == [408], data
    err = json_body(data)["error"]
    assert err["code"] == "request_timeout" and "DUET_BODY_TIMEOUT_S" in err["message"]


def test_an_early_413_closes_the_connection_when_the_body_never_comes(serve):
    server = serve(max_body_bytes=4096, keep_alive_timeout_s=30)
    with connect(server) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: duet\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
        data, closed = read_until_closed(sock)
    assert closed and responses(data) == [413], data
    assert time.monotonic() - started < LINGER_S + 2  # not left open until some idle timeout
    assert json_body(data)["error"]["code"] == "request_too_large"


def test_a_413_reaches_a_client_still_sending_its_body(serve):
    """The server drains what is in flight before it closes, so the client reads the 413
    rather than a reset connection."""
    server = serve(max_body_bytes=4096)
    body = b"x" * (2 * 1024 * 1024)
    resp = httpx.post(server.url + "/v1/chat/completions", content=body,
                      headers={"content-type": "application/json"}, timeout=30)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    assert resp.headers["connection"] == "close"


def test_connections_past_the_limit_are_refused_with_503(serve):
    server = serve(max_connections=3, header_timeout_s=30)
    held = [connect(server) for _ in range(3)]
    try:
        time.sleep(0.2)
        with connect(server) as extra:
            data, closed = read_until_closed(extra)
        assert closed and responses(data) == [503], data
        assert json_body(data)["error"]["code"] == "too_many_connections"
        held.pop().close()
        time.sleep(0.2)
        with connect(server) as sock:  # a place is free again
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: duet\r\nConnection: close\r\n\r\n")
            data, _ = read_until_closed(sock)
        assert responses(data) == [200]
    finally:
        for sock in held:
            sock.close()
