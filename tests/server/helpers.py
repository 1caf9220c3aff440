"""What the server tests share: a request body, the fake engine's reply, and readers of the
OpenAI shapes (SSE events, the error object)."""

import json

from engines.fake import FakeEngine

REPLY = FakeEngine().reply
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}


def sse_events(text: str) -> list:
    events = []
    for block in text.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            data = block[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_error_shape(body: dict) -> dict:
    """The OpenAI error object, in a JSON answer or an SSE error event: all four fields."""
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], body
    assert isinstance(err["type"], str) and err["type"]
    return err


def assert_openai_error(resp, status, param=None, code=None):
    assert resp.status_code == status, resp.text
    err = assert_error_shape(resp.json())
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err
