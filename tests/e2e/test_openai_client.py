"""End to end: the official openai client against a live duet on loopback, real default model,
both engines."""

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from engines.models.config import load_models_file
from engines.models.sources import resolve_model_dir
from server.app import create_app
from server.settings import REPO_MODELS_FILE, Settings
from tests.live_server import LiveServer

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m-instruct"
ENGINES = ["torch", "mlx"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(float_models_file):
    # exact comparisons with references and across engines: the float model (conftest)
    with LiveServer(create_app(Settings(models_file=float_models_file))) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    spec = next(s for s in load_models_file(REPO_MODELS_FILE) if s.id == MODEL)
    return AutoTokenizer.from_pretrained(str(resolve_model_dir(spec)))


def chat(client, engine, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, extra_body={"engine": engine}, **kw
    )


@pytest.mark.parametrize("engine", ENGINES)
def test_greedy_answer_mentions_paris(client, engine):
    resp = chat(client, engine, max_tokens=40)
    assert "Paris" in resp.choices[0].message.content
    metrics = resp.model_extra["metrics"]
    assert metrics["engine"] == engine and metrics["decode_tokens_per_s"] > 0
    assert metrics["peak_memory_bytes"] > 0 and metrics["kv_cache_bytes"] > 0


@pytest.mark.parametrize("engine", ENGINES)
def test_stream_equals_plain_text_and_follows_framing(client, engine):
    plain = chat(client, engine, max_tokens=48).choices[0].message.content
    chunks = list(chat(client, engine, max_tokens=48, stream=True,
                       stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    with_choices = [c for c in chunks if c.choices]
    assert [c.choices[0].finish_reason for c in with_choices][:-1] == [None] * (len(with_choices) - 1)
    assert with_choices[-1].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert chunks[-1].model_extra["metrics"]["engine"] == engine
    streamed = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert streamed == plain


@pytest.mark.parametrize("engine", ENGINES)
def test_usage_equals_the_tokenizer_counts(client, engine, hf_tokenizer):
    resp = chat(client, engine, max_tokens=24)
    prompt_ids = hf_tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
    assert resp.usage.prompt_tokens == len(prompt_ids)
    text = resp.choices[0].message.content
    eos = 1 if resp.choices[0].finish_reason == "stop" else 0
    assert resp.usage.completion_tokens == len(hf_tokenizer.encode(text, add_special_tokens=False)) + eos
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


@pytest.mark.parametrize("engine", ENGINES)
def test_text_completion_and_stop(client, engine):
    resp = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12,
                                     temperature=0, extra_body={"engine": engine})
    assert resp.choices[0].text and resp.usage.completion_tokens <= 12
    full = chat(client, engine, max_tokens=40).choices[0].message.content
    cut = full.index("Paris")
    stopped = chat(client, engine, max_tokens=40, stop=["Paris"])
    assert stopped.choices[0].message.content == full[:cut]
    assert stopped.choices[0].finish_reason == "stop"


def test_errors_through_the_client(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=QUESTION)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, "torch", max_tokens=100_000)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, "torch", max_tokens=5, extra_headers={}, top_p=0)
    assert info.value.body["param"] == "top_p"
    models = client.models.list()
    assert MODEL in [m.id for m in models.data]


def test_chat_logprobs_spell_the_answer_on_both_engines(client):
    """Each token's bytes make the message; greedy picks the likeliest token; the two engines
    score the same answer alike."""
    scored = {}
    for engine in ENGINES:
        resp = chat(client, engine, max_tokens=12, logprobs=True, top_logprobs=3)
        choice = resp.choices[0]
        content = choice.logprobs.content
        assert b"".join(bytes(t.bytes) for t in content).decode() == choice.message.content
        for t in content:
            assert t.logprob <= 0 and len(t.top_logprobs) == 3
            assert t.top_logprobs[0].token == t.token
            assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-6)
        scored[engine] = [(t.token, t.logprob) for t in content]
    assert [t for t, _ in scored["torch"]] == [t for t, _ in scored["mlx"]]
    for (_, a), (_, b) in zip(scored["torch"], scored["mlx"]):
        assert a == pytest.approx(b, abs=0.05)


@pytest.mark.parametrize("engine", ENGINES)
def test_completion_logprobs_through_the_client(client, engine):
    resp = client.completions.create(model=MODEL, prompt="The capital of France is",
                                     max_tokens=5, temperature=0, logprobs=2,
                                     extra_body={"engine": engine})
    lp = resp.choices[0].logprobs
    assert "".join(lp.tokens) == resp.choices[0].text
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs) == 5
    assert all(len(top) <= 3 and max(top.values()) == pytest.approx(chosen, abs=1e-6)
               for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_logit_bias_and_penalties_steer_the_default_model(client, engine, hf_tokenizer):
    """A +100 bias makes a token the whole answer; a frequency penalty breaks a pattern that
    greedy decoding repeats."""
    token = hf_tokenizer.encode(" banana", add_special_tokens=False)[0]
    forced = chat(client, engine, max_tokens=4, logit_bias={str(token): 100})
    assert forced.choices[0].message.content == hf_tokenizer.decode([token] * 4)
    prompt = "1, 1, 1, 1, 1, 1, 1, 1,"
    runs = {}
    for penalty in (0.0, 2.0):
        resp = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=16,
                                         frequency_penalty=penalty,
                                         extra_body={"engine": engine, "ignore_eos": True})
        runs[penalty] = resp.choices[0].text
    assert runs[0.0].count("1") >= 4, runs  # greedy repeats the pattern
    assert runs[2.0].count("1") <= 2, runs  # penalized, it leaves it


class City(BaseModel):
    name: str = Field(max_length=20)
    population_millions: float
    landmarks: list[str] = Field(max_length=2)
    kind: Literal["capital", "other"]
    nickname: str | None = None


@pytest.mark.parametrize("engine", ENGINES)
def test_structured_output_parses_into_the_clients_model(client, engine):
    """The openai client's parse() sends a strict json_schema (nested, array, enum, optional);
    the 135M model's answer always parses and validates, while a plain request runs beside."""
    plain = chat(client, engine, max_tokens=20).choices[0].message.content

    def structured():
        return client.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": "Describe Paris as JSON."}],
            temperature=0, max_tokens=120, response_format=City, extra_body={"engine": engine})

    with ThreadPoolExecutor(2) as pool:
        parsed = pool.submit(structured)
        beside = pool.submit(chat, client, engine, max_tokens=20)
        city = parsed.result().choices[0].message.parsed
        assert beside.result().choices[0].message.content == plain
    assert isinstance(city, City) and city.kind in ("capital", "other")


@pytest.mark.parametrize("engine", ENGINES)
def test_json_object_mode_gives_a_json_object(client, engine):
    resp = chat(client, engine, max_tokens=120, response_format={"type": "json_object"})
    value = json.loads(resp.choices[0].message.content)
    assert isinstance(value, dict)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 40},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"]}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def test_forced_tool_calls_have_valid_arguments_and_stream_the_same(client):
    """On the torch engine: MLX's CPU backend prefills the tools' prompt at a few tokens a
    second on an AVX2-only machine (tests/engines/test_grammar.py forces calls on both)."""
    import jsonschema

    engine = "torch"

    def ask(choice, stream=False):
        return client.chat.completions.create(
            model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL, TIME_TOOL],
            tool_choice=choice, temperature=0, max_tokens=80, stream=stream,
            extra_body={"engine": engine})

    for choice, name in (("required", None), ({"type": "function",
                                               "function": {"name": "get_time"}}, "get_time")):
        resp = ask(choice)
        out = resp.choices[0]
        assert out.finish_reason == "tool_calls" and out.message.tool_calls
        for call in out.message.tool_calls:
            tool = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments),
                                tool["function"]["parameters"])
            assert name is None or call.function.name == name
    # The last one again, streamed (greedy: the same completion).
    streamed, finish = {}, None
    for chunk in ask(choice, stream=True):
        if not chunk.choices:
            continue
        for tc in chunk.choices[0].delta.tool_calls or []:
            entry = streamed.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [streamed[i] for i in sorted(streamed)] == [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in out.message.tool_calls]


def test_a_tool_result_goes_back_and_the_model_answers(client):
    engine = "torch"  # the conversation's rendering is the server's, the same for both
    first = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL], tool_choice="required",
        temperature=0, max_tokens=80, extra_body={"engine": engine})
    call = first.choices[0].message.tool_calls[0]
    messages = ASK_WEATHER + [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], temperature=0, max_tokens=16,
        extra_body={"engine": engine})
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.choices[0].message.content or second.choices[0].message.tool_calls


def test_tokenizer_endpoints_use_the_models_tokenizer(server, hf_tokenizer):
    import httpx

    text = "The capital of France is Paris."
    got = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert got["tokens"] == hf_tokenizer.encode(text) and got["max_model_len"] == 2048
    back = httpx.post(server.url + "/detokenize", json={"tokens": got["tokens"]}).json()
    assert back["prompt"] == text
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] == hf_tokenizer.eos_token and info["chat_template"]


@pytest.mark.parametrize("engine", ENGINES)
def test_n_seeded_siblings_differ_and_repeat(client, engine):
    def ask():
        resp = client.chat.completions.create(model=MODEL, messages=QUESTION, n=2, seed=5,
                                              temperature=1.0, max_tokens=5,
                                              extra_body={"engine": engine})
        return [c.message.content for c in sorted(resp.choices, key=lambda c: c.index)]

    first = ask()
    assert len(set(first)) > 1 and ask() == first


def test_lists_of_token_id_prompts_as_lm_eval_sends_them(client, hf_tokenizer):
    prompts = [hf_tokenizer.encode("The capital of France is"), hf_tokenizer.encode("1, 2, 3,")]
    resp = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0)
    alone = [client.completions.create(model=MODEL, prompt=[p], max_tokens=4,
                                       temperature=0).choices[0].text for p in prompts]
    assert [c.text for c in sorted(resp.choices, key=lambda c: c.index)] == alone


def test_echo_scores_a_continuation_as_lm_eval_asks(client, hf_tokenizer):
    """lm-eval's loglikelihood request (the context and continuation's ids, echo, max_tokens 0,
    logprobs 1): the continuation's log-probability is transformers' on the same weights, and
    the MLX engine (scoring apart from its batch) agrees."""
    import torch
    from transformers import AutoModelForCausalLM

    context = hf_tokenizer.encode("The capital of France is")
    continuation = hf_tokenizer.encode(" Paris")
    ids = context + continuation
    model = AutoModelForCausalLM.from_pretrained(hf_tokenizer.name_or_path, dtype=torch.float32)
    with torch.no_grad():
        scores = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    expected = sum(float(scores[i - 1, ids[i]]) for i in range(len(context), len(ids)))
    for engine in ENGINES:
        resp = client.completions.create(model=MODEL, prompt=[ids], max_tokens=0, echo=True,
                                         logprobs=1, temperature=0,
                                         extra_body={"engine": engine})
        lp = resp.choices[0].logprobs
        assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
        got = sum(lp.token_logprobs[len(context):])
        assert got == pytest.approx(expected, abs=1e-3 if engine == "torch" else 0.05), engine
        assert resp.choices[0].text == hf_tokenizer.decode(ids)


# The Responses API (client.responses), on the same live server.

RESPONSE_WEATHER = {"type": "function", "name": "get_weather", "strict": True,
                    "description": WEATHER_TOOL["function"]["description"],
                    "parameters": WEATHER_TOOL["function"]["parameters"]}


@pytest.mark.parametrize("engine", ENGINES)
def test_responses_answer_as_chat_does_and_stream_the_same(client, engine):
    ask = {"model": MODEL, "input": QUESTION[0]["content"], "temperature": 0,
           "max_output_tokens": 16, "extra_body": {"engine": engine}}
    resp = client.responses.create(**ask)
    assert resp.output_text == chat(client, engine, max_tokens=16).choices[0].message.content
    assert "Paris" in resp.output_text and resp.status in ("completed", "incomplete")
    assert resp.usage.output_tokens > 0 and resp.model_extra["metrics"]["engine"] == engine
    events = list(client.responses.create(**ask, stream=True))
    assert events[0].type == "response.created" and events[-1].type == f"response.{resp.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == resp.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == resp.usage.output_tokens


def test_responses_forced_tool_call_streams_the_same_and_its_output_goes_back(client):
    """On the torch engine (the tools' prompt is slow to prefill on MLX's CPU backend)."""
    import jsonschema

    ask = {"model": MODEL, "input": ASK_WEATHER, "tools": [RESPONSE_WEATHER],
           "tool_choice": "required", "temperature": 0, "max_output_tokens": 80,
           "extra_body": {"engine": "torch"}}
    resp = client.responses.create(**ask)
    calls = [item for item in resp.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls)
    jsonschema.validate(json.loads(calls[0].arguments), RESPONSE_WEATHER["parameters"])
    done = [e.item for e in client.responses.create(**ask, stream=True)
            if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert [(c.name, c.arguments) for c in done] == [(c.name, c.arguments) for c in calls]
    # The call and its result go back, whole: duet keeps nothing between requests.
    follow = ASK_WEATHER + [item.model_dump(exclude_none=True) for item in resp.output] + [
        {"type": "function_call_output", "call_id": c.call_id, "output": "18 degrees, sunny"}
        for c in calls]
    second = client.responses.create(model=MODEL, input=follow, tools=[RESPONSE_WEATHER],
                                     temperature=0, max_output_tokens=16,
                                     extra_body={"engine": "torch"})
    assert second.output_text or any(item.type == "function_call" for item in second.output)


def test_responses_parse_follows_the_clients_model(client):
    """text_format: the client sends a strict json_schema text.format (torch engine)."""
    resp = client.responses.parse(
        model=MODEL, input="Describe Paris as JSON.", text_format=City, temperature=0,
        max_output_tokens=120, extra_body={"engine": "torch"})
    assert isinstance(resp.output_parsed, City) and resp.output_parsed.kind in ("capital", "other")


@pytest.mark.parametrize("engine", ENGINES)
def test_a_chats_second_turn_reuses_the_first_turns_kv(client, server, engine):
    """The prefix cache: the second turn's usage counts the first turn's prompt as cached
    (whole 16-token blocks of it on torch), and /metrics the prefill it saved."""
    import httpx

    def metric(name: str) -> float:
        text = httpx.get(server.url + "/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith(name + "{") and f'engine="{engine}"' in line)

    def saved() -> float:
        return metric("duet_prompt_tokens_cached_total")

    before = saved()
    first = chat(client, engine, max_tokens=12)
    messages = [*QUESTION, {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And of Italy?"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                            max_tokens=12, extra_body={"engine": engine})
    cached = second.usage.prompt_tokens_details.cached_tokens
    held = first.usage.prompt_tokens
    assert (held // 16 * 16 if engine == "torch" else held) <= cached < second.usage.prompt_tokens
    assert saved() - before >= cached
    assert metric("duet_engine_prefix_cache_tokens") >= held // 16 * 16  # what it keeps now
