"""Many simultaneous requests on one engine of the real default model never mix: 16 concurrent
greedy requests with different prompts give exactly what they give one at a time."""

import asyncio

import openai
import pytest

from server.app import create_app
from server.settings import Settings
from tests.live_server import LiveServer

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m-instruct"
TOPICS = ["France", "Japan", "the Moon", "rain", "cats", "bread", "music", "winter", "the sea",
          "trees", "chess", "coffee", "Mars", "bees", "paper", "bridges"]


def ask(topic: str) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"Say one fact about {topic}."}],
            "temperature": 0, "max_tokens": 6, "extra_body": {"engine": "torch"}}


def test_sixteen_concurrent_greedy_requests_equal_the_sequential_answers():
    with LiveServer(create_app(Settings())) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
        sequential = [client.chat.completions.create(**ask(t)).choices[0].message.content
                      for t in TOPICS]

        async def together():
            aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                         timeout=300)

            async def one(i: int, topic: str) -> str:
                if i % 2:  # half of them stream
                    stream = await aclient.chat.completions.create(**ask(topic), stream=True)
                    return "".join([c.choices[0].delta.content or "" async for c in stream
                                    if c.choices])
                resp = await aclient.chat.completions.create(**ask(topic))
                return resp.choices[0].message.content

            try:
                return await asyncio.gather(*(one(i, t) for i, t in enumerate(TOPICS)))
            finally:
                await aclient.close()

        concurrent = asyncio.run(together())
    assert len(set(sequential)) > 8  # different prompts really give different answers
    assert concurrent == sequential
