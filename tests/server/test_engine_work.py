"""Every unit of engine work (generation, classification, bench run) is stopped when its client
leaves or its time runs out, and stays counted until the engine thread has let it go; /health
says what each engine is doing and turns degraded when one is stuck."""

import json
import threading
import time

import httpx
import pytest

from engines.fake import FakeEngine
from server.app import create_app
from server.settings import Settings
from tests.live_server import LiveServer
from tests.server.conftest import FakeFactory
from tests.server.helpers import CHAT, assert_openai_error

BIG = {"model": "tiny", "input": [f"text number {i}" for i in range(50)],
       "labels": ["good", "bad", "neutral"]}


def wait_for(predicate, limit_s=10.0, every_s=0.02):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every_s)
    return False


def first_token_seconds(url: str) -> float:
    started = time.perf_counter()
    body = {**CHAT, "stream": True, "max_tokens": 3}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get(
                    "content"):
                return time.perf_counter() - started
    raise AssertionError("no token")


def queue_depth(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    line = next(l for l in text.splitlines() if l.startswith("duet_engine_queue_depth{"))
    return float(line.rsplit(" ", 1)[1])


def test_an_abandoned_classification_stops_and_counts_until_its_thread_lets_go(models_file):
    # Each prompt takes 1 s to score: 102 prompts would hold the engine for 100 s.
    factory = FakeFactory(token_delay_s=1.0)
    app = create_app(Settings(models_file=models_file), factory)
    with LiveServer(app) as server:
        httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 1})  # load
        engine = factory.engines["torch"]
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/classifications", json=BIG, timeout=0.3)
        # The client is gone but the engine is still inside its first prompt: the work is
        # still counted, in the metrics and in /health.
        assert queue_depth(server.url) == 1
        health = httpx.get(server.url + "/health").json()
        assert health["engines"][0]["state"] == "busy" and health["engines"][0]["running"] == 1
        engine.token_delay_s = 0  # so that the chat below is quick once it runs
        waited = first_token_seconds(server.url)
        assert waited < 3, waited  # not the 100 s the classification would have taken
        assert wait_for(lambda: queue_depth(server.url) == 0)
    scored = [c for c in engine.trace if c[1] == "score"]
    assert 1 <= len(scored) <= 2, scored  # it stopped at the next prompt


def test_a_classification_past_the_time_limit_is_504_and_stops(models_file):
    factory = FakeFactory(token_delay_s=0.2)
    app = create_app(Settings(models_file=models_file, request_timeout_s=0.5), factory)
    with LiveServer(app) as server:
        resp = httpx.post(server.url + "/v1/classifications", json=BIG, timeout=30)
        err = assert_openai_error(resp, 504, code="request_timeout")
        assert "0.5 s" in err["message"]
        registry = app.state.registry
        assert wait_for(lambda: all(w.pending == 0 for _, _, w in registry.loaded_workers()),
                        limit_s=2)
    scored = [c for c in factory.engines["torch"].trace if c[1] == "score"]
    assert len(scored) <= 5, len(scored)  # 0.5 s of 0.2 s prompts, not all 102


def test_a_bench_run_counts_in_the_queue_depth_and_health(models_file):
    factory = FakeFactory(token_delay_s=0.05, reply="x" * 64)
    app = create_app(Settings(models_file=models_file), factory)
    with LiveServer(app) as server:
        body = {"engines": ["torch"], "max_tokens": 64, "repeats": 2, "warmup": 0, "stream": True}
        stop = threading.Event()

        def bench():
            with httpx.stream("POST", server.url + "/bench", json=body, timeout=60) as resp:
                for _ in resp.iter_lines():
                    if stop.is_set():
                        return

        thread = threading.Thread(target=bench)
        thread.start()
        try:
            assert wait_for(lambda: queue_depth(server.url) == 1)
            engines = httpx.get(server.url + "/health").json()["engines"]
            assert engines[0]["state"] == "busy" and engines[0]["running"] == 1
            assert [w.status().kind for _, _, w in app.state.registry.loaded_workers()] == ["bench"]
        finally:
            stop.set()
            thread.join(30)
        assert wait_for(lambda: queue_depth(server.url) == 0)


def test_health_shows_running_and_waiting_work(models_file):
    factory = FakeFactory(token_delay_s=0.05, reply="z" * 40)
    app = create_app(Settings(models_file=models_file), factory)
    with LiveServer(app) as server:
        idle = httpx.get(server.url + "/health").json()["engines"]  # the start-up model
        assert [(e["state"], e["running"], e["waiting"]) for e in idle] == [("idle", 0, 0)]
        threads = [threading.Thread(target=httpx.post, args=(server.url + "/v1/chat/completions",),
                                    kwargs={"json": CHAT, "timeout": 30}) for _ in range(2)]
        for t in threads:
            t.start()
            time.sleep(0.2)
        health = httpx.get(server.url + "/health").json()
        for t in threads:
            t.join()
        after = httpx.get(server.url + "/health").json()
    state = health["engines"][0]
    assert health["status"] == "ok"
    assert (state["model"], state["engine"], state["state"]) == ("tiny", "torch", "busy")
    assert (state["running"], state["waiting"]) == (1, 1)
    assert state["busy_s"] >= 0 and state["busy_since"].endswith("+00:00")
    assert after["engines"][0]["state"] == "idle" and after["engines"][0]["waiting"] == 0


class StubbornEngine(FakeEngine):
    """Scores without ever asking whether it should stop: an engine wedged in one call."""

    def score_continuations(self, prompts, continuations, should_stop=None):
        time.sleep(2.0)
        return super().score_continuations(prompts, continuations)


def test_health_is_degraded_while_an_engine_is_stuck_past_the_time_limit(models_file):
    settings = Settings(models_file=models_file, request_timeout_s=0.3, stuck_grace_s=0.3)
    app = create_app(settings, FakeFactory(engine_class=StubbornEngine))
    with LiveServer(app) as server:
        httpx.post(server.url + "/v1/chat/completions", json=CHAT)  # load the engine
        assert_openai_error(httpx.post(server.url + "/v1/classifications", json=BIG, timeout=30),
                            504, code="request_timeout")
        time.sleep(0.5)
        degraded = httpx.get(server.url + "/health")
        assert wait_for(lambda: httpx.get(server.url + "/health").status_code == 200, limit_s=5)
        recovered = httpx.get(server.url + "/health").json()
    assert degraded.status_code == 503, degraded.text
    body = degraded.json()
    assert body["status"] == "degraded" and body["engines"][0]["state"] == "stuck"
    assert "torch engine of tiny" in body["reason"] and "0.3 s time limit" in body["reason"]
    assert recovered["status"] == "ok" and recovered["engines"][0]["state"] == "idle"
