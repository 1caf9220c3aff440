"""A client that goes away stops its generation within a decode step and frees the engine."""

import json
import time

import httpx
import pytest

from server.app import create_app
from server.settings import Settings
from tests.live_server import LiveServer
from tests.server.conftest import FakeFactory

DELAY = 0.05
REPLY = "z" * 200  # 10 s of decoding if nobody stops it


def first_token_after(client, start) -> float:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "next"}], "stream": True,
            "max_tokens": 3}
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                return time.perf_counter() - start
    raise AssertionError("no token")


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_frees_the_engine_for_the_next(models_file, stream):
    trace: list = []
    factory = FakeFactory(token_delay_s=DELAY, reply=REPLY, trace=trace)
    app = create_app(Settings(models_file=models_file), factory)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "long"}], "stream": stream}
    with LiveServer(app) as server:
        if stream:
            with httpx.Client(base_url=server.url, timeout=30) as client:
                with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                    lines = resp.iter_lines()
                    while not next(lines).startswith('data: {"id'):
                        pass
                    next(lines)
                # leaving the block closed the connection mid-stream
        else:
            with httpx.Client(base_url=server.url, timeout=0.5) as client:
                with pytest.raises(httpx.ReadTimeout):
                    client.post("/v1/chat/completions", json=body)
        left_at = time.perf_counter()
        with httpx.Client(base_url=server.url, timeout=30) as client:
            waited = first_token_after(client, left_at)
        app.state.registry.close()
    # The next request got its first token at once, not after the 10 s the first would take.
    assert waited < 1.5, waited
    first = [t for req, t in trace if req == 0]
    # The first request stopped: it made only the tokens of its short life (+ one step).
    assert 0 < len(first) < 40, len(first)
    assert [req for req, _ in trace][-1] == 1
