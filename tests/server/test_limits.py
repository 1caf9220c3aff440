"""Limits: body size, unsupported parameters, message and stop counts, the engine queue and the
per-request time limit."""

import asyncio
import json

import httpx
import pytest

from server.app import create_app
from server.protocol import MAX_MESSAGES
from server.settings import Settings
from tests.live_server import LiveServer
from tests.server.conftest import FakeFactory
from tests.server.helpers import CHAT, assert_error_shape, assert_openai_error, sse_events


def test_a_body_over_the_limit_is_413(make_client):
    with make_client(max_body_bytes=4096) as client:
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
        assert_openai_error(client.post("/v1/chat/completions", json=big), 413,
                            code="request_too_large")

        def chunked():  # no Content-Length: the limit must hold while reading
            yield json.dumps(big).encode()

        resp = client.post("/v1/chat/completions", content=chunked(),
                           headers={"content-type": "application/json"})
        assert_openai_error(resp, 413, code="request_too_large")
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_the_default_body_limit_is_one_mib(client):
    just_over = {**CHAT, "messages": [{"role": "user", "content": "x" * (1024 * 1024)}]}
    assert_openai_error(client.post("/v1/chat/completions", json=just_over), 413)


@pytest.mark.parametrize("path, patch, param", [
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"function_call": {"name": "f"}}, "function_call"),
    ("/v1/chat/completions", {"audio": {"voice": "alloy"}}, "audio"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("/v1/chat/completions", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("/v1/chat/completions", {"web_search_options": {}}, "web_search_options"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
])
def test_unimplemented_parameters_are_400_naming_them(client, path, patch, param):
    base = CHAT if path == "/v1/chat/completions" else {"model": "tiny", "prompt": "Hi"}
    resp = client.post(path, json={**base, **patch})
    err = assert_openai_error(resp, 400, param=param, code="unsupported_parameter")
    assert param in err["message"]


@pytest.mark.parametrize("path, patch, param", [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"n": 0}, "n"),
    ("/v1/completions", {"prompt": ["a"] * 65, "n": 2}, "n"),
    ("/v1/completions", {"prompt": [[1], []]}, "prompt"),
])
def test_log_probability_and_choice_counts_out_of_range_are_400(client, path, patch, param):
    base = CHAT if path == "/v1/chat/completions" else {"model": "tiny", "prompt": "Hi"}
    resp = client.post(path, json={**base, **patch})
    assert_openai_error(resp, 400, param=param, code="invalid_value")


def test_neutral_values_of_unimplemented_parameters_are_accepted(client):
    neutral = {"n": 1, "logprobs": False, "top_logprobs": 0, "logit_bias": {},
               "frequency_penalty": 0, "presence_penalty": 0.0, "tools": [], "tool_choice": "none",
               "response_format": {"type": "text"}, "modalities": ["text"], "user": "u",
               "store": False, "metadata": {"a": "b"}, "service_tier": "auto",
               "parallel_tool_calls": True, "some_future_field": {"x": 1}}
    assert client.post("/v1/chat/completions", json={**CHAT, **neutral}).status_code == 200
    plain = {"model": "tiny", "prompt": "Hi", "best_of": 1, "suffix": "", "logprobs": 0, "echo": False}
    assert client.post("/v1/completions", json=plain).status_code == 200


def test_message_and_stop_counts(client):
    many = {**CHAT, "messages": [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)}
    assert_openai_error(client.post("/v1/chat/completions", json=many), 400, param="messages")
    stops = {**CHAT, "stop": ["a", "b", "c", "d", "e"]}
    assert_openai_error(client.post("/v1/chat/completions", json=stops), 400, param="stop")


@pytest.mark.parametrize("seed, ok", [(-1, True), (2**64 - 1, True), (-(2**63), True),
                                      (2**64, False), (-(2**63) - 1, False)])
def test_seed_range(client, seed, ok):
    resp = client.post("/v1/chat/completions", json={**CHAT, "seed": seed})
    if ok:
        assert resp.status_code == 200
    else:
        assert_openai_error(resp, 400, param="seed")


def test_max_tokens_must_fit_the_context(client):
    assert_openai_error(client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 10**12}),
                        400, code="context_length_exceeded")


def test_a_request_the_kv_cache_could_never_hold_is_400_naming_the_limit(make_client):
    """Within the context but beyond the whole KV pool: refused at once, not left waiting."""
    with make_client(FakeFactory(kv_tokens=64)) as client:
        err = assert_openai_error(
            client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 200}),
            400, param="max_tokens", code="kv_cache_too_small")
        assert "--kv-cache-memory" in err["message"]
        ok = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 8})
        assert ok.status_code == 200, ok.text


async def admitted(client, n: int) -> None:
    """Until the engines hold n jobs (running or waiting), as /health reports them: a sleep
    would race a loaded machine."""
    for _ in range(500):
        engines = (await client.get("/health")).json()["engines"]
        if sum(e["running"] + e["waiting"] for e in engines) >= n:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"fewer than {n} jobs admitted after 10 s: {engines}")


def slow_app(models_file, **settings):
    factory = FakeFactory(token_delay_s=0.05, reply="z" * 40)  # about 2 s per request
    return create_app(Settings(models_file=models_file, **settings), factory), factory


def test_a_full_engine_queue_is_429_with_retry_after(models_file):
    app, factory = slow_app(models_file, max_queue=1)

    async def main(url):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            running = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
            await admitted(client, 1)
            waiting = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
            await admitted(client, 2)
            refused = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
            return refused, await running, await waiting

    with LiveServer(app) as server:
        refused, running, waiting = asyncio.run(main(server.url))
    err = assert_openai_error(refused, 429, code="queue_full")
    assert err["type"] == "rate_limit_error"
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert running.status_code == waiting.status_code == 200
    assert len(factory.engines["torch"].calls) == 2  # the refused one never reached the engine


def test_the_queue_admits_again_once_it_drains(make_client):
    with make_client(max_queue=0) as client:
        for _ in range(3):  # one at a time never fills a queue of zero
            assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
        workers = client.app.state.registry.loaded_workers()
        assert [w.pending for _, _, w in workers] == [0]


def test_the_time_limit_stops_a_plain_request(make_client):
    factory = FakeFactory(token_delay_s=0.05, reply="z" * 40)
    with make_client(factory, request_timeout_s=0.3) as client:
        resp = client.post("/v1/chat/completions", json=CHAT)
        err = assert_openai_error(resp, 504, code="request_timeout")
        assert err["type"] == "timeout_error" and "0.3 s" in err["message"]
        factory.engine_kwargs["token_delay_s"] = 0
        factory.engines["torch"].token_delay_s = 0
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    trace = factory.engines["torch"].trace
    assert sum(1 for req, _ in trace if req == 0) < 20  # the engine stopped, it did not run on


def test_the_time_limit_ends_a_stream_with_an_error_event_then_done(make_client):
    factory = FakeFactory(token_delay_s=0.05, reply="z" * 40)
    with make_client(factory, request_timeout_s=0.5) as client:
        events = sse_events(client.post("/v1/chat/completions", json={**CHAT, "stream": True}).text)
    assert events[-1] == "[DONE]"
    assert assert_error_shape(events[-2])["code"] == "request_timeout"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2])
    assert 0 < len(text) < 40


def test_a_classification_counts_against_the_queue_bound(models_file):
    app, factory = slow_app(models_file, max_queue=1)
    body = {"model": CHAT["model"], "input": "fine", "labels": ["good", "bad"]}

    async def main(url):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            running = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
            await admitted(client, 1)
            waiting = asyncio.create_task(client.post("/v1/classifications", json=body))
            await admitted(client, 2)
            refused = await client.post("/v1/chat/completions", json=CHAT)
            return refused, await running, await waiting

    with LiveServer(app) as server:
        refused, running, waiting = asyncio.run(main(server.url))
    assert_openai_error(refused, 429, code="queue_full")
    assert running.status_code == waiting.status_code == 200
    assert waiting.json()["data"][0]["label"] in ("good", "bad")
