"""End to end: the default model split over three ranks of the CPU (its 9 heads, 3 KV heads and
1,536 MLP units divide by 3) answers the openai client as the same model on one does, streamed
and not, classifies as it does, and /health and /metrics show its ranks."""

import openai
import pytest

from server.app import create_app
from server.settings import Settings
from tests.live_server import LiveServer

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m-instruct"
SPLIT = "smollm2-135m-instruct-split"
QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def server(float_models_file, tmp_path_factory):
    # The float model (exact comparisons), and a second entry of it split over three ranks.
    text = float_models_file.read_text()
    start = text.index(f'id = "{MODEL}"')
    table = text[start:].split("\n\n", 1)[0].replace(f'id = "{MODEL}"', f'id = "{SPLIT}"')
    assert 'engine = "auto"' in table
    table = table.replace('engine = "auto"', 'engine = "torch"')
    path = tmp_path_factory.mktemp("split") / "models.toml"
    path.write_text(text + "\n[[models]]\n" + table + "\ntensor_parallel = 3\n")
    with LiveServer(create_app(Settings(models_file=path, engine="torch"))) as live:
        yield live


def test_a_split_model_answers_as_the_whole_one(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                           timeout=300)

    def chat(model, **kw):
        # 8 tokens: every split step is 60 rounds of gloo sums among three processes of a
        # 2-core CPU (16 took 35 s of a loaded suite).
        return client.chat.completions.create(model=model, messages=QUESTION, temperature=0,
                                              max_tokens=8, **kw)

    whole = chat(MODEL).choices[0].message.content
    split = chat(SPLIT)
    assert split.choices[0].message.content == whole and whole
    assert split.model_extra["metrics"]["peak_memory_bytes"] > 0
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chat(SPLIT, stream=True)
                       if chunk.choices)
    assert streamed == whole

    import httpx

    engines = httpx.get(server.url + "/health").json()["engines"]
    ranks = next(e for e in engines if e["model"] == SPLIT)["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2]
    assert len({r["pid"] for r in ranks}) == 3 and all(r["memory_bytes"] > 0 for r in ranks)
    metrics = httpx.get(server.url + "/metrics").text
    assert f'duet_engine_rank_memory_bytes{{engine="torch",model="{SPLIT}",rank="2"}}' in metrics


def test_a_split_model_classifies_as_the_whole_one(server):
    """Zero-shot classification scores prompts outside the runtime's steps: every rank runs
    those forwards too."""
    import httpx

    def classify(model):
        # One input: each of the split model's forwards is a round of gloo sums over three
        # processes of this CPU (two inputs took 97 s of a 2-core machine).
        body = {"model": model, "input": ["A dull, tiresome film."],
                "labels": ["positive", "negative"]}
        resp = httpx.post(server.url + "/v1/classifications", json=body, timeout=300)
        assert resp.status_code == 200, resp.text
        return [[s["probability"] for s in d["scores"]] for d in resp.json()["data"]]

    for whole, split in zip(classify(MODEL), classify(SPLIT)):
        assert max(abs(a - b) for a, b in zip(whole, split)) < 1e-4
