"""Bad input at the edge: every 4xx has a code (and a param where one field is at fault), invalid
text is refused naming its field, and no message echoes more than a short prefix of the input."""

import json

import pytest

from server.errors import ECHO_CHARS
from tests.server.helpers import CHAT, assert_openai_error

LONE = "caf\ud800e"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": LONE}]},
     "messages[0].content"),
    ("/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
     "messages[0].content[0].text"),
    ("/v1/chat/completions", {**CHAT, "stop": [LONE]}, "stop[0]"),
    ("/v1/completions", {"model": "tiny", "prompt": LONE}, "prompt"),
    ("/v1/classifications", {"model": "tiny", "input": LONE, "labels": ["a", "b"]}, "input"),
    ("/v1/classifications", {"model": "tiny", "input": "x", "labels": ["a", LONE]}, "labels[1]"),
])
def test_a_lone_surrogate_is_invalid_value_naming_the_field(client, path, body, param):
    raw = json.dumps(body).encode()  # ASCII JSON: the surrogate travels as the escape \ud800
    resp = client.post(path, content=raw, headers={"content-type": "application/json"})
    err = assert_openai_error(resp, 400, param=param, code="invalid_value")
    assert "surrogate" in err["message"]


def test_a_body_that_is_not_utf8_is_invalid_value(client):
    resp = client.post("/v1/chat/completions", content=b'{"model": "tiny\xff\xfe"}',
                       headers={"content-type": "application/json"})
    err = assert_openai_error(resp, 400, code="invalid_value")
    assert "JSON" in err["message"]


def test_broken_json_is_invalid_value(client):
    resp = client.post("/v1/chat/completions", content=b'{"model": ',
                       headers={"content-type": "application/json"})
    assert_openai_error(resp, 400, code="invalid_value")


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded"])
def test_a_body_that_is_not_sent_as_json_says_so(client, content_type):
    resp = client.post("/v1/chat/completions", content=b'{"model": "tiny"}',
                       headers={"content-type": content_type})
    err = assert_openai_error(resp, 415, code="unsupported_media_type")
    assert "application/json" in err["message"] and content_type in err["message"]


@pytest.mark.parametrize("top_k, ok", [(0, True), (300, True), (2**31 - 1, True), (2**31, False),
                                       (2**62, False), (-1, False)])
def test_top_k_is_bounded_and_a_k_past_the_vocabulary_keeps_every_token(client, top_k, ok):
    resp = client.post("/v1/chat/completions", json={**CHAT, "top_k": top_k, "temperature": 0.7})
    if ok:
        assert resp.status_code == 200, resp.text
    else:
        assert_openai_error(resp, 400, param="top_k", code="invalid_value")


def test_a_huge_model_id_is_not_echoed_back(client):
    huge = "m" * 60000
    err = assert_openai_error(client.get(f"/v1/models/{huge}"), 404, param="model",
                              code="model_not_found")
    assert len(err["message"]) < ECHO_CHARS + 200 and "60000 characters" in err["message"]
    err = assert_openai_error(client.post("/v1/chat/completions", json={**CHAT, "model": huge}),
                              400, param="model", code="invalid_value")
    assert len(err["message"]) < 300


def test_unknown_paths_and_methods_have_codes(client):
    assert_openai_error(client.get("/v1/nothing-here"), 404, code="not_found")
    assert_openai_error(client.delete("/v1/chat/completions"), 405, code="method_not_allowed")


def test_classification_limits_name_their_setting(make_client):
    with make_client(max_classification_inputs=2, max_classification_labels=3,
                     max_label_chars=5) as client:
        for body, param, setting in [
            ({"input": ["a", "b", "c"], "labels": ["x", "y"]}, "input",
             "DUET_MAX_CLASSIFICATION_INPUTS"),
            ({"input": "a", "labels": ["w", "x", "y", "z"]}, "labels",
             "DUET_MAX_CLASSIFICATION_LABELS"),
            ({"input": "a", "labels": ["x", "toolong"]}, "labels[1]", "DUET_MAX_LABEL_CHARS"),
        ]:
            err = assert_openai_error(client.post("/v1/classifications",
                                                  json={"model": "tiny", **body}),
                                      400, param=param, code="classification_limit_exceeded")
            assert setting in err["message"]


@pytest.mark.parametrize("path, patch, param", [
    ("/v1/chat/completions", {"max_tokens": "10"}, "max_tokens"),
    ("/v1/chat/completions", {"max_tokens": True}, "max_tokens"),
    ("/v1/chat/completions", {"stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"temperature": "0.5"}, "temperature"),
    ("/v1/chat/completions", {"seed": 1.5}, "seed"),
    ("/v1/chat/completions", {"logprobs": "true"}, "logprobs"),
    ("/v1/completions", {"logprobs": "2"}, "logprobs"),
    ("/v1/completions", {"echo": 1}, "echo"),
    ("/v1/completions", {"prompt": [1, "2"]}, "prompt"),
    ("/v1/classifications", {"calibrate": "no"}, "calibrate"),
])
def test_fields_are_type_checked_as_strictly_as_openai_does(client, path, patch, param):
    """No coercion: a number sent as a string, a boolean as a number, are refused naming the
    field (lax parsing took "10" as 10 and true as 1)."""
    base = {"/v1/chat/completions": CHAT, "/v1/completions": {"model": "tiny", "prompt": "Hi"},
            "/v1/classifications": {"model": "tiny", "input": "x", "labels": ["a", "b"]}}[path]
    resp = client.post(path, json={**base, **patch})
    err = assert_openai_error(resp, 400, code="invalid_value")
    assert param in (err["param"] or "") + err["message"]


def test_integral_floats_and_ints_for_floats_are_still_numbers(client):
    resp = client.post("/v1/chat/completions", json={**CHAT, "temperature": 0, "top_p": 1,
                                                     "max_tokens": 4})
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("method, path", [("POST", "/v1/no-such-thing"), ("GET", "/v2/models"),
                                          ("DELETE", "/v1/chat/completions")])
def test_an_unknown_route_or_method_names_what_was_asked(client, method, path):
    resp = client.request(method, path)
    err = assert_openai_error(resp, 404 if method != "DELETE" else 405)
    assert f"{method} {path}" in err["message"]


@pytest.mark.parametrize("patch, param", [
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"300": 1}}, "logit_bias"),  # the fake engine's vocabulary is 257 tokens
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
])
def test_sampling_controls_out_of_range_are_400_naming_them(client, patch, param):
    err = assert_openai_error(client.post("/v1/chat/completions", json={**CHAT, **patch}), 400,
                              code="invalid_value")
    assert param in (err["param"] or "") + err["message"]


def test_sampling_controls_in_range_are_accepted(client):
    resp = client.post("/v1/chat/completions", json={
        **CHAT, "logit_bias": {"72": 5, "10": -100}, "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "repetition_penalty": 1.1, "min_p": 0.05})
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("fmt, words", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"if": {}}}}, "if"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "name"),
    ({"type": "json_schema"}, "json_schema"),
    ({"type": "xml"}, "type"),
])
def test_a_response_format_that_cannot_be_followed_is_400_naming_why(client, fmt, words):
    err = assert_openai_error(client.post("/v1/chat/completions",
                                          json={**CHAT, "response_format": fmt}), 400,
                              code="invalid_value")
    assert "response_format" in (err["param"] or "")
    assert words in (err["param"] or "") + err["message"]


@pytest.mark.parametrize("patch, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"properties": {"a": {"$ref": "#/definitions/nope"}}}}}},
     "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "properties": {"a": {"$ref": "#/definitions/nope"}}}}}]}, "tools"),
    ({"max_tokens": "10"}, "max_tokens"),
])
def test_an_error_names_its_field_once(client, patch, param):
    err = assert_openai_error(client.post("/v1/chat/completions", json={**CHAT, **patch}), 400,
                              param=param, code="invalid_value")
    assert err["message"].startswith(f"{param}: ") and f"{param}: {param}" not in err["message"]
