"""Tool calling at the HTTP edge over the fake engine (scripted to answer with a call): tools
and earlier calls in the prompt, calls parsed into message.tool_calls and streamed as
delta.tool_calls chunks that reassemble to them, the refusals; and the module's own pieces
(the parser, the stream's hold-back, the forcing grammar)."""

import json

import pytest

from engines.fake import ByteTokenizer
from engines.grammar import GrammarState
from server.tool_calls import CallHolder, Tool, call_grammar, parse_calls
from tests.server.conftest import FakeFactory
from tests.server.helpers import CHAT, assert_openai_error, sse_events

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture
def calling(make_client, models_file):
    # The tools' description takes room: a context of 2048 bytes (the fake's tokens).
    models_file.write_text(models_file.read_text().replace("context_length = 512",
                                                           "context_length = 2048"))
    factory = FakeFactory(reply="Let me look. " + CALL, max_prefill_tokens=4096)  # whole prompts
    with make_client(factory) as client:
        yield client, factory


def test_a_call_in_the_completion_is_a_tool_call(calling):
    client, factory = calling
    body = client.post("/v1/chat/completions", json={**CHAT, "tools": [WEATHER]}).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert choice["message"]["content"] == "Let me look."
    # The fake engine's template takes no tools: they were offered in a system message.
    prompt = bytes(t for t in factory.engines["torch"].calls[-1] if t < 256).decode()
    assert prompt.startswith("<system>") and '"name": "get_weather"' in prompt


def test_streamed_calls_reassemble_to_the_whole_responses(calling):
    client, _ = calling
    ask = {**CHAT, "tools": [WEATHER]}
    whole = client.post("/v1/chat/completions", json=ask).json()["choices"][0]["message"]
    events = sse_events(client.post("/v1/chat/completions", json={**ask, "stream": True}).text)
    chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
    text = "".join(c["delta"].get("content") or "" for c in chunks)
    calls = [tc for c in chunks for tc in c["delta"].get("tool_calls") or []]
    assert [c["function"] for c in calls] == [c["function"] for c in whole["tool_calls"]]
    assert [c["index"] for c in calls] == [0]
    assert text.strip() == whole["content"] and "<tool_call>" not in text
    assert chunks[-1]["finish_reason"] == "tool_calls"
    assert all(c["finish_reason"] is None for c in chunks[:-1])


def test_without_tools_the_same_text_stays_text(calling):
    client, _ = calling
    choice = client.post("/v1/chat/completions", json=CHAT).json()["choices"][0]
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"
    none = client.post("/v1/chat/completions",
                       json={**CHAT, "tools": [WEATHER], "tool_choice": "none"}).json()
    assert "<tool_call>" in none["choices"][0]["message"]["content"]


def test_earlier_calls_and_results_go_back_into_the_prompt(calling):
    client, factory = calling
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    resp = client.post("/v1/chat/completions",
                       json={"model": "tiny", "messages": messages, "tools": [WEATHER]})
    assert resp.status_code == 200, resp.text
    prompt = bytes(t for t in factory.engines["torch"].calls[-1] if t < 256).decode()
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in prompt


@pytest.mark.parametrize("patch, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"if": {}}}}]},
     "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format"),
])
def test_tools_that_cannot_be_used_are_400_naming_the_field(client, patch, param):
    err = assert_openai_error(client.post("/v1/chat/completions", json={**CHAT, **patch}), 400,
                              code="invalid_value")
    assert param in (err["param"] or "") + err["message"]


def test_parse_calls_keeps_what_is_not_a_call_of_a_known_tool():
    text = ("a " + CALL + " b <tool_call>\nnot json\n</tool_call>"
            '<tool_call>{"name": "other", "arguments": {}}</tool_call>')
    rest, calls = parse_calls(text, {"get_weather"})
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert rest.startswith("a  b <tool_call>\nnot json") and "other" in rest
    assert parse_calls(CALL, {"get_weather"})[0] is None
    rest, calls = parse_calls(CALL + "\n" + CALL, {"get_weather"})  # a loop's repeat
    assert rest is None and len(calls) == 1


def test_the_hold_back_lets_text_out_until_a_call_may_begin():
    holder = CallHolder()
    assert holder.feed("Hello <to") == "Hello "  # "<to" may begin a call
    assert holder.feed("day") == "<today"  # it did not
    assert holder.feed(" x <tool_") == " x "
    assert holder.feed('call>{"a": 1}') == ""
    assert holder.feed(" more") == "" and holder.held == '<tool_call>{"a": 1} more'


@pytest.mark.parametrize("parallel", [False, True])
def test_the_forcing_grammar_takes_valid_calls_only(parallel):
    tok = ByteTokenizer()
    tools = (Tool("get_weather", None, WEATHER["function"]["parameters"]),
             Tool("noop", None, {"type": "object", "properties": {}}))
    grammar = call_grammar(tools, parallel)

    def accepts(text):
        state = GrammarState(grammar, tok.grammar_vocabulary(), tok.eos_token_ids)
        ids = tok.encode(text)
        for i in range(len(ids)):
            if not state.allowed(ids[:i], 257)[ids[i]]:
                return False
        return bool(state.allowed(ids, 257)[256])  # the end is allowed there

    assert accepts(CALL)
    assert accepts('<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>')
    assert not accepts('<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>')
    assert not accepts('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>')
    assert not accepts("Sure! " + CALL)
    assert accepts(CALL + "\n" + CALL) == parallel
    assert not accepts("\n".join([CALL] * 3))  # at most as many calls as tools


def test_an_argument_that_holds_the_closing_tag_stays_in_its_call():
    """The grammar of a forced call lets a string argument hold "</tool_call>" (the default
    model wrote {"city": "London}}</tool_call>"} at temperature 0.7): the call is read as its
    JSON, not cut at the first closing tag."""
    city = 'London}}</tool_call>'
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": '
            + json.dumps(city) + '}}\n</tool_call>')
    rest, calls = parse_calls(text, {"get_weather"})
    assert rest is None and len(calls) == 1
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": city}
    # A block that is not JSON still ends at its first closing tag, and stays text.
    rest, calls = parse_calls("<tool_call>{oops</tool_call> then " + text, {"get_weather"})
    assert rest == "<tool_call>{oops</tool_call> then" and len(calls) == 1
