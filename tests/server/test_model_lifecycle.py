"""Models loaded on first use, kept for their keep_alive, unloaded when idle, by request or to
make room under --max-loaded-models (server/registry.py, server/residency.py)."""

import threading
import time

import pytest

from server.residency import Residency
from tests.server.conftest import MODELS, FakeFactory
from tests.server.helpers import assert_openai_error

TWO = MODELS + """
[[models]]
id = "other"
source = "path:/unused"
engine = "torch"
context_length = 512
keep_alive = "1h"
"""


class CountingFactory(FakeFactory):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.loads: list[str] = []

    def create(self, name, spec):
        self.loads.append(spec.id)
        return super().create(name, spec)


@pytest.fixture
def make(tmp_path):
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.settings import Settings

    def build(factory=None, **settings):
        path = tmp_path / "models.toml"
        path.write_text(TWO)
        factory = factory or CountingFactory()
        client = TestClient(create_app(Settings(models_file=path, preload=False, **settings),
                                        factory))
        client.factory = factory
        # requests here come one after another: no need to wait out the hand-over grace
        client.app.state.registry.residency.grace_s = 0.05
        return client

    return build


def chat(client, model="tiny", **extra):
    return client.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        **extra})


def card(client, model="tiny"):
    return next(e for e in client.get(f"/v1/models/{model}").json()["engines"]
                if e["name"] == "torch")


def wait_until(predicate, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_residency_keeps_what_was_just_handed_out():
    r = Residency(default_keep_alive_s=None, grace_s=1.0)
    r.used("a", 0.0, now=10.0)
    r.used("b", 5.0, now=11.0)
    r.used("c", None, now=12.0)
    assert r.expired(["a", "b", "c"], now=10.5) == []  # a: past its 0 s, inside the grace
    assert r.expired(["a", "b", "c"], now=13.0) == ["a"]
    assert r.expired(["a", "b", "c"], now=16.5) == ["a", "b"]  # c is kept for good
    assert r.expired(["b", "c"], now=16.5) == ["b"]  # only idle ones are offered
    assert r.least_recent(["a", "b", "c"], now=12.5) == "a"
    assert r.least_recent(["c"], now=12.5) is None  # asked for 0.5 s ago
    r.used("a", 0.0, now=20.0)
    assert r.least_recent(["a", "b", "c"], now=20.5) == "b"


def test_load_and_unload_endpoints(make):
    with make() as client:
        assert card(client)["loaded"] is False
        loaded = client.post("/models/load", json={"model": "tiny"}).json()
        assert loaded["loaded"] and loaded["engine"] == "torch"
        assert loaded["unloads_in_s"] is None  # the server's default: kept
        assert card(client)["loaded"] is True
        assert client.post("/models/unload", json={"model": "tiny"}).json() == {
            "model": "tiny", "unloaded": ["torch"]}
        assert card(client)["loaded"] is False
        assert chat(client).status_code == 200  # loaded again on demand
        assert client.factory.loads == ["tiny", "tiny"]
        assert_openai_error(client.post("/models/unload", json={"model": "nope"}), 404,
                            code="model_not_found")


def test_keep_alive_per_model_per_request_and_by_default(make):
    with make(keep_alive="10m") as client:
        assert chat(client).status_code == 200
        assert 590 < card(client)["unloads_in_s"] <= 600  # the server's --keep-alive
        assert chat(client, "other").status_code == 200
        assert card(client, "other")["unloads_in_s"] > 3500  # the model's own: 1h
        assert chat(client, keep_alive="-1").status_code == 200
        assert card(client)["unloads_in_s"] is None  # this request's
        assert chat(client, keep_alive=0).status_code == 200
        # 0: unloaded once the request is done; the other model stays
        assert wait_until(lambda: card(client)["loaded"] is False)
        assert card(client, "other")["loaded"] is True
        health = client.get("/health").json()
        assert [e["model"] for e in health["engines"]] == ["other"]
        assert_openai_error(chat(client, keep_alive="soon"), 400, param="keep_alive")


def test_max_loaded_models_unloads_the_least_recently_used_idle_one(make):
    with make(max_loaded_models=1) as client:
        assert chat(client).status_code == 200
        assert chat(client, "other").status_code == 200
        assert card(client)["loaded"] is False and card(client, "other")["loaded"] is True
        assert chat(client).status_code == 200
        assert client.factory.loads == ["tiny", "other", "tiny"]


def test_max_loaded_models_refuses_while_the_loaded_one_is_busy(make):
    factory = CountingFactory(token_delay_s=0.05)
    with make(factory=factory, max_loaded_models=1) as client:
        assert chat(client).status_code == 200
        done = []
        slow = threading.Thread(target=lambda: done.append(chat(
            client, max_tokens=40, extra_body=None, ignore_eos=True)))
        slow.start()
        assert wait_until(lambda: card(client)["running"] == 1)
        time.sleep(0.1)  # past the hand-over grace
        busy = chat(client, "other")
        assert_openai_error(busy, 503, code="model_unavailable")
        assert "--max-loaded-models 1" in busy.json()["error"]["message"]
        slow.join()
        assert done[0].status_code == 200 and done[0].json()["usage"]["completion_tokens"] == 40
        assert chat(client, "other").status_code == 200
