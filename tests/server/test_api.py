"""The OpenAI surface over the fake engine: shapes, streaming, parameters, errors."""

import pytest

from engines.fake import ByteTokenizer
from tests.server.conftest import FakeFactory
from tests.server.helpers import CHAT, REPLY, assert_openai_error, sse_events


def test_health_and_models_list_engines(client):
    assert client.get("/health").json()["status"] == "ok"
    data = client.get("/v1/models").json()["data"]
    tiny = next(m for m in data if m["id"] == "tiny")
    engines = {e["name"]: e for e in tiny["engines"]}
    assert engines["torch"]["loaded"] and not engines["mlx"]["loaded"]
    assert tiny["default_engine"] == "torch" and tiny["context_length"] == 512
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"
    assert_openai_error(client.get("/v1/models/nope"), 404, code="model_not_found")


def test_chat_completion_has_usage_and_metrics(client):
    resp = client.post("/v1/chat/completions", json=CHAT)
    body = resp.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": REPLY}
    assert choice["finish_reason"] == "stop"
    prompt_tokens = len(ByteTokenizer().apply_chat_template(CHAT["messages"]))
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(REPLY.encode()) + 1,  # the end-of-sequence token counts
        "total_tokens": prompt_tokens + len(REPLY.encode()) + 1,
        "prompt_tokens_details": {"cached_tokens": 0},  # the fake engine caches nothing
    }
    m = body["metrics"]
    assert m["engine"] == "torch" and m["device"] == "cpu"
    assert m["ttft_ms"] > 0 and m["prefill_tokens_per_s"] > 0 and m["decode_tokens_per_s"] > 0


def test_metrics_carry_the_engines_own_figures(make_client):
    """Each figure is the engine's, for this request: not a default, not another request's."""
    factory = FakeFactory(token_delay_s=0.01, peak_memory_bytes=123_456_789, kv_bytes_per_token=64)
    with make_client(factory) as client:
        body = client.post("/v1/chat/completions", json=CHAT).json()
    m, usage = body["metrics"], body["usage"]
    assert m["peak_memory_bytes"] == 123_456_789
    # The request's share of the pool: the 16-token blocks holding every token it fed (all but
    # the last sampled one).
    assert m["kv_cache_bytes"] == 64 * 16 * -(-(usage["total_tokens"] - 1) // 16)
    # A token every 10 ms: the decode rate is at most 100 tokens/s and not far below it.
    assert 30 < m["decode_tokens_per_s"] <= 101
    assert m["ttft_ms"] >= 9  # the first token took one delay too
    # Prefill runs from the first scheduled step (TTFT counts from arrival, queue included).
    prefill_s = (m["ttft_ms"] - m["queue_ms"]) / 1000
    assert m["prefill_tokens_per_s"] == pytest.approx(usage["prompt_tokens"] / prefill_s, rel=0.02)


def test_chat_stream_follows_openai_framing(make_client):
    # Tokens a few ms apart, as an engine makes them: each gets its own chunk (tokens that
    # arrive together, when the server is behind, share one).
    with make_client(FakeFactory(token_delay_s=0.005)) as client:
        resp = client.post("/v1/chat/completions",
                           json={**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:] if c["choices"])
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "stop" and all(f is None for f in finishes[:-1])
    deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]]
    assert all("\ufffd" not in d for d in deltas) and "".join(deltas) == REPLY
    assert len(deltas) > 3  # it really streamed
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == len(REPLY.encode()) + 1
    assert all(c["usage"] is None for c in chunks[:-1])
    assert usage_chunk["metrics"]["engine"] == "torch"
    assert chunks[-2]["metrics"]["engine"] == "torch"  # the finishing chunk carries metrics too


def test_stream_without_usage_option_has_no_usage(client):
    events = sse_events(client.post("/v1/chat/completions", json={**CHAT, "stream": True}).text)
    assert all("usage" not in e for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "stop" and "metrics" in events[-2]


def test_text_completion_plain_and_streamed(client):
    body = client.post("/v1/completions", json={"model": "tiny", "prompt": "Once"}).json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == REPLY
    assert body["usage"]["prompt_tokens"] == 4
    events = sse_events(client.post("/v1/completions", json={"model": "tiny", "prompt": ["Once"], "stream": True}).text)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == REPLY
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    tokens = client.post("/v1/completions", json={"model": "tiny", "prompt": [79, 110]}).json()
    assert tokens["usage"]["prompt_tokens"] == 2


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences_are_never_emitted(client, stream):
    stop = ["engine", "zzz"]
    resp = client.post("/v1/chat/completions", json={**CHAT, "stop": stop, "stream": stream})
    if stream:
        events = sse_events(resp.text)[:-1]
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
        reason = events[-1]["choices"][0]["finish_reason"]
    else:
        text, reason = resp.json()["choices"][0]["message"]["content"], resp.json()["choices"][0]["finish_reason"]
    assert text == REPLY[: REPLY.index("engine")] and reason == "stop"


def test_max_tokens_and_max_completion_tokens(client):
    body = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5}).json()
    assert body["choices"][0]["message"]["content"] == REPLY[:5]
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 5
    body = client.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 3}).json()
    assert body["usage"]["completion_tokens"] == 3


def test_engine_field_picks_the_engine(client):
    body = client.post("/v1/chat/completions", json={**CHAT, "engine": "mlx"}).json()
    assert body["metrics"]["engine"] == "mlx"
    models = client.get("/v1/models").json()["data"]
    engines = {e["name"]: e["loaded"] for e in models[0]["engines"]}
    assert engines == {"torch": True, "mlx": True}


def test_content_parts_and_developer_role(client):
    msgs = [{"role": "developer", "content": "Be brief"},
            {"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]}]
    assert client.post("/v1/chat/completions", json={"model": "tiny", "messages": msgs}).status_code == 200
    sent = bytes(client.factory.engines["torch"].calls[-1]).decode()
    assert "<system>Be brief" in sent and "<user>Hi" in sent


def test_unknown_fields_are_ignored(client):
    resp = client.post("/v1/chat/completions", json={**CHAT, "user": "u1", "frequency_penalty": 0})
    assert resp.status_code == 200


@pytest.mark.parametrize(
    "patch, param",
    [
        ({"temperature": 5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"n": 129}, "n"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"engine": "tensorflow"}, "engine"),
        ({"model": None}, "model"),
    ],
)
def test_validation_errors_are_400_with_param(client, patch, param):
    assert_openai_error(client.post("/v1/chat/completions", json={**CHAT, **patch}), 400, param=param)


def test_missing_fields_and_bad_json(client):
    assert_openai_error(client.post("/v1/completions", json={"model": "tiny"}), 400, param="prompt")
    resp = client.post("/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert "not valid JSON" in assert_openai_error(resp, 400)["message"]
    assert_openai_error(client.post("/v1/completions", json={"model": "tiny", "prompt": [999999]}), 400, param="prompt")


def test_unknown_model_is_404(client):
    err = assert_openai_error(client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"}), 404,
                              param="model", code="model_not_found")
    assert "gpt-9" in err["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_context_length_exceeded(client, stream):
    resp = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 600, "stream": stream})
    assert "512" in assert_openai_error(resp, 400, param="messages", code="context_length_exceeded")["message"]
    long_prompt = {"model": "tiny", "prompt": "x" * 600}
    assert_openai_error(client.post("/v1/completions", json=long_prompt), 400, param="prompt",
                        code="context_length_exceeded")


def test_missing_backend_names_the_extra(make_client):
    with make_client(FakeFactory(available=("torch",))) as client:
        err = assert_openai_error(client.post("/v1/chat/completions", json={**CHAT, "engine": "mlx"}),
                                  400, param="engine", code="engine_unavailable")
        assert "duet[mlx]" in err["message"]


def test_classify_model_cannot_generate(client):
    assert_openai_error(client.post("/v1/chat/completions", json={**CHAT, "model": "sorter"}), 400,
                        param="model")


def test_unknown_route_and_method_use_the_error_shape(client):
    assert_openai_error(client.get("/v1/nothing"), 404)
    assert_openai_error(client.get("/v1/chat/completions"), 405)
