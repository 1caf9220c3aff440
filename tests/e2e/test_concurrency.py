"""Many simultaneous requests on the real default model never mix: 16 concurrent greedy
requests with different prompts, chats and text completions, half of them streaming, spread
over both engines, give exactly
what they give one at a time, with the engines on threads of the server or in processes of their
own; and a short request sent while long ones stream finishes long
before them (it joins the running batch instead of waiting for it)."""

import asyncio
import threading
import time

import httpx
import openai
import pytest

from server.app import create_app
from server.settings import Settings
from tests.live_server import LiveServer

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m-instruct"
TOPICS = ["France", "Japan", "the Moon", "rain", "cats", "bread", "music", "winter", "the sea",
          "trees", "chess", "coffee", "Mars", "bees", "paper", "bridges"]


def is_chat(i: int) -> bool:
    return i % 4 < 2


def ask(i: int) -> dict:
    """Request i: a chat or a text completion (short prompts: MLX's CPU backend prefills about
    10 tokens a second here)."""
    topic = TOPICS[i]
    if is_chat(i):
        return {"messages": [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": f"Say one fact about {topic}."}],
                **common(i)}
    return {"prompt": f"One fact about {topic}:", **common(i)}


def common(i: int) -> dict:
    return {"model": MODEL, "temperature": 0, "max_tokens": 6, "extra_body": {"engine": engine_of(i)}}


def engine_of(i: int) -> str:
    # MLX's CPU backend takes seconds a request here and gains nothing from a batch, so it gets
    # a quarter of the requests: a plain chat and a streamed completion twice over.
    return "mlx" if i % 8 in (3, 4) else "torch"


async def send(aclient: openai.AsyncOpenAI, i: int, stream: bool) -> str:
    body = ask(i)
    if is_chat(i):
        if stream:
            chunks = await aclient.chat.completions.create(**body, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
        return (await aclient.chat.completions.create(**body)).choices[0].message.content
    if stream:
        chunks = await aclient.completions.create(**body, stream=True)
        return "".join([c.choices[0].text async for c in chunks if c.choices])
    return (await aclient.completions.create(**body)).choices[0].text


def client_for(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)


async def one_at_a_time(url: str) -> list[str]:
    """Each request alone on its engine (plain, not streamed): the torch ones one after
    another while the MLX ones go one after another on theirs."""
    aclient = client_for(url)
    answers: dict[int, str] = {}

    async def in_turn(engine: str) -> None:
        for i in range(len(TOPICS)):
            if engine_of(i) == engine:
                answers[i] = await send(aclient, i, stream=False)

    try:
        await asyncio.gather(in_turn("torch"), in_turn("mlx"))
    finally:
        await aclient.close()
    return [answers[i] for i in range(len(TOPICS))]


async def together(url: str) -> list[str]:
    """The 16 requests at once, half of them streaming."""
    aclient = client_for(url)
    try:
        return await asyncio.gather(*(send(aclient, i, stream=bool(i % 2))
                                      for i in range(len(TOPICS))))
    finally:
        await aclient.close()


def test_sixteen_concurrent_greedy_requests_equal_the_sequential_answers(float_models_file):
    with LiveServer(create_app(Settings(engine_process="off",
                                        models_file=float_models_file))) as server:
        sequential = asyncio.run(one_at_a_time(server.url))
        concurrent = asyncio.run(together(server.url))
    assert len(set(sequential)) > 8  # different prompts really give different answers
    assert concurrent == sequential
    # Each engine in a process of its own (the default on CUDA) answers the same.
    with LiveServer(create_app(Settings(engine_process="on",
                                        models_file=float_models_file))) as server:
        assert asyncio.run(together(server.url)) == sequential


def test_a_short_request_during_long_ones_finishes_long_before_them():
    # the default model as served by default: its GGUF's Q4_1 kept as int4 in groups of 32
    with LiveServer(create_app(Settings())) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
        long_args = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 120,
                     "temperature": 0, "stream": True, "extra_body": {"ignore_eos": True}}
        streaming = threading.Semaphore(0)
        ended: dict[int, float] = {}

        def long(i: int) -> None:
            first = True
            for _ in client.completions.create(**long_args):
                if first:
                    first = False
                    streaming.release()
            ended[i] = time.monotonic()

        threads = [threading.Thread(target=long, args=(i,)) for i in range(3)]
        started = time.monotonic()
        for t in threads:
            t.start()
        for _ in threads:
            assert streaming.acquire(timeout=120)
        sent = time.monotonic()
        short = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4,
                                          temperature=0, extra_body={"ignore_eos": True})
        short_done = time.monotonic()
        for t in threads:
            t.join()
        card = httpx.get(f"{server.url}/v1/models/{MODEL}").json()
    torch_card = next(e for e in card["engines"] if e["name"] == "torch")
    assert card["quantize"] == "auto"
    assert torch_card["quantization"] == "int4, groups of 32 (kept from the GGUF's Q4_1)"
    assert short.usage.completion_tokens == 4
    assert len(ended) == 3
    assert short_done < min(ended.values())  # done before any long one
    assert short_done - sent < 0.35 * (min(ended.values()) - started)
