"""Log-probabilities in OpenAI's shapes over the fake engine (its token is the likeliest at
log 1/2, the next byte values half as likely each): chat's content entries, the legacy
completions lists, and streamed chunks that reassemble to the whole response's."""

import math

import pytest

from tests.server.helpers import CHAT, REPLY, sse_events

HALF = math.log(0.5)


def test_chat_logprobs_name_every_token_with_its_bytes_and_alternatives(client):
    body = client.post("/v1/chat/completions",
                       json={**CHAT, "logprobs": True, "top_logprobs": 2}).json()
    content = body["choices"][0]["logprobs"]["content"]
    raw = REPLY.encode()
    assert [bytes(e["bytes"]) for e in content] == [bytes([b]) for b in raw]
    assert len(content) == body["usage"]["completion_tokens"] - 1  # the end token is not text
    first = content[0]
    assert first["token"] == "H" and first["logprob"] == HALF
    assert first["top_logprobs"] == [
        {"token": "H", "logprob": HALF, "bytes": [72]},
        {"token": "I", "logprob": math.log(0.25), "bytes": [73]},
    ]
    # A byte of a character alone: its text is U+FFFD, its bytes exact.
    cut = next(e for e in content if e["bytes"][0] >= 0x80)
    assert cut["token"] == "\ufffd"


def test_logprobs_false_or_absent_give_null(client):
    for extra in ({}, {"logprobs": False}):
        body = client.post("/v1/chat/completions", json={**CHAT, **extra}).json()
        assert body["choices"][0]["logprobs"] is None


def test_top_logprobs_zero_gives_the_chosen_tokens_only(client):
    body = client.post("/v1/chat/completions",
                       json={**CHAT, "logprobs": True, "top_logprobs": 0}).json()
    assert all(e["top_logprobs"] == [] for e in body["choices"][0]["logprobs"]["content"])


def test_completions_logprobs_are_parallel_lists_with_offsets(client):
    body = client.post("/v1/completions",
                       json={"model": "tiny", "prompt": "Hi", "logprobs": 1}).json()
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert "".join(lp["tokens"][:27]) == REPLY[:27]  # the ASCII part, token by token
    assert lp["token_logprobs"] == [HALF] * len(lp["tokens"])
    assert lp["text_offset"][:3] == [0, 1, 2]
    # The k likeliest and the chosen token: here the chosen one is the likeliest.
    assert lp["top_logprobs"][0] == {"H": HALF}


def test_streamed_chat_logprobs_reassemble_to_the_whole_responses(client):
    ask = {**CHAT, "logprobs": True, "top_logprobs": 3}
    whole = client.post("/v1/chat/completions", json=ask).json()
    events = sse_events(client.post("/v1/chat/completions", json={**ask, "stream": True}).text)
    streamed = []
    for event in events[:-1]:
        lp = event["choices"][0]["logprobs"]
        if lp is not None:
            streamed += lp["content"]
    assert streamed == whole["choices"][0]["logprobs"]["content"]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert text == REPLY


def test_streamed_completions_logprobs_keep_counting_offsets(client):
    ask = {"model": "tiny", "prompt": "Hi", "logprobs": 0}
    whole = client.post("/v1/completions", json=ask).json()["choices"][0]["logprobs"]
    events = sse_events(client.post("/v1/completions", json={**ask, "stream": True}).text)
    offsets, tokens = [], []
    for event in events[:-1]:
        lp = event["choices"][0]["logprobs"]
        if lp is not None:
            offsets += lp["text_offset"]
            tokens += lp["tokens"]
    assert tokens == whole["tokens"] and offsets == whole["text_offset"]


def test_echo_scores_the_prompt_as_lm_eval_reads_it(client):
    """The fake engine's logits are all zero: every prompt token scores log(1/257)."""
    body = client.post("/v1/completions", json={"model": "tiny", "prompt": [72, 105, 33],
                                                 "echo": True, "max_tokens": 0,
                                                 "logprobs": 1}).json()
    choice = body["choices"][0]
    assert choice["text"] == "Hi!" and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["H", "i", "!"] and lp["text_offset"] == [0, 1, 2]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == [pytest.approx(-math.log(257))] * 2
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_echo_puts_the_prompt_before_the_completion(client):
    body = client.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "echo": True,
                                                 "max_tokens": 2, "logprobs": 0}).json()
    choice = body["choices"][0]
    assert choice["text"] == "Hi" + REPLY[:2]
    lp = choice["logprobs"]
    assert lp["tokens"] == ["H", "i", "H", "e"] and lp["text_offset"] == [0, 1, 2, 3]
    assert lp["token_logprobs"][2:] == [HALF, HALF]
    events = sse_events(client.post("/v1/completions", json={
        "model": "tiny", "prompt": "Hi", "echo": True, "max_tokens": 2, "stream": True}).text)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "Hi" + REPLY[:2]


def test_max_tokens_zero_needs_echo(client):
    resp = client.post("/v1/completions", json={"model": "tiny", "prompt": "Hi",
                                                 "max_tokens": 0})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"


def test_a_token_that_cannot_come_is_given_minus_9999_not_infinity():
    """A grammar's masked alternatives score -inf: JSON cannot carry it and OpenAI's clients
    would not parse it; they read -9999.0, as OpenAI and vLLM give it."""
    import json

    from engines.base import Step, TokenLogprobs
    from server.logprobs import LogprobsFormat
    from server.streaming import to_json

    class Bytes:
        def token_names(self, ids):
            return [(chr(65 + i % 26), (65 + i % 26,)) for i in ids]

    step = Step(1, "B", logprobs=TokenLogprobs(float("-inf"), ((1, -0.5), (2, float("-inf")))))
    chat = json.loads(to_json(LogprobsFormat(True, Bytes()).of([step])))
    assert chat["content"][0]["logprob"] == -9999.0
    assert [e["logprob"] for e in chat["content"][0]["top_logprobs"]] == [-0.5, -9999.0]
    legacy = json.loads(to_json(LogprobsFormat(False, Bytes()).of([step])))
    assert legacy["token_logprobs"] == [-9999.0] and legacy["top_logprobs"][0]["C"] == -9999.0


def test_chunks_carry_numpy_numbers_as_numbers():
    import json

    import numpy as np

    from server.streaming import to_json

    assert json.loads(to_json({"a": np.float32(0.5), "b": np.int64(3), "c": [np.float64(2)]})) \
        == {"a": 0.5, "b": 3, "c": [2.0]}
