"""POST /v1/embeddings over the fake embed model: OpenAI's shapes, base64, dimensions, token
ids, limits, bad input, models of other tasks, concurrent clients."""

import base64
import threading

import numpy as np
import pytest

from engines.fake import FakeEmbedder
from tests.server.helpers import CHAT, assert_openai_error

EMB = {"model": "embedder", "input": "hello"}
FAKE = FakeEmbedder()


def expected(x):
    return np.array(FAKE.vector(FAKE.tokens(x)), dtype=np.float32)


def post(client, **body):
    resp = client.post("/v1/embeddings", json={**EMB, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_a_list_gets_openai_s_list_of_embeddings_with_usage(client):
    texts = ["hello", "héllo wörld", "a"]
    body = post(client, input=texts)
    assert body["object"] == "list" and body["model"] == "embedder"
    assert [d["object"] for d in body["data"]] == ["embedding"] * 3
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    for d, text in zip(body["data"], texts):
        np.testing.assert_allclose(d["embedding"], expected(text), rtol=1e-6)
    tokens = sum(len(FAKE.tokens(t)) for t in texts)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert body["metrics"]["engine"] == "torch" and body["metrics"]["embeddings_per_s"] > 0
    calls = client.factory.engines["embedder-torch"].calls
    assert len(calls) == 1 and calls[0].inputs == tuple(texts)  # one batched engine call


def test_a_single_string_gives_one_embedding(client):
    body = post(client, input="hello", user="someone")  # user: accepted, not used
    assert len(body["data"]) == 1
    np.testing.assert_allclose(body["data"][0]["embedding"], expected("hello"), rtol=1e-6)


def test_base64_is_little_endian_float32_of_the_same_vector(client):
    floats = post(client, input=["hello", "hi"])["data"]
    coded = post(client, input=["hello", "hi"], encoding_format="base64")["data"]
    for f, c in zip(floats, coded):
        vector = np.frombuffer(base64.b64decode(c["embedding"]), dtype="<f4")
        assert vector.tolist() == f["embedding"]  # float32 both ways: exactly equal


def test_dimensions_keeps_the_first_ones_at_length_one(client):
    body = post(client, input="hello world", dimensions=3)
    got = np.array(body["data"][0]["embedding"])
    cut = expected("hello world")[:3]
    np.testing.assert_allclose(got, cut / np.linalg.norm(cut), rtol=1e-6)
    assert abs(np.linalg.norm(got) - 1) < 1e-6
    whole = post(client, input="hello world", dimensions=8)["data"][0]["embedding"]
    np.testing.assert_allclose(whole, expected("hello world"), rtol=1e-6)
    coded = post(client, input="hello world", dimensions=3, encoding_format="base64")
    vector = np.frombuffer(base64.b64decode(coded["data"][0]["embedding"]), dtype="<f4")
    assert vector.tolist() == body["data"][0]["embedding"]


def test_null_options_mean_their_defaults(client):
    body = post(client, input="hello", encoding_format=None, dimensions=None, user=None)
    np.testing.assert_allclose(body["data"][0]["embedding"], expected("hello"), rtol=1e-6)


def test_token_ids_are_embedded_like_their_text(client):
    ids = list(b"hello")
    one = post(client, input=ids)
    assert len(one["data"]) == 1
    np.testing.assert_allclose(one["data"][0]["embedding"], expected("hello"), rtol=1e-6)
    several = post(client, input=[ids, [104, 105]])
    assert [d["index"] for d in several["data"]] == [0, 1]
    np.testing.assert_allclose(several["data"][1]["embedding"], expected("hi"), rtol=1e-6)


def test_long_inputs_are_truncated_not_refused(client):
    body = post(client, input=["x" * 5000, "y"])
    assert body["usage"]["prompt_tokens"] == FAKE.max_tokens + 3


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),                                    # OpenAI refuses it too
    ({"input": []}, "input"),
    ({"input": ["fine", ""]}, "input[1]"),
    ({"input": [[1, 2], []]}, "input[1]"),
    ({"input": [1, 258]}, "input"),                              # outside the vocabulary
    ({"input": [[1], [2, -1]]}, "input[1]"),
    ({"input": [[1], [10**30]]}, "input[1]"),
    ({"input": 5}, "input"),
    ({"input": [1, "a"]}, "input"),
    ({"input": [True]}, "input"),
    ({"input": [[["deep"]]]}, "input"),
    ({"input": None}, "input"),
    ({"encoding_format": "hex"}, "encoding_format"),
    ({"dimensions": 0}, "dimensions"),
    ({"dimensions": 9}, "dimensions"),                           # more than the model has
    ({"dimensions": "4"}, "dimensions"),
    ({"dimensions": 2.0}, "dimensions"),
    ({"engine": "onnx"}, "engine"),
    ({"model": ""}, "model"),
])
def test_bad_input_is_a_400_naming_the_field(client, body, param):
    assert_openai_error(client.post("/v1/embeddings", json={**EMB, **body}), 400, param=param)


def test_too_many_inputs_is_a_400_and_the_limit_comes_from_settings(make_client):
    with make_client() as c:
        assert post(c, input=["a"] * 2048)["usage"]["prompt_tokens"] == 3 * 2048
        assert_openai_error(c.post("/v1/embeddings", json={**EMB, "input": ["a"] * 2049}), 400,
                            param="input", code="embedding_limit_exceeded")
    with make_client(max_embedding_inputs=2) as c:
        assert_openai_error(c.post("/v1/embeddings", json={**EMB, "input": ["a"] * 3}), 400,
                            param="input", code="embedding_limit_exceeded")


def test_unknown_model_is_a_404(client):
    assert_openai_error(client.post("/v1/embeddings", json={**EMB, "model": "nope"}), 404,
                        code="model_not_found")


@pytest.mark.parametrize("model, task", [("tiny", "generate"), ("sorter", "classify")])
def test_a_model_of_another_task_is_a_400_naming_its_task(client, model, task):
    err = assert_openai_error(client.post("/v1/embeddings", json={**EMB, "model": model}), 400,
                              param="model")
    assert f"task '{task}'" in err["message"] and "'embed'" in err["message"]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {**CHAT, "model": "embedder"}),
    ("/v1/completions", {"model": "embedder", "prompt": "hi"}),
    ("/v1/classifications", {"model": "embedder", "input": "hi", "labels": ["a", "b"]}),
    ("/tokenize", {"model": "embedder", "prompt": "hi"}),
    ("/bench", {"model": "embedder"}),
])
def test_an_embed_model_elsewhere_is_a_400_naming_its_task(client, path, body):
    err = assert_openai_error(client.post(path, json=body), 400, param="model")
    assert "task 'embed'" in err["message"] and "/v1/embeddings" in err["message"]


def test_models_list_the_embed_model_and_either_engine_serves_it(client):
    card = client.get("/v1/models/embedder").json()
    assert card["task"] == "embed" and card["default_engine"] == "torch"
    body = post(client, input="hello", engine="mlx")
    assert body["metrics"]["engine"] == "mlx"
    card = client.get("/v1/models/embedder").json()
    assert {e["name"]: e["loaded"] for e in card["engines"]} == {"torch": False, "mlx": True}


def test_concurrent_clients_each_get_their_own_vectors(client):
    texts = [f"text number {i}" for i in range(12)]
    got, failures = {}, []

    def call(text):
        resp = client.post("/v1/embeddings", json={**EMB, "input": [text, "x" * 40]})
        if resp.status_code != 200:
            failures.append(resp.text)
            return
        got[text] = resp.json()["data"][0]["embedding"]

    threads = [threading.Thread(target=call, args=(t,)) for t in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
    for text in texts:
        np.testing.assert_allclose(got[text], expected(text), rtol=1e-6)
