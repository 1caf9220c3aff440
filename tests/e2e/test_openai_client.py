"""End to end: the official openai client against a live duet on loopback, real default model,
both engines."""

import openai
import pytest

from engines.config import load_models_file
from engines.sources import resolve_model_dir
from server.app import create_app
from server.settings import REPO_MODELS_FILE, Settings
from tests.live_server import LiveServer

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m-instruct"
ENGINES = ["torch", "mlx"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    with LiveServer(create_app(Settings())) as live:
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
