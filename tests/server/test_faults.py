"""Faults: broken model files, an engine that fails mid-stream, SIGTERM with requests in flight."""

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from engines.base import DeviceOutOfMemory
from engines.fake import FakeEngine
from server.app import create_app
from server.settings import Settings
from tests.live_server import free_port
from tests.server.conftest import FakeFactory
from tests.server.helpers import assert_error_shape, assert_openai_error, sse_events

ROOT = Path(__file__).resolve().parents[2]


def chat(model, **kw):
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "temperature": 0, **kw}


def test_broken_model_files_are_a_clear_error_and_the_server_stays_healthy(tmp_path, tiny_dirs):
    good_dir, _ = tiny_dirs["llama"]
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    (corrupt / "model.safetensors").write_bytes(b"\x00garbage" * 64)
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    for f in good_dir.iterdir():
        if f.is_file():
            data = f.read_bytes()
            (truncated / f.name).write_bytes(data[: len(data) // 3] if f.suffix == ".safetensors" else data)
    models = tmp_path / "models.toml"
    models.write_text("".join(
        f'[[models]]\nid = "{name}"\nsource = "path:{path}"\nengine = "torch"\ncontext_length = 64\n'
        f'dtype = "float32"\n\n'
        for name, path in [("good", good_dir), ("missing", tmp_path / "nowhere"),
                           ("corrupt", corrupt), ("truncated", truncated)]))
    app = create_app(Settings(models_file=models, preload=False, device="cpu", compile="off"))
    with TestClient(app) as client:
        for name in ("missing", "corrupt", "truncated", "missing"):
            err = assert_openai_error(client.post("/v1/chat/completions", json=chat(name)), 503,
                                      code="model_unavailable")
            assert name in err["message"] and err["type"] == "server_error"
            assert client.get("/health").json()["status"] == "ok"
        resp = client.post("/v1/chat/completions", json=chat("good", stream=True))
        assert sse_events(resp.text)[-1] == "[DONE]"
        assert client.post("/v1/chat/completions", json=chat("good")).status_code == 200
        loaded = client.get("/health").json()["loaded"]
        assert loaded == [{"model": "good", "engine": "torch"}]


class FailsOnceEngine(FakeEngine):
    """The first generation fails after a few tokens; later ones work."""

    def before_token(self, request_no, index):
        if request_no == 0 and index == 3:
            raise RuntimeError("the accelerator caught fire")


def test_an_engine_failure_mid_stream_then_the_next_request_works(make_client):
    with make_client(FakeFactory(engine_class=FailsOnceEngine)) as client:
        events = sse_events(client.post("/v1/chat/completions", json=chat("tiny", stream=True,
                                                                            max_tokens=50)).text)
        assert events[-1] == "[DONE]"
        err = assert_error_shape(events[-2])
        assert "caught fire" in err["message"] and err["type"] == "server_error"
        partial = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2])
        assert partial == FakeEngine().reply[:3]
        # Same engine, same thread: the next request is served in full.
        body = client.post("/v1/chat/completions", json=chat("tiny", max_tokens=50)).json()
        assert body["choices"][0]["message"]["content"] == FakeEngine().reply
        events = sse_events(client.post("/v1/chat/completions", json=chat("tiny", stream=True,
                                                                            max_tokens=50)).text)
        assert events[-2]["choices"][0]["finish_reason"] == "stop"


class OutOfMemoryEngine(FakeEngine):
    """The device runs out of memory: before the first request's first token, in the second's
    third; later ones work."""

    def before_token(self, request_no, index):
        if (request_no, index) in ((0, 0), (1, 3)):
            raise DeviceOutOfMemory("the device ran out of memory running this request's step")


def test_the_device_out_of_memory_is_a_503_then_the_next_request_works(make_client):
    with make_client(FakeFactory(engine_class=OutOfMemoryEngine)) as client:
        err = assert_openai_error(client.post("/v1/chat/completions", json=chat("tiny")), 503,
                                  code="out_of_memory")
        assert "ran out of memory" in err["message"] and err["type"] == "server_error"
        events = sse_events(client.post("/v1/chat/completions", json=chat(
            "tiny", stream=True, max_tokens=50)).text)
        assert events[-1] == "[DONE]"
        err = assert_error_shape(events[-2])
        assert err["code"] == "out_of_memory" and "ran out of memory" in err["message"]
        body = client.post("/v1/chat/completions", json=chat("tiny", max_tokens=50)).json()
        assert body["choices"][0]["message"]["content"] == FakeEngine().reply


def start_server(tmp_path, models_file, reply_tokens, grace):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.server.faulty_serve", str(models_file), str(port),
         str(reply_tokens), str(grace)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(proc.communicate()[0])


def stream_in_background(url):
    got: dict = {"lines": [], "error": None}
    started = threading.Event()

    def run():
        body = chat("tiny", stream=True, max_tokens=2000)
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as resp:
                for line in resp.iter_lines():
                    if line:
                        got["lines"].append(line)
                        started.set()
        except httpx.HTTPError as exc:
            got["error"] = exc
        started.set()

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(30)
    return thread, got


@pytest.mark.parametrize("reply_tokens, grace, finishes", [(30, 20, True), (2000, 1, False)])
def test_sigterm_lets_requests_finish_or_cancels_them_in_bounded_time(
        tmp_path, models_file, reply_tokens, grace, finishes):
    proc, url = start_server(tmp_path, models_file, reply_tokens, grace)
    try:
        thread, got = stream_in_background(url)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=grace + 15)
        took = time.monotonic() - sent
        thread.join(10)
    finally:
        proc.kill()
    # uvicorn exits by re-raising the signal once its shutdown is done.
    assert proc.returncode in (0, -signal.SIGTERM), output
    assert "TOKENS" in output, output  # the generation ended, one way or the other
    tokens = int(output.split("TOKENS")[-1].split()[0])
    if finishes:
        # 30 tokens of 50 ms: done well inside the grace period, answered in full.
        assert got["lines"][-1] == "data: [DONE]"
        text = "".join(json.loads(l[6:])["choices"][0]["delta"].get("content", "")
                       for l in got["lines"] if l.startswith('data: {"id'))
        assert text == "z" * reply_tokens and took < grace
    else:
        # 2000 tokens would take 100 s: ended after the grace period with an error event and
        # [DONE], and the engine stopped at once rather than running on.
        assert got["lines"][-1] == "data: [DONE]", got["lines"][-3:]
        err = assert_error_shape(json.loads(got["lines"][-2][6:]))
        assert err["code"] == "server_shutting_down"
        assert took < grace + 8, took
        assert tokens < (grace + 8) / 0.05, tokens


def test_shutdown_past_its_grace_ends_every_open_request_cleanly(tmp_path, models_file):
    """5 streams and 2 plain requests open when the 1 s grace period runs out: the running
    stream gets an error event and [DONE], every waiting request a JSON 503, and no traceback
    reaches the log."""
    proc, url = start_server(tmp_path, models_file, 2000, 1)
    results: dict[int, dict] = {}

    def request(i: int, stream: bool) -> None:
        body = chat("tiny", stream=stream, max_tokens=2000)
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
                lines = [line for line in r.iter_lines() if line]
                results[i] = {"status": r.status_code, "lines": lines}
        except httpx.HTTPError as exc:
            results[i] = {"error": repr(exc)}

    try:
        threads = [threading.Thread(target=request, args=(i, i < 5)) for i in range(7)]
        for t in threads:
            t.start()
            time.sleep(0.1)
        deadline = time.monotonic() + 20
        while httpx.get(url + "/health").json()["engines"][0]["waiting"] < 6:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=20)
        for t in threads:
            t.join(10)
    finally:
        proc.kill()
    assert "Traceback" not in output and "Exception in ASGI" not in output, output
    assert len(results) == 7, results
    streamed = results[0]
    assert streamed["status"] == 200 and streamed["lines"][-1] == "data: [DONE]", streamed
    assert assert_error_shape(json.loads(streamed["lines"][-2][6:]))["code"] == (
        "server_shutting_down")
    for i in range(1, 7):
        assert results[i]["status"] == 503, results[i]
        error = json.loads(results[i]["lines"][0])["error"]
        assert error["code"] == "server_shutting_down" and error["type"] == "server_error"
