"""POST/GET /bench over the fake engine: summary maths, the event stream, limits, queuing with
normal requests, a client that leaves, the switch in the settings."""

import asyncio
import statistics
import threading
import time
from concurrent.futures import Future

import httpx
import pytest

from engines.bench import core as bench_core
from engines.fake import ByteTokenizer, FakeEngine
from server.app import create_app
from server.settings import Settings
from tests.live_server import LiveServer
from tests.server.conftest import FakeFactory
from tests.server.helpers import assert_openai_error, sse_events

BENCH = {"model": "tiny", "max_tokens": 8, "repeats": 2, "warmup": 1}
N_SHORT = len(bench_core.PRESETS["short"])


def test_json_summary_has_medians_p90_ratios_device_and_versions(client):
    body = client.post("/bench", json=BENCH).json()
    assert set(body["targets"]) == {"torch", "mlx"}  # default: every installed engine
    assert body["environment"]["versions"]["python"]
    for name, summary in body["targets"].items():
        runs = [r for r in body["runs"] if r["target"] == name and not r["warmup"]]
        assert len(runs) == summary["runs"] == N_SHORT * BENCH["repeats"]
        assert {r["prompt"] for r in runs} == set(range(N_SHORT))
        assert all(r["completion_tokens"] == BENCH["max_tokens"] for r in runs)  # EOS ignored
        decode = [r["decode_tokens_per_s"] for r in runs]
        assert summary["decode_tokens_per_s"]["median"] == pytest.approx(statistics.median(decode))
        assert summary["decode_tokens_per_s"]["p90"] == pytest.approx(
            statistics.quantiles(decode, n=10, method="inclusive")[8])
        assert min(decode) <= summary["decode_tokens_per_s"]["p90"] <= max(decode)
        assert summary["info"]["device"] == "cpu" and summary["info"]["backend_version"]
        for key in ("ttft_s", "prefill_tokens_per_s", "peak_memory_bytes", "kv_cache_bytes"):
            assert set(summary[key]) == {"median", "p90"}
    warmups = [r for r in body["runs"] if r["warmup"]]
    assert sorted(r["target"] for r in warmups) == ["mlx", "torch"]
    ratio = body["ratios"]["torch / mlx"]
    t, m = body["targets"]["torch"], body["targets"]["mlx"]
    assert ratio["decode_tokens_per_s"] == pytest.approx(
        t["decode_tokens_per_s"]["median"] / m["decode_tokens_per_s"]["median"])
    assert ratio["peak_memory_bytes"] is None  # the fake engine measures no memory: no NaN


class OffByOneTokenizer(ByteTokenizer):
    """Tokenizes differently from the other fake engine's tokenizer."""

    def encode(self, text):
        return [t + 1 for t in super().encode(text)]

    encode_prompt = encode


class MixedTokenizerEngine(FakeEngine):
    def __init__(self, name, **kwargs):
        super().__init__(name, **kwargs)
        if name == "mlx":
            self.tokenizer = OffByOneTokenizer()


def test_every_engine_gets_the_same_prompt_tokens(make_client):
    """One tokenization for every engine: even where the engines' own tokenizers would
    disagree (they cannot with one model's files, but a per-engine tokenization would then
    compare different prompts), both are fed the very same ids, run by run."""
    with make_client(FakeFactory(engine_class=MixedTokenizerEngine)) as client:
        body = client.post("/bench", json={**BENCH, "preset": "chat", "repeats": 1}).json()
        engines = client.factory.engines
    by_prompt = {}
    for r in body["runs"]:
        by_prompt.setdefault(r["prompt"], set()).add(r["prompt_tokens"])
    assert all(len(counts) == 1 for counts in by_prompt.values())
    calls = {name: e.calls for name, e in engines.items()}
    assert len(calls["torch"]) >= len(body["runs"]) // 2 > 0  # warm-up runs included
    assert calls["torch"] == calls["mlx"]
    assert "<user>What is the capital of France?" in bytes(calls["torch"][1][:-1]).decode()


def test_stream_sends_an_event_per_run_then_a_summary(client):
    resp = client.post("/bench", json={**BENCH, "stream": True, "prompts": ["a b", "c d e"]})
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    kinds = [e["type"] for e in events[:-1]]
    n_runs = 2 * (1 + 2 * 2)  # targets x (warm-up + prompts x repeats)
    assert kinds == ["start"] + ["run"] * n_runs + ["summary"]
    start = events[0]
    assert [t["name"] for t in start["targets"]] == ["torch", "mlx"]
    assert [p["prompt_tokens"] for p in start["prompts"]] == [3, 5]
    runs = [e for e in events[:-1] if e["type"] == "run" and not e["warmup"]]
    # Targets alternate run by run, so drift on a busy machine hits both alike.
    assert [r["target"] for r in runs] == ["torch", "mlx"] * 4
    assert events[-2]["targets"]["mlx"]["runs"] == 4 and events[-2]["cancelled"] is False


class CompilesForAWhile(FakeEngine):
    """Its compiled step arrives half a second after its load; each request notes whether it
    had by then."""

    def __init__(self, name, **kwargs):
        super().__init__(name, **kwargs)
        self.compiled = Future()
        self.after_compiled: list[bool] = []
        threading.Timer(0.5, self.compiled.set_result, [None]).start()

    def script(self, prompt_ids):
        self.after_compiled.append(self.compiled.done())
        return super().script(prompt_ids)


def test_a_bench_waits_for_engines_still_making_their_compiled_step(make_client):
    with make_client(FakeFactory(engine_class=CompilesForAWhile)) as client:
        resp = client.post("/bench", json={**BENCH, "stream": True, "prompts": ["a b"]})
        engines = client.factory.engines
    events = sse_events(resp.text)[:-1]
    waited = [e["target"] for e in events if e["type"] == "compiling"]
    assert waited and len(set(waited)) == len(waited)  # an engine named once while it waits
    kinds = [e["type"] for e in events]
    assert kinds == ["start", *["compiling"] * len(waited), *["run"] * (len(kinds) - 2 - len(
        waited)), "summary"]
    assert all(all(e.after_compiled) and e.after_compiled for e in engines.values())


class CompileFailed(FakeEngine):
    """Its compiled step failed at its load: it steps eagerly."""

    def __init__(self, name, **kwargs):
        super().__init__(name, **kwargs)
        self.compiled = Future()
        self.compiled.set_exception(RuntimeError("no room for the graphs"))


def test_a_bench_names_an_engine_whose_compiled_step_failed(make_client):
    with make_client(FakeFactory(engine_class=CompileFailed)) as client:
        resp = client.post("/bench", json={**BENCH, "stream": True, "prompts": ["a b"]})
    events = sse_events(resp.text)[:-1]
    failed = [e for e in events if e["type"] == "compile_error"]
    assert sorted(e["target"] for e in failed) == ["mlx", "torch"]  # both engines benched
    assert all(e["message"] == "RuntimeError: no room for the graphs" for e in failed)
    assert [e["type"] for e in events].count("run") > 0 and events[-1]["type"] == "summary"


def test_engine_choice_and_unavailable_engines(make_client):
    with make_client(FakeFactory(available=("torch",))) as client:
        body = client.post("/bench", json={**BENCH, "repeats": 1}).json()
        assert list(body["targets"]) == ["torch"] and body["ratios"] == {}
        resp = client.post("/bench", json={**BENCH, "engines": ["mlx"]})
        assert_openai_error(resp, 400, param="engines", code="engine_unavailable")


@pytest.mark.parametrize("change, param, code", [
    ({"repeats": 21}, "repeats", "bench_limit_exceeded"),
    ({"max_tokens": 513}, "max_tokens", "bench_limit_exceeded"),
    ({"warmup": 6}, "warmup", "bench_limit_exceeded"),
    ({"prompts": ["x"] * 9}, "prompts", "bench_limit_exceeded"),
    ({"repeats": 0}, "repeats", "invalid_value"),
    ({"prompts": []}, "prompts", "invalid_value"),
    ({"prompts": [""]}, "prompts[0]", "invalid_value"),
    ({"preset": "huge"}, "preset", "invalid_value"),
    ({"engines": ["onnx"]}, "engines[0]", "invalid_value"),
    ({"engines": ["torch", "torch"]}, "engines", "invalid_value"),
    ({"references": ["vllm"]}, "references[0]", "invalid_value"),
    ({"max_token": 5}, "max_token", "invalid_value"),  # a typo is an error, not a default
    ({"prompts": ["x" * 500], "max_tokens": 64}, "prompts", "context_length_exceeded"),
    ({"model": "sorter"}, "model", None),
])
def test_bad_input_is_a_400_in_the_openai_shape(client, change, param, code):
    resp = client.post("/bench", json={**BENCH, **change})
    assert_openai_error(resp, 400, param=param, code=code)


def test_limits_come_from_the_settings(make_client):
    with make_client(bench_max_repeats=1) as client:
        err = assert_openai_error(client.post("/bench", json=BENCH), 400, param="repeats")
        assert "DUET_BENCH_MAX_REPEATS" in err["message"]
        err = assert_openai_error(client.post("/bench", json={**BENCH, "max_tokens": 999}), 400)
        assert "DUET_BENCH_MAX_TOKENS" in err["message"]
        assert client.post("/bench", json={**BENCH, "repeats": 1}).status_code == 200


def test_unknown_model_is_404(client):
    assert_openai_error(client.post("/bench", json={**BENCH, "model": "nope"}), 404,
                        code="model_not_found")


def test_missing_reference_backend_names_the_extra(client, monkeypatch):
    monkeypatch.setattr("server.bench.backend_available", lambda name: name != "mlx")
    resp = client.post("/bench", json={**BENCH, "references": ["mlx-lm"]})
    err = assert_openai_error(resp, 400, param="references", code="engine_unavailable")
    assert "duet[mlx]" in err["message"]


def test_a_reference_that_fails_to_load_is_an_error_event_not_a_lost_bench(client):
    # The fake registry's model has no files: the reference cannot load, the engines still run.
    events = sse_events(client.post("/bench", json={
        **BENCH, "repeats": 1, "stream": True, "references": ["transformers"]}).text)
    errors = [e for e in events if isinstance(e, dict) and e["type"] == "error"]
    assert [e["target"] for e in errors] == ["transformers"] and errors[0]["error"]["message"]
    summary = events[-2]
    assert summary["type"] == "summary" and summary["targets"]["torch"]["runs"] == N_SHORT
    assert summary["targets"]["transformers"]["runs"] == 0
    assert "error" in summary["targets"]["transformers"]


def test_switched_off_in_the_settings(make_client):
    with make_client(bench_enabled=False) as client:
        assert_openai_error(client.post("/bench", json=BENCH), 403, code="bench_disabled")
        assert_openai_error(client.get("/bench"), 403, code="bench_disabled")
        assert client.get("/bench/assets/bench.js").status_code == 404
        assert client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}]}).status_code == 200


def test_page_and_its_assets_are_served_without_a_cdn(client):
    page = client.get("/bench")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/bench/assets/bench.js">' in page.text
    for asset, kind in (("bench.js", "javascript"), ("bench.css", "text/css")):
        resp = client.get(f"/bench/assets/{asset}")
        assert resp.status_code == 200 and kind in resp.headers["content-type"]
        assert "://" not in resp.text.replace("http://www.w3.org/2000/svg", "")
    assert "://" not in page.text
    assert client.get("/bench/assets/../settings.py").status_code == 404


def test_bench_queues_with_requests_and_never_mixes_them(models_file):
    trace: list = []
    factory = FakeFactory(token_delay_s=0.002, trace=trace, reply="abcdefghijklmnop")
    app = create_app(Settings(models_file=models_file), factory)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "engine": "torch"}

    async def main(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            bench = asyncio.create_task(client.post("/bench", json={
                "model": "tiny", "engines": ["torch"], "max_tokens": 12, "repeats": 3,
                "warmup": 0, "stream": True}))
            await asyncio.sleep(0.1)
            chats = [client.post("/v1/chat/completions", json=chat) for _ in range(4)]
            replies = await asyncio.gather(*chats)
            return await bench, replies

    with LiveServer(app) as server:
        bench, replies = asyncio.run(main(server.url))
    assert [r.json()["choices"][0]["message"]["content"] for r in replies] == ["abcdefghijklmnop"] * 4
    runs = [e for e in sse_events(bench.text)[:-1] if e["type"] == "run"]
    assert len(runs) == 3 * N_SHORT and all(r["completion_tokens"] == 12 for r in runs)
    order = [req for req, _ in trace]
    chat_calls = [i for i, p in enumerate(factory.engines["torch"].calls) if b"<user>hi" in bytes(p)]
    bench_calls = sorted(set(order) - set(chat_calls))
    assert len(chat_calls) == 4 and len(bench_calls) == 3 * N_SHORT
    # Every bench run is one contiguous block of tokens: it runs alone, between two steps of
    # the requests' batch ...
    for run in bench_calls:
        at = [i for i, req in enumerate(order) if req == run]
        assert at == list(range(at[0], at[0] + len(at)))
    # ... and the requests did not wait for the whole bench: they ran between its runs.
    assert chat_calls[0] < bench_calls[-1]


def test_a_client_that_leaves_stops_the_run(models_file):
    factory = FakeFactory(token_delay_s=0.01, reply="x" * 64)
    app = create_app(Settings(models_file=models_file), factory)
    with LiveServer(app) as server:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            with client.stream("POST", "/bench", json={
                "model": "tiny", "engines": ["torch"], "max_tokens": 60, "repeats": 20,
                "warmup": 0, "stream": True}) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: ") and '"type":"run"' in line.replace(" ", ""):
                        break  # one run seen; now hang up
            engine = factory.engines["torch"]
            time.sleep(1.0)
            calls = len(engine.calls)
            time.sleep(1.5)
            assert len(engine.calls) == calls < 20 * N_SHORT  # nothing more was started
            started = time.perf_counter()
            resp = client.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            assert resp.status_code == 200 and time.perf_counter() - started < 2.0


def test_the_page_ships_as_package_data_and_the_readme_says_how_to_open_it():
    import re
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    meta = tomllib.loads((root / "pyproject.toml").read_text())
    assert "static/*" in meta["tool"]["setuptools"]["package-data"]["server"]
    page = (root / "server" / "static" / "bench.html").read_text()
    for asset in re.findall(r'"/bench/assets/([\w.]+)"', page):
        assert (root / "server" / "static" / asset).is_file()
    assert "http://127.0.0.1:8000/bench" in (root / "README.md").read_text()
