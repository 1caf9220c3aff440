"""Models loaded on first use, kept for their keep_alive, unloaded when idle, by request or to
make room under --max-loaded-models (server/registry.py, server/residency.py)."""

import dataclasses
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

    def create(self, name, spec, kv_cache_limit=None):
        self.loads.append(spec.id)
        return super().create(name, spec, kv_cache_limit)


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


def test_a_model_that_does_not_fit_the_budget_unloads_the_least_recently_used(make):
    # each takes 1000 bytes of weights and, by default, 1000 of KV cache; one full context
    # (512 tokens of 1000 bytes) is the least it can serve with
    factory = CountingFactory(weights_bytes=1000, kv_bytes=600_000)
    with make(factory=factory, memory_budget=1_000_000) as client:
        assert chat(client).status_code == 200
        assert card(client)["loaded"] is True
        assert chat(client, "other").status_code == 200
        # 601,000 held + 513,000 needed > 1,000,000: "tiny" (idle) made room
        assert card(client)["loaded"] is False and card(client, "other")["loaded"] is True
        assert factory.loads == ["tiny", "other"]
        memory = client.get("/health").json()["memory"]
        assert memory == {"budget_bytes": 1_000_000, "held_bytes": 601_000,
                          "by_engine": {"other/torch": 601_000}}


class SplitFactory(CountingFactory):
    """Engines spread over two devices, as a tensor-parallel one is."""

    def create(self, name, spec, kv_cache_limit=None):
        engine = super().create(name, spec, kv_cache_limit)
        engine.info = dataclasses.replace(engine.info, devices=2)
        return engine


def test_the_budget_counts_one_device_of_an_engine_spread_over_two(make):
    """The budget is one device's memory: an engine over two holds half its bytes on each."""
    factory = SplitFactory(weights_bytes=1000, kv_bytes=600_000)
    with make(factory=factory, memory_budget=1_000_000) as client:
        assert chat(client).status_code == 200
        assert client.app.state.registry.held_bytes() == 601_000 // 2
        assert chat(client, "other").status_code == 200  # 300,500 + 513,000 fits: both stay
        assert card(client)["loaded"] is True and factory.loads == ["tiny", "other"]


def test_the_budget_shrinks_a_kv_cache_to_what_is_left(make):
    factory = CountingFactory(weights_bytes=1000, kv_bytes=None)  # None: take what is left
    with make(factory=factory, memory_budget=2_000_000) as client:
        assert chat(client).status_code == 200
        assert chat(client, "other").status_code == 200  # 1,999,000 left: it still loads
        registry = client.app.state.registry
        tiny = registry.loaded_info("tiny", "torch")
        other = registry.loaded_info("other", "torch")
        assert tiny is None  # the first took all that was left, so it had to go
        assert other.kv_cache_bytes == 2_000_000 - 1000
        assert registry.held_bytes() <= 2_000_000


def test_the_budget_is_never_exceeded_while_models_come_and_go_under_load(make):
    factory = CountingFactory(weights_bytes=1000, kv_bytes=600_000, token_delay_s=0.002)
    with make(factory=factory, memory_budget=1_100_000) as client:
        registry = client.app.state.registry
        peaks, stop = [], threading.Event()

        def watch():
            while not stop.is_set():
                peaks.append(registry.held_bytes())
                time.sleep(0.002)

        watcher = threading.Thread(target=watch)
        watcher.start()
        # one after the other first: each load unloads the other model
        results = [chat(client, m) for m in ("tiny", "other", "tiny")]
        assert factory.loads == ["tiny", "other", "tiny"]

        def ask(i):
            for j in range(8):
                results.append(chat(client, ["tiny", "other"][(i + j) % 2], max_tokens=5))
                time.sleep(0.03)  # gaps in which a model is idle and may be unloaded

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        watcher.join()
        # one fits at a time (601,000 each): they take turns, and every answer is a full one
        # or a 503 while the other is busy
        assert max(peaks) <= 1_100_000
        for r in results:
            assert r.status_code in (200, 503), r.text
            if r.status_code == 503:
                assert r.json()["error"]["code"] == "model_unavailable"
        assert any(r.status_code == 200 for r in results)


def test_a_model_larger_than_the_whole_budget_is_refused_at_once(make):
    factory = CountingFactory(weights_bytes=5_000_000, kv_bytes=1000)
    with make(factory=factory, memory_budget=1_000_000) as client:
        r = chat(client)
        assert_openai_error(r, 503, code="model_unavailable")
        assert "more than the whole memory budget" in r.json()["error"]["message"]
        assert factory.loads == []


def test_the_start_up_load_runs_with_the_oldest_generation_held(make_client, monkeypatch):
    """What the server's start imports and loads lives for good: no collection walks it while
    it loads; the collector is as it was once the server started."""
    import gc

    from engines import gc_pauses

    class RecordsItsLoad(CountingFactory):
        def create(self, name, spec, kv_cache_limit=None):
            self.threshold_while_loading = gc.get_threshold()[2]
            return super().create(name, spec, kv_cache_limit)

    monkeypatch.setenv("DUET_GC_FREEZE", "1")
    # the freeze itself is the engine process's test's: this process's garbage must go
    monkeypatch.setattr(gc_pauses, "settle", lambda what, compiled: None)
    usual = gc.get_threshold()
    with make_client(RecordsItsLoad()) as client:
        assert client.factory.threshold_while_loading == gc_pauses.HELD
        assert gc.get_threshold() == usual
        assert chat(client).status_code == 200
