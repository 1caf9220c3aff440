"""POST /v1/responses over the fake engine: the response object and every stream event parse
as the openai client's models, input items become the chat template's conversation, tool calls
become function_call items, a stream reassembles to the plain answer, and what duet does not
serve (stored state, other tools and items) is a 400 naming the field."""

import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from engines.fake import FakeEngine
from tests.server.conftest import FakeFactory
from tests.server.helpers import REPLY, assert_openai_error

URL = "/v1/responses"
ASK = {"model": "tiny", "input": "Hi"}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
EVENT = TypeAdapter(ResponseStreamEvent)


def events_of(text: str) -> list[dict]:
    """The SSE events: each an `event:` line naming its type and a `data:` line."""
    out = []
    for block in text.split("\n\n"):
        if block.strip():
            kind, data = block.split("\n")
            assert kind.startswith("event: ") and data.startswith("data: "), block
            event = json.loads(data[len("data: "):])
            assert event["type"] == kind[len("event: "):]
            out.append(event)
    return out


def streamed(client, body: dict) -> list[dict]:
    resp = client.post(URL, json={**body, "stream": True})
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = events_of(resp.text)
    for event in events:
        EVENT.validate_python(event)  # the openai client's own models, strictly
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def prompt_of(factory) -> str:
    return bytes(t for t in factory.engines["torch"].calls[-1] if t < 256).decode()


def same_answer(a: dict, b: dict) -> bool:
    """Two responses alike but for their ids, times and speeds."""
    def bare(r):
        keep = {k: v for k, v in r.items()
                if k not in ("id", "created_at", "completed_at", "metrics")}
        keep["output"] = [{k: v for k, v in item.items() if k not in ("id", "call_id")}
                          for item in r["output"]]
        return keep

    return bare(a) == bare(b)


@pytest.fixture
def calling(make_client, models_file):
    # The tools' description takes room: a context of 2048 bytes (the fake's tokens).
    models_file.write_text(models_file.read_text().replace("context_length = 512",
                                                           "context_length = 2048"))
    factory = FakeFactory(reply="Let me look. " + CALL, max_prefill_tokens=4096)
    with make_client(factory) as client:
        yield client, factory


def test_a_response_parses_as_the_clients_response(client):
    body = client.post(URL, json={**ASK, "instructions": "Be brief.", "max_output_tokens": 100,
                                  "metadata": {"k": "v"}, "user": "u"}).json()
    resp = Response.model_validate(body)
    assert resp.output_text == REPLY and resp.status == "completed"
    assert resp.id.startswith("resp_") and resp.object == "response"
    (message,) = resp.output
    assert message.type == "message" and message.id.startswith("msg_")
    assert message.role == "assistant" and message.status == "completed"
    assert message.content[0].annotations == []
    assert resp.incomplete_details is None and resp.error is None
    assert resp.instructions == "Be brief." and resp.max_output_tokens == 100
    assert resp.metadata == {"k": "v"} and resp.user == "u"
    assert resp.tools == [] and resp.tool_choice == "auto" and resp.text.format.type == "text"
    prompt = len(client.factory.engines["torch"].calls[-1])
    assert resp.usage.input_tokens == prompt
    assert resp.usage.output_tokens == len(REPLY.encode()) + 1  # the fake's bytes and EOS
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert body["store"] is False and body["metrics"]["engine"] == "torch"


def test_the_stream_sends_the_events_in_order_and_adds_up_to_the_answer(client):
    plain = client.post(URL, json=ASK).json()
    events = streamed(client, ASK)
    kinds = [e["type"] for e in events]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert kinds == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * len(deltas)
                     + ["response.output_text.done", "response.content_part.done",
                        "response.output_item.done", "response.completed"])
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    text = "".join(e["delta"] for e in deltas)
    assert text == REPLY == events[-4]["text"]
    final = events[-1]["response"]
    assert final["id"] == events[0]["response"]["id"]
    assert Response.model_validate(final).output_text == text
    item_id = final["output"][0]["id"]
    assert all(e["item_id"] == item_id for e in events[3:-2])
    assert same_answer(final, plain)


def test_input_items_make_the_conversation(client):
    body = {"model": "tiny", "instructions": "Be brief.", "input": [
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                                         {"type": "input_text", "text": "!"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Bonjour", "annotations": [],
                      "logprobs": []}]},
        {"role": "user", "content": "Again"}]}
    assert client.post(URL, json=body).status_code == 200
    assert prompt_of(client.factory) == ("<system>Be brief.\n<system>Answer in French.\n"
                                         "<user>Hi!\n<assistant>Bonjour\n<user>Again\n<assistant>")
    client.post(URL, json=ASK)
    assert prompt_of(client.factory) == "<user>Hi\n<assistant>"


def test_calls_in_the_completion_are_function_call_items(calling):
    client, factory = calling
    resp = Response.model_validate(client.post(URL, json={**ASK, "tools": [WEATHER]}).json())
    _, call = resp.output
    assert resp.output_text == "Let me look."  # the whitespace before the call is dropped
    assert call.type == "function_call" and call.id.startswith("fc_")
    assert call.call_id.startswith("call_") and call.status == "completed"
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert resp.tools[0].name == "get_weather" and resp.parallel_tool_calls is True
    # The fake's template takes no tools: they were offered in a system message.
    assert prompt_of(factory).startswith("<system>") and '"name": "get_weather"' in prompt_of(
        factory)
    # Without tools the same text is text.
    plain = Response.model_validate(client.post(URL, json=ASK).json())
    assert [o.type for o in plain.output] == ["message"] and "<tool_call>" in plain.output_text


def test_streamed_calls_reassemble_to_the_plain_response(calling):
    client, _ = calling
    ask = {**ASK, "tools": [WEATHER], "tool_choice": "auto"}
    plain = client.post(URL, json=ask).json()
    events = streamed(client, ask)
    kinds = [e["type"] for e in events]
    n = kinds.count("response.output_text.delta")
    assert kinds == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * n
                     + ["response.output_text.done", "response.content_part.done",
                        "response.output_item.done",
                        "response.output_item.added", "response.function_call_arguments.delta",
                        "response.function_call_arguments.done", "response.output_item.done",
                        "response.completed"])
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "Let me look." and "<tool_call>" not in text
    added, delta, done, item_done = events[-5:-1]
    assert added["item"]["status"] == "in_progress" and added["output_index"] == 1
    assert delta["delta"] == done["arguments"] == item_done["item"]["arguments"]
    assert delta["item_id"] == added["item"]["id"] == item_done["item"]["id"]
    assert same_answer(events[-1]["response"], plain)


def test_a_forced_call_alone_makes_no_message(make_client, models_file):
    models_file.write_text(models_file.read_text().replace("context_length = 512",
                                                           "context_length = 2048"))
    with make_client(FakeFactory(reply=CALL, max_prefill_tokens=4096)) as client:
        ask = {**ASK, "tools": [WEATHER], "tool_choice": {"type": "function",
                                                          "name": "get_weather"}}
        resp = Response.model_validate(client.post(URL, json=ask).json())
        assert [o.type for o in resp.output] == ["function_call"] and resp.output_text == ""
        assert resp.tool_choice.name == "get_weather"
        events = streamed(client, ask)
        assert not [e for e in events if e["type"].startswith("response.output_text")]
        assert same_answer(events[-1]["response"], resp.model_dump(mode="json",
                                                                   exclude_unset=True))


def test_earlier_calls_and_their_outputs_go_back_into_the_prompt(calling):
    client, factory = calling
    call = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
            "arguments": '{"city": "Paris"}', "status": "completed"}
    body = {"model": "tiny", "tools": [WEATHER], "input": [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text",
                                                              "text": "Let me look."}]},
        call,
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C, sunny"}]}
    assert client.post(URL, json=body).status_code == 200, "a call and its output"
    prompt = prompt_of(factory)
    assert ('<assistant>Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call>\n<user><tool_response>\n18 C, sunny\n'
            '</tool_response>\n<assistant>') in prompt
    # A call without a message before it is an assistant turn of its own; an output may be
    # a list of text parts.
    body["input"] = [body["input"][0], call, {"type": "function_call_output",
                                              "call_id": "call_1",
                                              "output": [{"type": "input_text", "text": "18"}]}]
    assert client.post(URL, json=body).status_code == 200
    assert "<user>Weather in Paris?\n<assistant><tool_call>" in prompt_of(factory)
    # An output whose call is not in the input: there is no stored response to find it in.
    body["input"] = [body["input"][0], body["input"][2]]
    err = assert_openai_error(client.post(URL, json=body), 400, param="input[1].call_id")
    assert "call_1" in err["message"] and "stateless" in err["message"]


def test_max_output_tokens_cuts_the_answer_short_as_incomplete(client):
    ask = {**ASK, "max_output_tokens": 5}
    resp = Response.model_validate(client.post(URL, json=ask).json())
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output_text == REPLY[:5] and resp.output[0].status == "incomplete"
    events = streamed(client, ask)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-2]["item"]["status"] == "incomplete"


def test_logprobs_come_with_include_and_add_up_in_the_stream(client):
    ask = {**ASK, "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    resp = Response.model_validate(client.post(URL, json=ask).json())
    entries = resp.output[0].content[0].logprobs
    assert b"".join(bytes(e.bytes) for e in entries).decode() == REPLY
    assert all(len(e.top_logprobs) == 2 for e in entries)
    events = streamed(client, ask)
    sent = [x for e in events if e["type"] == "response.output_text.delta" for x in e["logprobs"]]
    assert sent == events[-4]["logprobs"] == [e.model_dump() for e in entries]
    assert resp.top_logprobs == 2
    # Without the include value, none.
    plain = Response.model_validate(client.post(URL, json={**ASK, "top_logprobs": 2}).json())
    assert plain.output[0].content[0].logprobs == []


class FailsMidway(FakeEngine):
    def before_token(self, request_no, index):
        if request_no == 0 and index == 3:
            raise RuntimeError("the accelerator caught fire")


def test_a_failure_mid_stream_is_an_error_event_then_response_failed(make_client):
    with make_client(FakeFactory(engine_class=FailsMidway)) as client:
        events = streamed(client, ASK)
        error, failed = events[-2:]
        assert error["type"] == "error" and "caught fire" in error["message"]
        assert failed["type"] == "response.failed"
        assert failed["response"]["status"] == "failed"
        assert "caught fire" in failed["response"]["error"]["message"]
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert text == REPLY[:3]
        assert Response.model_validate(client.post(URL, json=ASK).json()).output_text == REPLY


@pytest.mark.parametrize("extra", [
    {"store": False}, {"store": True}, {"background": False}, {"truncation": "disabled"},
    {"reasoning": None}, {"reasoning": {}}, {"reasoning": {"effort": None, "summary": None}},
    {"include": []}, {"include": ["reasoning.encrypted_content"]}, {"parallel_tool_calls": False},
    {"previous_response_id": None}, {"conversation": None}, {"prompt": None},
    {"context_management": []}, {"service_tier": "auto"}, {"prompt_cache_key": "k"},
    {"safety_identifier": "s"}, {"stream_options": {"include_obfuscation": False}},
    {"text": {"format": {"type": "text"}, "verbosity": "low"}}, {"tool_choice": "none"},
    {"temperature": 0, "top_p": 0.5, "seed": 1}, {"temperature": None, "top_p": None},
    {"max_output_tokens": None}, {"instructions": None}, {"max_tool_calls": 3}, {"tools": []},
])
def test_what_asks_for_nothing_duet_lacks_is_accepted(client, extra):
    resp = client.post(URL, json={**ASK, **extra})
    assert resp.status_code == 200, resp.text
    assert Response.model_validate(resp.json()).output_text == REPLY


def test_the_openai_agents_default_request_is_served(calling):
    """What openai-agents' Runner sent (docs/clients.md), with a tool and its strict schema."""
    client, _ = calling
    tool = {"name": "get_weather", "parameters": {
        "properties": {"city": {"title": "City", "type": "string"}}, "required": ["city"],
        "title": "get_weather_args", "type": "object", "additionalProperties": False},
        "strict": True, "type": "function", "description": "Get the current weather in a city."}
    body = {"model": "tiny", "include": [], "input": [{"content": "Weather in Paris?",
                                                       "role": "user"}],
            "max_output_tokens": 64, "temperature": 0.0, "tools": [tool]}
    resp = client.post(URL, json=body, headers={"User-Agent": "Agents/Python 0.24.0"})
    assert resp.status_code == 200, resp.text
    assert Response.model_validate(resp.json()).tools[0].strict is True


@pytest.mark.parametrize("extra, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"conversation": {"id": "conv_1"}}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"reasoning": {"summary": "auto"}}, "reasoning"),
    ({"context_management": [{"type": "compaction"}]}, "context_management"),
    ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    ({"n": 2}, "n"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [WEATHER, {"type": "file_search", "vector_store_ids": ["x"]}]}, "tools[1].type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto",
                                          "tools": []}}, "tool_choice.type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image",
                                              "image_url": "http://x"}]}]},
     "input[0].content[0].type"),
])
def test_what_duet_does_not_serve_is_refused_by_name(client, extra, param):
    err = assert_openai_error(client.post(URL, json={**ASK, **extra}), 400, param=param,
                              code="unsupported_parameter")
    assert param.split(".")[0].split("[")[0] in err["message"]


def test_stateful_refusals_say_duet_is_stateless(client):
    err = assert_openai_error(client.post(URL, json={**ASK, "previous_response_id": "r"}), 400)
    assert "whole conversation" in err["message"]
    err = assert_openai_error(client.post(URL, json={**ASK, "input": [
        {"type": "item_reference", "id": "msg_1"}]}), 400)
    assert "stores no items" in err["message"]


@pytest.mark.parametrize("extra, param", [
    ({"input": None}, "input"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": ["Hi"]}, "input[0]"),
    ({"input": [{"type": []}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": {}}]}]}, "input[0].content[0].type"),
    ({"tools": [{"type": ["function"]}]}, "tools[0].type"),
    ({"tool_choice": {"type": 1}}, "tool_choice.type"),
    ({"text": {"format": {"type": []}}}, "text.format"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user"}]}, "input[0].content"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": "caf\ud800e"}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "caf\ud800e"}]}]},
     "input[0].content[0].text"),
    ({"instructions": 5}, "instructions"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": "10"}, "max_output_tokens"),
    ({"max_output_tokens": 100_000}, "input"),
    ({"temperature": 3}, "temperature"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"if": {}}}}},
     "text.format"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
     "text.format.name"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ({"include": "message.output_text.logprobs"}, "include"),
    ({"store": "no"}, "store"),
    ({"model": "nope"}, "model"),
])
def test_bad_input_is_a_400_naming_the_field(client, extra, param):
    # ASCII JSON: a lone surrogate travels as its escape
    resp = client.post(URL, content=json.dumps({**ASK, **extra}),
                       headers={"content-type": "application/json"})
    status = 404 if param == "model" else 400
    err = assert_openai_error(resp, status)
    assert err["param"] == param, err


def test_a_json_format_is_accepted_and_echoed(client):
    fmt = {"type": "json_schema", "name": "city", "strict": True,
           "schema": {"type": "object", "properties": {"name": {"type": "string"}}}}
    resp = Response.model_validate(client.post(URL, json={**ASK, "text": {"format": fmt}}).json())
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "city"
    assert resp.text.format.schema_ == fmt["schema"]
    ok = client.post(URL, json={**ASK, "text": {"format": {"type": "json_object"}}})
    assert ok.status_code == 200


@pytest.mark.parametrize("method, path", [
    ("GET", "/v1/responses/resp_123"), ("DELETE", "/v1/responses/resp_123"),
    ("GET", "/v1/responses/resp_123/input_items"), ("POST", "/v1/responses/resp_123/cancel"),
])
def test_stored_responses_do_not_exist(client, method, path):
    err = assert_openai_error(client.request(method, path), 404, param="response_id",
                              code="response_not_found")
    assert "resp_123" in err["message"] and "stores no responses" in err["message"]
