"""End to end: embeddings of the real all-MiniLM-L6-v2 through the official openai client
against a live duet on loopback, both engines, checked against sentence-transformers loaded
from the same extracted directory (offline)."""

import base64
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest

from engines.models.config import load_models_file
from engines.models.sources import resolve_model_dir
from server.app import create_app
from server.settings import REPO_MODELS_FILE, Settings
from tests.live_server import LiveServer

pytestmark = pytest.mark.e2e
MODEL = "all-minilm-l6-v2"
ENGINES = ["torch", "mlx"]
TEXTS = [
    "The cat sits outside.",
    "A man is playing guitar.",
    "Où est la bibliothèque ? 图书馆在哪里？ 🙂",
    "   leading and trailing spaces   ",
    "I love pasta",
    # Past the 256 tokens the model keeps: truncated as sentence-transformers truncates.
    " ".join(f"word{i} and some more text" for i in range(120)),
]
SHORT = TEXTS[:2]
COSINE_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model_dir():
    spec = next(s for s in load_models_file(REPO_MODELS_FILE) if s.id == MODEL)
    return resolve_model_dir(spec)


@pytest.fixture(scope="module")
def st_model(model_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        return SentenceTransformer(str(model_dir), device="cpu", local_files_only=True)


@pytest.fixture(scope="module")
def reference(st_model):
    return st_model.encode(TEXTS, convert_to_numpy=True)


@pytest.fixture(scope="module")
def server():
    with LiveServer(create_app(Settings(model=MODEL))) as live:  # loads it on torch at start
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def cosines(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def embed(client, engine, inputs, **kw):
    return client.embeddings.create(model=MODEL, input=inputs, extra_body={"engine": engine}, **kw)


@pytest.mark.parametrize("engine", ENGINES)
def test_vectors_match_sentence_transformers(client, engine, reference, st_model):
    # The openai client asks for base64 by default and decodes it itself.
    resp = embed(client, engine, TEXTS)
    got = np.array([d.embedding for d in resp.data])
    assert got.shape == (len(TEXTS), 384) and [d.index for d in resp.data] == list(range(6))
    deviation = 1 - cosines(got, reference)
    assert deviation.max() < COSINE_TOLERANCE, deviation
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    tokens = int(st_model.tokenize([t.strip() for t in TEXTS])["attention_mask"].sum())
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == tokens
    assert resp.model == MODEL and resp.model_extra["metrics"]["engine"] == engine


@pytest.mark.parametrize("engine", ENGINES)
def test_float_base64_dimensions_and_token_ids(client, engine, reference, st_model):
    coded = embed(client, engine, SHORT)  # base64, decoded by the client
    floats = embed(client, engine, SHORT, encoding_format="float")
    assert [d.embedding for d in floats.data] == [d.embedding for d in coded.data]
    short = embed(client, engine, SHORT, dimensions=64)
    got = np.array([d.embedding for d in short.data])
    cut = reference[:2, :64] / np.linalg.norm(reference[:2, :64], axis=1, keepdims=True)
    assert got.shape == (2, 64) and (1 - cosines(got, cut)).max() < COSINE_TOLERANCE
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    ids = [st_model.tokenizer(t, add_special_tokens=False)["input_ids"] for t in SHORT]
    by_ids = embed(client, engine, ids)
    assert (1 - cosines([d.embedding for d in by_ids.data], reference[:2])).max() < COSINE_TOLERANCE


def test_raw_base64_is_little_endian_float32(server, reference):
    import httpx

    body = httpx.post(f"{server.url}/v1/embeddings", timeout=60, json={
        "model": MODEL, "input": SHORT[0], "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert vector.shape == (384,) and 1 - cosines([vector], reference[:1])[0] < COSINE_TOLERANCE


def test_concurrent_clients_each_get_their_own_vectors(client, reference):
    """Requests from several clients queue on the engine's worker; none disturbs another."""
    jobs = [(TEXTS[i % 5], i % 5) for i in range(10)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: embed(client, "torch", [job[0], TEXTS[5]]), jobs))
    for (_, i), resp in zip(jobs, answers):
        assert 1 - cosines([resp.data[0].embedding], reference[i:i + 1])[0] < COSINE_TOLERANCE


def test_models_of_the_wrong_task_are_refused_by_name(client):
    with pytest.raises(openai.BadRequestError, match="task 'embed'"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.BadRequestError, match="task 'generate'"):
        client.embeddings.create(model="smollm2-135m-instruct", input="Hi")
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model=MODEL, input="Hi", dimensions=385)
    assert {m.id: m.model_extra["task"] for m in client.models.list()}[MODEL] == "embed"
