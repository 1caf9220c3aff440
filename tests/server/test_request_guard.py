"""RequestGuard, the ASGI layer at the edge of every request, driven in-process with scripted
connections: the shutdown answers, the watch for a client that leaves, the framing and body
limits. test_http_edge.py and test_faults.py check the same behaviour through real sockets and
a real SIGTERM, in a server process of their own."""

import asyncio
import json
import time

import pytest

from server import request_guard
from server.request_guard import RequestGuard, ShutdownNotice, _ResponseState
from server.streaming import DONE, ResponseShape, sse

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


class Connection:
    """One client connection as the ASGI server presents it: what the client sends, in order
    (receive() waits once it is used up, as for a client that is still there), and every
    message the app sent back."""

    def __init__(self, *messages: dict) -> None:
        self.incoming: asyncio.Queue = asyncio.Queue()
        for message in messages:
            self.incoming.put_nowait(message)
        self.sent: list[dict] = []

    async def receive(self) -> dict:
        return await self.incoming.get()

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    def status(self) -> int:
        return next(m["status"] for m in self.sent if m["type"] == "http.response.start")

    def headers(self) -> dict:
        start = next(m for m in self.sent if m["type"] == "http.response.start")
        return {k.decode(): v.decode() for k, v in start["headers"]}

    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")

    def ended(self) -> bool:
        return any(m["type"] == "http.response.body" and not m.get("more_body", False)
                   for m in self.sent)


def scope(*headers: tuple[bytes, bytes]) -> dict:
    return {"type": "http", "method": "POST", "path": "/v1/chat/completions",
            "headers": list(headers)}


def body(data: bytes = b"{}", more: bool = False) -> dict:
    return {"type": "http.request", "body": data, "more_body": more}


DISCONNECT = {"type": "http.disconnect"}


class App:
    """An app that answers with the given messages, then reads what comes until cancelled (a
    generation still running), unless told to return at once or at a disconnect."""

    def __init__(self, *messages: dict, returns: bool = False, listens: bool = False,
                 cleanup_s: float = 0.0) -> None:
        self.messages = messages
        self.returns = returns
        self.listens = listens
        self.cleanup_s = cleanup_s  # time its cleanup takes once cancelled
        self.called = False
        self.scope: dict | None = None
        self.received: list[dict] = []
        self.cancelled = False
        self.cleaned_up = False
        self.answered = asyncio.Event()

    async def __call__(self, scope, receive, send) -> None:
        self.called = True
        self.scope = scope
        self.received.append(await receive())
        try:
            for message in self.messages:
                await send(message)
            self.answered.set()
            if self.returns:
                return
            while True:
                message = await receive()
                self.received.append(message)
                if self.listens and message == DISCONNECT:  # as StreamingResponse does
                    return
        except asyncio.CancelledError:
            self.cancelled = True
            await asyncio.sleep(self.cleanup_s)  # a generation letting its engine go
            self.cleaned_up = True
            raise


def start(content_type: bytes = b"application/json", status: int = 200) -> dict:
    return {"type": "http.response.start", "status": status,
            "headers": [(b"content-type", content_type)]}


def chunk(data: bytes, more: bool = True) -> dict:
    return {"type": "http.response.body", "body": data, "more_body": more}


EVENT_STREAM = b"text/event-stream; charset=utf-8"


async def serving(guard: RequestGuard, conn: Connection, app: App) -> asyncio.Task:
    task = asyncio.create_task(guard(scope((b"content-length", b"2")), conn.receive, conn.send))
    await asyncio.wait_for(app.answered.wait(), 5)
    return task


def shutdown_error(conn: Connection) -> dict:
    return json.loads(conn.body())["error"]


async def shut_down_while_serving(app: App) -> Connection:
    """Serve one request until the app has sent its messages, then run out the grace."""
    notice = ShutdownNotice()
    conn = Connection(body())
    task = await serving(RequestGuard(app, max_body_bytes=100, shutdown=notice), conn, app)
    notice.expire()
    await asyncio.wait_for(task, 5)
    return conn


# -- what a request gets when the shutdown grace runs out


async def test_shutdown_before_the_app_answered_is_a_json_503_that_closes_the_connection():
    app = App()
    conn = await shut_down_while_serving(app)
    assert app.cancelled  # the work was stopped
    assert conn.status() == 503 and conn.headers()["connection"] == "close"
    error = shutdown_error(conn)
    assert error["code"] == "server_shutting_down" and error["type"] == "server_error"
    assert "shutting down" in error["message"] and error["param"] is None
    assert conn.ended()


async def test_shutdown_mid_stream_ends_the_event_stream_with_an_error_event_and_done():
    app = App(start(EVENT_STREAM), chunk(b"data: {}\n\n"))
    conn = await shut_down_while_serving(app)
    assert app.cancelled
    assert conn.status() == 200  # already sent; only the stream's end can say what happened
    last = conn.sent[-1]
    assert last["type"] == "http.response.body" and last["more_body"] is False
    events = last["body"].decode()
    assert events.endswith(DONE) and events.count("data: ") == 2
    error = json.loads(events[len("data: "):events.index("\n\n")])["error"]
    assert error == {"message": error["message"], "type": "server_error", "param": None,
                     "code": "server_shutting_down"}
    assert "shutting down" in error["message"]
    assert events == sse(ResponseShape.error_event(error["message"], "server_error",
                                                   "server_shutting_down")) + DONE


async def test_shutdown_mid_json_body_ends_it_with_nothing_more():
    app = App(start(), chunk(b'{"partial": '))
    conn = await shut_down_while_serving(app)
    assert app.cancelled
    assert conn.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert conn.body() == b'{"partial": '


async def test_a_response_already_finished_is_left_alone_at_shutdown():
    """The app may still be running (a background task after its response): it is not
    cancelled, and nothing is sent after the response's end."""
    app = App(start(), chunk(b"{}", more=False), listens=True)
    notice = ShutdownNotice()
    guard = RequestGuard(app, max_body_bytes=100, shutdown=notice)
    conn = Connection(body())
    task = await serving(guard, conn, app)
    notice.expire()
    await asyncio.sleep(0.05)
    assert not app.cancelled and not task.done()
    conn.incoming.put_nowait(DISCONNECT)  # the app returns once its client is gone
    await asyncio.wait_for(task, 5)
    assert not app.cancelled
    assert [m["type"] for m in conn.sent] == ["http.response.start", "http.response.body"]
    assert conn.body() == b"{}"


async def test_a_request_after_the_grace_ran_out_is_answered_503_at_once():
    app, notice = App(start(), chunk(b"{}", more=False), returns=True), ShutdownNotice()
    notice.expire()
    guard = RequestGuard(app, max_body_bytes=100, shutdown=notice)
    conn = Connection(body())
    await asyncio.wait_for(guard(scope(), conn.receive, conn.send), 5)
    # Either the app finished first (then its answer stands) or it was stopped with a 503.
    assert conn.ended()
    assert conn.status() in (200, 503)
    if conn.status() == 503:
        assert app.cancelled and shutdown_error(conn)["code"] == "server_shutting_down"


# -- normal answers and clients that leave


async def test_a_normal_answer_passes_through_unchanged_and_nothing_outlives_it():
    answer = (start(), chunk(b'{"ok": ', more=True), chunk(b"true}", more=False))
    app = App(*answer, returns=True)
    guard = RequestGuard(app, max_body_bytes=100)
    conn = Connection(body(b"ab"))
    before = asyncio.all_tasks()
    await asyncio.wait_for(guard(scope(), conn.receive, conn.send), 5)
    assert conn.sent == list(answer)
    assert app.scope == scope()
    assert app.received == [body(b"ab")]  # the body, read up front, handed over whole
    assert not app.cancelled
    await asyncio.sleep(0)
    assert asyncio.all_tasks() == before  # the watcher and the shutdown wait are gone


async def test_a_body_in_pieces_reaches_the_app_as_one():
    app = App(start(), chunk(b"{}", more=False), returns=True)
    guard = RequestGuard(app, max_body_bytes=100)
    conn = Connection(body(b"ab", more=True), body(b"cd", more=True), body(b"e"))
    await asyncio.wait_for(guard(scope(), conn.receive, conn.send), 5)
    assert app.received == [body(b"abcde")]


async def test_a_client_that_leaves_mid_stream_stops_the_work_and_gets_nothing_more():
    app = App(start(EVENT_STREAM), chunk(b"data: {}\n\n"))
    guard = RequestGuard(app, max_body_bytes=100)
    conn = Connection(body())
    task = await serving(guard, conn, app)
    await asyncio.sleep(0.01)
    assert not task.done()  # a stream still running is left to run
    conn.incoming.put_nowait(DISCONNECT)
    await asyncio.wait_for(task, 5)
    assert app.cancelled
    assert len(conn.sent) == 2 and not conn.ended()  # no shutdown tail for a client gone


async def test_the_disconnect_is_passed_on_to_an_app_that_listens():
    app = App(start(EVENT_STREAM), listens=True)
    guard = RequestGuard(app, max_body_bytes=100)
    conn = Connection(body())
    task = await serving(guard, conn, app)
    other = {"type": "http.request", "body": b"", "more_body": False}
    conn.incoming.put_nowait(other)  # not a disconnect: the watch goes on
    await asyncio.sleep(0.02)
    assert not task.done() and app.received[-1] == other
    conn.incoming.put_nowait(DISCONNECT)
    await asyncio.wait_for(task, 5)
    assert app.received[-1] == DISCONNECT


async def test_a_request_cancelled_from_outside_leaves_no_task_behind():
    """uvicorn cancels what is still running as its last resort at shutdown: the guard returns
    only once the app has finished its own cleanup."""
    app = App(start(EVENT_STREAM), cleanup_s=0.05)
    guard = RequestGuard(app, max_body_bytes=100)
    conn = Connection(body())
    before = asyncio.all_tasks()
    task = await serving(guard, conn, app)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert app.cancelled and app.cleaned_up
    await asyncio.sleep(0)
    assert asyncio.all_tasks() == before


async def test_a_shutdown_returns_once_the_app_has_cleaned_up():
    app = App(start(EVENT_STREAM), cleanup_s=0.05)
    conn = await shut_down_while_serving(app)
    assert app.cleaned_up and conn.ended()


async def test_a_client_that_leaves_while_sending_its_body_is_not_answered():
    app = App(returns=True)
    guard = RequestGuard(app, max_body_bytes=100)
    conn = Connection(body(b"ab", more=True), DISCONNECT)
    await asyncio.wait_for(guard(scope(), conn.receive, conn.send), 5)
    assert not app.called and conn.sent == []


# -- framing and body limits


async def test_both_length_headers_are_a_400_that_closes_and_never_reaches_the_app():
    app = App(returns=True)
    guard = RequestGuard(app, max_body_bytes=100)
    conn = Connection(body())
    headers = ((b"content-length", b"2"), (b"transfer-encoding", b"chunked"))
    await asyncio.wait_for(guard(scope(*headers), conn.receive, conn.send), 5)
    assert not app.called
    assert conn.status() == 400 and conn.headers()["connection"] == "close"
    error = json.loads(conn.body())["error"]
    assert error["code"] == "invalid_request_framing" and error["param"] is None
    assert error["type"] == "invalid_request_error"
    assert "Content-Length and Transfer-Encoding" in error["message"]
    assert "RFC 9112" in error["message"]


@pytest.mark.parametrize("headers", [[(b"content-length", b"2")],
                                     [(b"transfer-encoding", b"chunked")]])
async def test_one_length_header_is_fine(headers):
    app = App(start(), chunk(b"{}", more=False), returns=True)
    guard = RequestGuard(app, max_body_bytes=100)
    conn = Connection(body())
    await asyncio.wait_for(guard(scope(*headers), conn.receive, conn.send), 5)
    assert app.called and conn.status() == 200


async def test_a_body_that_does_not_arrive_in_time_is_a_408_that_closes():
    app = App(returns=True)
    guard = RequestGuard(app, max_body_bytes=100, body_timeout_s=0.05)
    conn = Connection(body(b"a", more=True))  # and then nothing
    started = time.perf_counter()
    await asyncio.wait_for(guard(scope(), conn.receive, conn.send), 5)
    assert time.perf_counter() - started < 2
    assert not app.called
    assert conn.status() == 408 and conn.headers()["connection"] == "close"
    error = json.loads(conn.body())["error"]
    assert error["code"] == "request_timeout" and "0.05 s" in error["message"]
    assert "DUET_BODY_TIMEOUT_S" in error["message"]


async def test_a_declared_length_over_the_limit_is_refused_after_draining_what_follows():
    """The 413 waits until the client has sent its body (or left, or LINGER_S passed), so the
    client reads the answer instead of a reset connection."""
    app = App(returns=True)
    guard = RequestGuard(app, max_body_bytes=10)
    conn = Connection(body(b"x" * 8, more=True), body(b"x" * 8, more=True), body(b"x" * 8),
                      body(b"next"))
    await asyncio.wait_for(guard(scope((b"content-length", b"24")), conn.receive, conn.send), 5)
    assert not app.called
    assert conn.status() == 413 and conn.headers()["connection"] == "close"
    error = json.loads(conn.body())["error"]
    assert error["code"] == "request_too_large"
    assert "10 bytes" in error["message"] and "DUET_MAX_BODY_BYTES" in error["message"]
    # Drained up to the body's last piece, and not a message further.
    assert conn.incoming.qsize() == 1


async def test_a_chunked_body_over_the_limit_is_refused_once_it_passes_it():
    app = App(returns=True)
    guard = RequestGuard(app, max_body_bytes=10)
    conn = Connection(body(b"x" * 6, more=True), body(b"x" * 6, more=True), body(b"x"))
    await asyncio.wait_for(guard(scope((b"transfer-encoding", b"chunked")), conn.receive,
                                 conn.send), 5)
    assert not app.called and conn.status() == 413
    assert "10 bytes" in json.loads(conn.body())["error"]["message"]
    assert conn.incoming.qsize() == 0  # the rest drained before answering


async def test_a_body_exactly_at_the_limit_is_accepted():
    app = App(start(), chunk(b"{}", more=False), returns=True)
    guard = RequestGuard(app, max_body_bytes=10)
    conn = Connection(body(b"x" * 6, more=True), body(b"x" * 4))
    await asyncio.wait_for(guard(scope((b"content-length", b"10")), conn.receive, conn.send), 5)
    assert app.received == [body(b"x" * 10)]


async def test_draining_stops_at_a_disconnect():
    conn = Connection(body(b"x", more=True), DISCONNECT, body(b"never read"))
    await asyncio.wait_for(RequestGuard._linger(conn.receive), 5)
    assert conn.incoming.qsize() == 1


async def test_draining_gives_up_after_the_linger_time(monkeypatch):
    monkeypatch.setattr(request_guard, "LINGER_S", 0.05)
    conn = Connection(body(b"x", more=True))  # a client that sends no more
    started = time.perf_counter()
    await asyncio.wait_for(RequestGuard._linger(conn.receive), 5)
    assert time.perf_counter() - started < 1


async def test_other_connections_pass_straight_through():
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["type"])
        seen.append((await receive())["type"])
        await send({"type": "lifespan.startup.complete"})

    conn = Connection({"type": "lifespan.startup"})
    await RequestGuard(app, max_body_bytes=1)({"type": "lifespan"}, conn.receive, conn.send)
    assert seen == ["lifespan", "lifespan.startup"]
    assert conn.sent == [{"type": "lifespan.startup.complete"}]


async def test_a_declared_length_over_the_limit_is_answered_without_waiting_for_the_body(
        monkeypatch):
    monkeypatch.setattr(request_guard, "LINGER_S", 0.05)
    app = App(returns=True)
    guard = RequestGuard(app, max_body_bytes=10, body_timeout_s=30)
    conn = Connection()  # the client waits for an answer before it sends its body
    started = time.perf_counter()
    await asyncio.wait_for(guard(scope((b"content-length", b"11")), conn.receive, conn.send), 5)
    assert time.perf_counter() - started < 1
    assert not app.called and conn.status() == 413


async def test_messages_may_leave_out_the_body_and_more_body_keys():
    """ASGI: a missing body is b"", a missing more_body is False (the last message)."""
    app = App(start(), chunk(b"{}", more=False), returns=True)
    guard = RequestGuard(app, max_body_bytes=100, body_timeout_s=1)
    conn = Connection({"type": "http.request", "more_body": True},
                      {"type": "http.request", "body": b"ab"})
    await asyncio.wait_for(guard(scope(), conn.receive, conn.send), 5)
    assert app.received == [body(b"ab")]


async def test_draining_stops_at_a_message_without_more_body():
    conn = Connection(body(b"x", more=True), {"type": "http.request", "body": b"y"},
                      body(b"never read"))
    await asyncio.wait_for(RequestGuard._linger(conn.receive), 5)
    assert conn.incoming.qsize() == 1


# -- the pieces


def test_the_response_state_follows_what_was_sent():
    state = _ResponseState()
    assert (state.started, state.finished, state.event_stream) == (False, False, False)
    state.update({"type": "http.response.start", "status": 200})  # no headers at all
    assert state.started and not state.event_stream and not state.finished
    state.update(chunk(b"a"))
    assert not state.finished
    state.update({"type": "http.response.body", "body": b"b"})  # more_body absent: the end
    assert state.finished

    stream = _ResponseState()
    stream.update({"type": "http.response.start", "status": 200,
                   "headers": [(b"x-other", b"text/event-stream"),
                               (b"content-type", EVENT_STREAM)]})
    assert stream.started and stream.event_stream
    stream.update({"type": "http.response.trailers"})
    assert not stream.finished

    plain = _ResponseState()
    plain.update(start(b"application/json"))
    assert plain.started and not plain.event_stream
    plain.update(chunk(b"", more=False))
    assert plain.finished


def test_the_shutdown_notice_serves_one_event_loop_after_another():
    """One app may be served from several event loops over its life (the tests do): a wait on
    the second loop must neither fail (an asyncio.Event is bound to its first loop) nor miss
    the expiry."""
    notice = ShutdownNotice()

    async def waits_until_expired() -> bool:
        task = asyncio.create_task(notice.wait())
        await asyncio.sleep(0.01)
        if task.done():
            return False  # woke before the expiry
        notice.expire()
        await asyncio.wait_for(task, 1)
        return True

    async def a_wait_cut_short() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(notice.wait(), 0.01)

    asyncio.run(a_wait_cut_short())  # a first loop, which ends with the notice unexpired
    assert not notice.is_expired
    assert asyncio.run(waits_until_expired())
    assert notice.is_expired
    asyncio.run(asyncio.wait_for(notice.wait(), 1))  # once expired, a new loop's wait returns
