"""Hypothesis over the request models: any JSON either validates into sound engine parameters
or is refused with a ValidationError that maps to a 400 naming a field; nothing else escapes."""

import pytest
from fastapi.exceptions import RequestValidationError
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from server.errors import _validation_message
from server.protocol import MAX_STOP, ChatCompletionRequest, CompletionRequest

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "seed", "stop", "n", "stream", "stream_options", "engine", "echo",
          "logprobs", "top_logprobs", "tools", "tool_choice", "response_format", "frequency_penalty",
          "logit_bias", "min_p", "repetition_penalty", "parallel_tool_calls", "best_of",
          "suffix", "user"]
BASES = {
    ChatCompletionRequest: {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    CompletionRequest: {"model": "m", "prompt": "hi"},
}


def check_sound(req) -> None:
    params = req.to_sampling_params(7)
    assert params.max_tokens == 7
    assert 0.0 <= params.temperature <= 2.0 and 0.0 < params.top_p <= 1.0 and params.top_k >= 0
    assert len(params.stop) <= MAX_STOP and all(params.stop)
    assert params.seed is None or 0 <= params.seed < 2**64
    assert 1 <= req.n <= 128 and len(req.choice_params(7)) == req.n


@pytest.mark.parametrize("model", list(BASES))
@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(patch=st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=5))
def test_any_json_validates_soundly_or_is_a_named_400(model, patch):
    body = {**BASES[model], **patch}
    try:
        req = model.model_validate(body)
    except ValidationError as exc:
        message, param, code = _validation_message(RequestValidationError(exc.errors()))
        assert message and code in ("invalid_value", "unsupported_parameter")
        # It names a field: one of the body's (a nested one starts with its top-level name).
        assert isinstance(param, str) and param.split(".")[0].split("[")[0] in body, (param, body)
        if code == "unsupported_parameter":
            assert param in patch  # it names the field the client sent
        return
    check_sound(req)


@settings(max_examples=200, derandomize=True, database=None, deadline=None)
@given(
    temperature=st.floats(0, 2), top_p=st.floats(0, 1, exclude_min=True),
    top_k=st.integers(0, 10**6), seed=st.none() | st.integers(-(2**63), 2**64 - 1),
    stop=st.lists(st.text(min_size=1, max_size=5), max_size=MAX_STOP),
    max_tokens=st.none() | st.integers(1, 10**9),
    content=st.text(max_size=50),
)
def test_valid_requests_are_accepted_and_kept(temperature, top_p, top_k, seed, stop, max_tokens,
                                              content):
    req = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": content}],
        "temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed, "stop": stop,
        "max_tokens": max_tokens, "frequency_penalty": 0, "logprobs": False, "unknown": [1],
    })
    params = req.to_sampling_params(5)
    assert (params.temperature, params.top_p, params.top_k) == (temperature, top_p, top_k)
    assert params.stop == tuple(stop) and req.requested_max_tokens() == max_tokens
    assert params.seed == (None if seed is None else seed % 2**64)
    assert req.template_messages(True) == [{"role": "user", "content": content}]
    check_sound(req)


@settings(max_examples=300, deadline=None)
@given(text=st.text(min_size=1), chat=st.booleans(), include_usage=st.booleans(),
       model=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,20}", fullmatch=True))
def test_a_templated_text_event_is_the_chunk_sse_would_make(text, chat, include_usage, model):
    from server.streaming import ResponseShape, sse

    shape = ResponseShape(chat=chat, model=model)
    for _ in range(2):  # the template's first use, then a reuse
        assert shape.text_event(text, include_usage) == sse(
            shape.chunk(text, include_usage=include_usage))
