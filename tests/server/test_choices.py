"""Several choices in one response over the fake engine: lists of prompts (texts, token ids,
lists of token ids) times n, indexed prompt-major, whole and streamed, with usage counting each
prompt once."""

from engines.fake import ByteTokenizer
from tests.server.helpers import CHAT, REPLY, sse_events


def test_prompt_lists_times_n_are_indexed_prompt_major(client):
    body = client.post("/v1/completions", json={"model": "tiny", "prompt": ["Hi", "Hello"],
                                                 "n": 2}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert all(c["text"] == REPLY and c["finish_reason"] == "stop" for c in body["choices"])
    tokens = len(ByteTokenizer().encode(REPLY)) + 1  # and the end token
    assert body["usage"] == {"prompt_tokens": 2 + 5, "completion_tokens": 4 * tokens,
                             "total_tokens": 7 + 4 * tokens,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_lists_of_token_id_lists_are_prompts(client, make_client):
    body = client.post("/v1/completions", json={"model": "tiny", "prompt": [[72, 105], [72]],
                                                 "max_tokens": 3}).json()
    assert [c["text"] for c in body["choices"]] == [REPLY[:3]] * 2
    assert body["usage"]["prompt_tokens"] == 3
    flat = client.post("/v1/completions", json={"model": "tiny", "prompt": [72, 105],
                                                 "max_tokens": 3}).json()
    assert len(flat["choices"]) == 1 and flat["usage"]["prompt_tokens"] == 2


def test_streamed_choices_each_reassemble_and_end_once(client):
    events = sse_events(client.post("/v1/chat/completions", json={
        **CHAT, "n": 3, "stream": True, "stream_options": {"include_usage": True}}).text)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3 * (
        len(ByteTokenizer().encode(REPLY)) + 1)
    texts, finishes, roles = {}, {}, {}
    for event in events[:-2]:
        (choice,) = event["choices"]
        i = choice["index"]
        delta = choice["delta"]
        if "role" in delta:
            roles[i] = delta["role"]
        texts[i] = texts.get(i, "") + (delta.get("content") or "")
        if choice["finish_reason"]:
            assert i not in finishes
            finishes[i] = choice["finish_reason"]
    assert texts == {0: REPLY, 1: REPLY, 2: REPLY}
    assert finishes == {0: "stop", 1: "stop", 2: "stop"} and len(roles) == 3


def test_chat_n_gives_n_choices(client):
    body = client.post("/v1/chat/completions", json={**CHAT, "n": 2}).json()
    assert [c["message"]["content"] for c in body["choices"]] == [REPLY, REPLY]
    assert body["usage"]["prompt_tokens"] == len(ByteTokenizer().apply_chat_template(
        CHAT["messages"]))
