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
    # Every client's request reached the engine asked for, each prompt its own; each level
    # came after a warm-up round of as many clients, on prompts of their own.
    assert [(e["target"], e["clients"]) for e in events if e["type"] == "warmup"] == [
        ("torch", 1), ("torch", 3), ("mlx", 1), ("mlx", 3)]
    for name in ("torch", "mlx"):
        prompts = [bytes(p).decode(errors="replace") for p in factory.engines[name].calls]
        clients = [p for p in prompts if "Client " in p]
        warm = [p for p in clients if "warm-up 1." in p]
        assert len(clients) == 8 and len(set(clients)) == 8 and len(warm) == 4
    summary = events[-1]
    assert summary["type"] == "summary" and summary["mode"] == "load"
    assert summary["clients"] == [1, 3] and len(summary["levels"]) == 4
    by = {(lv["target"], lv["clients"]): lv["aggregate_tok_s"] for lv in levels}
    assert summary["ratios"]["torch / mlx @ 3"] == pytest.approx(
        by[("torch", 3)] / by[("mlx", 3)], rel=1e-3)


def test_a_sweep_run_again_sends_prompts_of_its_own(live):
    """With the prefix cache on, a second sweep sending the first one's prompts would prefill
    nothing: each run's prompts carry a tag of its own."""
    server, factory = live
    body = {"model": "tiny", "clients": [2], "max_tokens": 2, "engines": ["torch"],
            "warmup": 0}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for _ in range(2):
            assert client.post("/bench", json=body).status_code == 200
    prompts = [bytes(p) for p in factory.engines["torch"].calls if b"Client " in bytes(p)]
    assert len(prompts) == 4 and len(set(prompts)) == 4
    assert len({p.split(b"Run ")[1][:6] for p in prompts}) == 2  # one tag a run


def test_load_mode_limits_and_refusals(live):
    server, _ = live
    with httpx.Client(base_url=server.url, timeout=60) as client:
        resp = client.post("/bench", json={"model": "tiny", "clients": [1, 65]})
        assert_openai_error(resp, 400, code="bench_limit_exceeded", param="clients")
        resp = client.post("/bench", json={"model": "tiny", "clients": [2, 2]})
        assert resp.status_code == 400
        resp = client.post("/bench", json={"model": "tiny", "clients": [0]})
        assert resp.status_code == 400
        # A reference that cannot load (this fake model has no files) is the summary's error;
        # the engine's levels stand, and the server takes other requests again.
        body = client.post("/bench", json={"model": "tiny", "clients": [1], "max_tokens": 2,
                                           "engines": ["torch"],
                                           "references": ["transformers"]}).json()
        assert [lv["target"] for lv in body["levels"]] == ["torch"]
        assert "does not exist" in body["errors"]["transformers"]
        assert client.post("/v1/completions", json={"model": "tiny", "prompt": "hi",
                                                    "max_tokens": 2}).status_code == 200
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


def test_load_mode_on_a_real_model_with_references_and_memory(tiny_dirs, tmp_path):
    """Both engines on a tiny checkpoint, then both references on one batch of the same
    prompts per level; every engine level carries the memory measured alike (the engine
    process's resident set over the level) beside the engine's own meter, named."""
    pytest.importorskip("mlx_lm")
    path, _ = tiny_dirs["llama"]
    registry = tmp_path / "models.toml"
    registry.write_text(f'[[models]]\nid = "tiny-llama"\nsource = "path:{path}"\n'
                        f'engine = "torch"\ndtype = "float32"\ncontext_length = 128\n')
    body = {"model": "tiny-llama", "clients": [1, 2], "max_tokens": 4, "prompts": ["hi there"],
            "references": ["transformers", "mlx-lm"], "stream": True}
    with LiveServer(create_app(Settings(models_file=registry, device="cpu"))) as server:
        with httpx.Client(base_url=server.url, timeout=600) as client:
            events = sse_events(client.post("/bench", json=body).text)[:-1]
    assert [e["name"] for e in events if e["type"] == "target"] == ["transformers", "mlx-lm"]
    summary = events[-1]
    assert summary["errors"] == {}
    levels = {(lv["target"], lv["clients"]): lv for lv in summary["levels"]}
    assert set(levels) == {(t, n) for t in ("torch", "mlx", "transformers", "mlx-lm")
                           for n in (1, 2)}
    for (target, n), lv in levels.items():
        assert lv["tokens"] == 4 * n and lv["aggregate_tok_s"] > 0, target
    for name in ("torch", "mlx"):
        for n in (1, 2):
            lv = levels[(name, n)]
            assert lv["rss_start_bytes"] > 0 and lv["rss_peak_bytes"] >= lv["rss_start_bytes"]
            assert lv["rss_peak_delta_bytes"] == lv["rss_peak_bytes"] - lv["rss_start_bytes"]
            assert lv["engine_peak_memory_bytes"] > 0
    measures = {n: summary["targets"][n]["info"]["memory_measure"] for n in ("torch", "mlx")}
    assert measures == {"torch": "process RSS, sampled each step", "mlx": "MLX allocator peak"}
    assert levels[("transformers", 2)]["ttft_ms_p50"] is None  # a batch has no per-client TTFT
    ratios = summary["ratios"]
    assert ratios["torch / transformers @ 2"] == pytest.approx(
        levels[("torch", 2)]["aggregate_tok_s"] / levels[("transformers", 2)]["aggregate_tok_s"],
        abs=6e-4)  # rounded to three places
    assert "mlx / mlx-lm @ 1" in ratios and "torch / mlx @ 2" in ratios
    assert not [k for k in ratios if k.startswith(("transformers /", "mlx-lm /"))]
