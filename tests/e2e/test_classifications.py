"""End to end: zero-shot classification through a live duet on loopback, real default model,
both engines, on the project's labelled sentiment sentences (tests/data/sentiment.jsonl)."""

import json
from pathlib import Path

import httpx
import pytest

from server.app import create_app
from server.settings import Settings
from tests.live_server import LiveServer

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m-instruct"
DATA = Path(__file__).resolve().parents[1] / "data" / "sentiment.jsonl"
ROWS = [json.loads(line) for line in DATA.read_text().splitlines() if line]
INSTRUCTION = "What is the sentiment of the text?"


@pytest.fixture(scope="module")
def server():
    with LiveServer(create_app(Settings())) as live:
        yield live


def classify(server, **body):
    resp = httpx.post(f"{server.url}/v1/classifications", json={"model": MODEL, **body}, timeout=600)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_the_data_is_balanced_and_large_enough():
    labels = [r["label"] for r in ROWS]
    assert len(ROWS) >= 40 and labels.count("positive") == labels.count("negative")


@pytest.mark.parametrize("engine", ["torch", "mlx"])
def test_sentiment_accuracy_is_at_least_80_percent(server, engine):
    body = classify(server, input=[r["text"] for r in ROWS], labels=["positive", "negative"],
                    instruction=INSTRUCTION, engine=engine)
    correct = sum(d["label"] == r["label"] for d, r in zip(body["data"], ROWS))
    assert correct / len(ROWS) >= 0.8, f"{engine}: {correct}/{len(ROWS)}"
    for d in body["data"]:
        assert abs(sum(s["probability"] for s in d["scores"]) - 1.0) < 1e-6
    m = body["metrics"]
    assert m["engine"] == engine and m["classifications_per_s"] > 0 and m["peak_memory_bytes"] > 0
    assert body["usage"]["prompt_tokens"] > 0


def test_engines_agree_and_a_bad_request_leaves_the_server_serving(server):
    text = ["The cake was dry and the coffee was cold."]
    a = classify(server, input=text, labels=["positive", "negative"], engine="torch")
    b = classify(server, input=text, labels=["positive", "negative"], engine="mlx")
    pa = [s["probability"] for s in a["data"][0]["scores"]]
    pb = [s["probability"] for s in b["data"][0]["scores"]]
    # fp32 on the CPU for both engines: the same model gives the same probabilities.
    assert max(abs(x - y) for x, y in zip(pa, pb)) < 1e-3
    bad = httpx.post(f"{server.url}/v1/classifications",
                     json={"model": MODEL, "input": text, "labels": ["yes", "Yes"]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "labels[1]"
    chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=300, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert chat.status_code == 200
