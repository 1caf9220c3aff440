"""POST /bench's load mode over the fake engine: each level's clients stream through the
server's own HTTP API at once, per engine; the figures add up; limits and refusals."""

import time

import httpx
import pytest

from server.app import create_app
from server.settings import Settings
from tests.live_server import LiveServer
from tests.server.conftest import FakeFactory
from tests.server.helpers import assert_openai_error, sse_events


@pytest.fixture
def live(models_file):
    factory = FakeFactory(token_delay_s=0.005, reply="y" * 40)
    with LiveServer(create_app(Settings(models_file=models_file), factory)) as server:
        yield server, factory


def test_each_level_of_clients_streams_at_once_on_each_engine(live):
    server, factory = live
    body = {"model": "tiny", "clients": [1, 3], "max_tokens": 6, "stream": True}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        events = sse_events(client.post("/bench", json=body).text)[:-1]
    assert events[0]["type"] == "start"
    levels = [e for e in events if e["type"] == "level"]
    assert [(lv["target"], lv["clients"]) for lv in levels] == [
        ("torch", 1), ("torch", 3), ("mlx", 1), ("mlx", 3)]
    for lv in levels:
        assert lv["tokens"] == lv["clients"] * 6  # end-of-sequence ignored: all of max_tokens
        # wall_s is rounded to the millisecond, aggregate_tok_s to a tenth
        wall, rate = lv["wall_s"], lv["aggregate_tok_s"]
        assert lv["tokens"] / (wall + 5e-4) - 0.1 <= rate <= lv["tokens"] / (wall - 5e-4) + 0.1
        assert 0 < lv["ttft_ms_p50"] <= lv["ttft_ms_p99"]
        assert 0 < lv["itl_ms_p50"] <= lv["itl_ms_p99"]
        assert lv["peak_batch"] <= lv["clients"] and lv["client_cpu_share"] >= 0
    # Every client's request reached the engine asked for, each prompt its own.
    for name in ("torch", "mlx"):
        prompts = [bytes(p).decode(errors="replace") for p in factory.engines[name].calls]
        clients = [p for p in prompts if "Client " in p]
        assert len(clients) == 4 and len(set(clients)) == 4
    summary = events[-1]
    assert summary["type"] == "summary" and summary["mode"] == "load"
    assert summary["clients"] == [1, 3] and len(summary["levels"]) == 4
    by = {(lv["target"], lv["clients"]): lv["aggregate_tok_s"] for lv in levels}
    assert summary["ratios"]["torch / mlx @ 3"] == pytest.approx(
        by[("torch", 3)] / by[("mlx", 3)], rel=1e-3)


def test_load_mode_limits_and_refusals(live):
    server, _ = live
    with httpx.Client(base_url=server.url, timeout=60) as client:
        resp = client.post("/bench", json={"model": "tiny", "clients": [1, 65]})
        assert_openai_error(resp, 400, code="bench_limit_exceeded", param="clients")
        resp = client.post("/bench", json={"model": "tiny", "clients": [2, 2]})
        assert resp.status_code == 400
        resp = client.post("/bench", json={"model": "tiny", "clients": [0]})
        assert resp.status_code == 400
        resp = client.post("/bench", json={"model": "tiny", "clients": [1],
                                           "references": ["transformers"]})
        assert resp.status_code == 400
        # A plain JSON answer: the summary of the levels, no per-run list.
        body = client.post("/bench", json={"model": "tiny", "clients": [2], "max_tokens": 3,
                                           "engines": ["torch"]}).json()
        assert [lv["clients"] for lv in body["levels"]] == [2] and "runs" not in body


def test_other_requests_are_told_to_wait_while_a_load_level_runs(models_file):
    """A request from elsewhere would join the level's batch uncounted: it gets a 429 naming
    the bench, with Retry-After, while the level's own clients are served; after the bench,
    requests are served again."""
    import threading

    factory = FakeFactory(token_delay_s=0.05, reply="z" * 64)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with LiveServer(create_app(Settings(models_file=models_file), factory)) as server:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            result = {}
            bench = threading.Thread(target=lambda: result.update(client.post("/bench", json={
                "model": "tiny", "clients": [2], "max_tokens": 40,
                "engines": ["torch"]}).json()))
            bench.start()
            deadline = time.time() + 60
            while not [c for c in factory.engines["torch"].calls if b"Client " in bytes(c)]:
                assert time.time() < deadline
                time.sleep(0.05)
            err = assert_openai_error(client.post("/v1/chat/completions", json=chat), 429,
                                      code="bench_running")
            assert "load benchmark" in err["message"]
            resp = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
            assert resp.status_code == 429 and int(resp.headers["Retry-After"]) > 0
            assert client.get("/health").status_code == 200  # not an engine request
            bench.join(120)
            assert [lv["tokens"] for lv in result["levels"]] == [80]
            assert client.post("/v1/chat/completions", json=chat).status_code == 200


def test_a_client_that_leaves_starts_no_further_level(models_file):
    """A level running when the bench's client hangs up runs out (its streams are bounded by
    max_tokens); no later level starts, and other requests are served again."""
    factory = FakeFactory(token_delay_s=0.02, reply="w" * 64)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with LiveServer(create_app(Settings(models_file=models_file), factory)) as server:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            with client.stream("POST", "/bench", json={
                    "model": "tiny", "clients": [1, 2, 3], "max_tokens": 10,
                    "engines": ["torch"], "stream": True}) as resp:
                for line in resp.iter_lines():
                    if '"type":"level"' in line.replace(" ", ""):
                        break  # the first level is in; now hang up
            # The stream's next level may have started before the hang-up reached the server:
            # it runs out (0.2 s of tokens), and the one after it must not start.
            time.sleep(4.0)
            prompts = [bytes(c) for c in factory.engines["torch"].calls]
            assert [p for p in prompts if b" of 1." in p]
            assert not [p for p in prompts if b" of 3." in p]
            assert client.post("/v1/chat/completions", json=chat).status_code == 200
