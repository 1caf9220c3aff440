"""An engine in a process of its own (engines/runtime/process.py) behaves as one on a thread of
the server: the same tokens for concurrent requests, stops and time limits that free the
sequence in the child, errors that keep their type (so the same HTTP status), jobs, a clean
close, and a child that dies ends its requests with an error instead of leaving them hanging,
after which the registry loads the engine anew."""

import asyncio
import itertools
import os
import pickle
import signal
import threading
import time
from concurrent.futures import Future
from functools import partial
from pathlib import Path

import psutil
import pytest

from engines.base import (
    BackendMissing,
    Cancelled,
    ClassifyParams,
    ContextLengthExceeded,
    RequestStats,
    SamplingParams,
    UnsupportedModel,
)
from engines.factory import create_engine
from engines.fake import EOS, FakeEngine
from engines.runtime.kv import KVPoolTooSmall
from engines.runtime.process import EngineProcessError, _portable, wants_process
from server.classify_service import _classify
from server.errors import APIError
from server.worker import EngineWorker
from tests.server.conftest import FakeFactory, script

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


class EchoEngine(FakeEngine):
    """Replies with its prompt reversed: every request's answer is its own."""

    def script(self, prompt_ids):
        return [*reversed(prompt_ids), EOS]


def echo(**kw):
    return partial(EchoEngine, "fake", max_batch=4, **kw)


async def run(worker: EngineWorker, prompt: str, max_tokens: int = 64):
    ids = worker.engine.tokenize(prompt)
    text, last = "", None
    async for batch in worker.generate(ids, SamplingParams(max_tokens=max_tokens,
                                                            temperature=0.0)):
        for event in batch:
            if isinstance(event, RequestStats):
                last = event
            else:
                text += event.text
    return text, last.finish_reason, last.completion_tokens


async def until(check, limit_s: float = 10.0) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if check():
            return True
        await asyncio.sleep(0.02)
    return check()


async def started(make, **options) -> EngineWorker:
    worker = EngineWorker("child", process=True, **options)
    await worker.load(make)
    return worker


@pytest.mark.parametrize("threaded_output", [False, True])
async def test_concurrent_requests_get_what_they_get_in_process(threaded_output):
    """With the output delivered on the step's thread or beside it (as for MLX; the child then
    sends each step's events from the delivery thread)."""
    prompts = [f"request number {i}: " + "x" * i for i in range(8)]
    results = {}
    for process in (False, True):
        worker = EngineWorker("w", process=process, max_queue=8)
        await worker.load(echo(token_delay_s=0.002, threaded_output=threaded_output))
        try:
            results[process] = await asyncio.gather(
                *(run(worker, p, max_tokens=10 + 3 * i) for i, p in enumerate(prompts)))
            assert await until(lambda: worker.pending == 0)
            status = worker.runtime_status()
            assert status["max_batch"] == 4 and status["kv_cache_tokens"] > 0
            assert await until(lambda: worker.runtime_status()["kv_cache_used_tokens"] == 0)
        finally:
            assert await worker.aclose(10)
    assert results[True] == results[False]
    assert [r[0] for r in results[True]] == [p[::-1][:10 + 3 * i] for i, p in enumerate(prompts)]


async def test_log_probabilities_and_a_grammar_cross_the_process_boundary():
    """The grammar goes to the child as text and its matcher is made there; each token's
    log-probabilities come back with it."""
    from engines.base import Step
    from engines.fake import fake_logprobs
    from engines.grammar import json_schema_grammar

    worker = EngineWorker("child", process=True)
    await worker.load(echo())
    try:
        params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2,
                                grammar=json_schema_grammar({"type": "object"}))
        steps = []
        async for batch in worker.generate(worker.engine.tokenize("abc"), params):
            steps += [e for e in batch if isinstance(e, Step) and e.finish_reason is None]
        assert [s.logprobs for s in steps] == [fake_logprobs(t, 2) for t in b"cba"]
    finally:
        assert await worker.aclose(10)


def test_a_steps_log_probabilities_cross_the_pipe_whole():
    """A Step's log-probabilities and its prompt's travel as plain tuples and come back as the
    same TokenLogprobs (the child's event, pickled as the pipe does, read by the parent)."""
    from multiprocessing.reduction import ForkingPickler

    from engines.base import Step, TokenLogprobs
    from engines.runtime.process import ProcessLoop, _Child
    from engines.runtime.runtime import Submission

    sent = [
        Step(7, "a", None, TokenLogprobs(-0.5, ((7, -0.5), (3, -1.25))),
             (None, TokenLogprobs(-2.0, ((1, -0.1),)), TokenLogprobs(-3.0))),
        Step(8, "b", "stop", None, None),
    ]
    child = _Child(None, "test")
    for step in sent:
        child._event(5, step)
    wire = pickle.loads(ForkingPickler.dumps(child._out))
    assert TokenLogprobs not in {type(x) for item in wire for x in item}  # plain on the wire
    parent = ProcessLoop("test")
    got = []
    parent._subs[5] = Submission([1], SamplingParams(max_tokens=2), got.append)
    parent._dispatch(wire, None)
    assert got == sent


async def test_the_batch_and_kv_use_show_while_requests_run():
    worker = await started(echo(token_delay_s=0.01), max_queue=8)
    try:
        tasks = [asyncio.create_task(run(worker, "y" * 40)) for _ in range(3)]
        assert await until(lambda: worker.runtime_status()["batch"] == 3)
        assert worker.runtime_status()["kv_cache_used_tokens"] > 0
        assert worker.status().running == 3
        # The engine's memory is the child's resident set, not the server's.
        child = worker.loop.pid
        assert child is not None and child != os.getpid()
        rss = worker.runtime_status()["process_rss_bytes"]
        assert abs(rss - psutil.Process(child).memory_info().rss) < 0.1 * rss
        await asyncio.gather(*tasks)
    finally:
        await worker.aclose(10)


class CompilesBeside(EchoEngine):
    """Serves at once; its compiled step arrives beside, once the gate file exists (or fails
    then, if the file says so)."""

    def __init__(self, *args, gate: str, **kw):
        super().__init__(*args, **kw)
        self.compiled = Future()

        def arrive():
            while not Path(gate).exists():
                time.sleep(0.01)
            if Path(gate).read_text() == "fail":
                self.compiled.set_exception(RuntimeError("out of memory in the capture"))
            else:
                self.compiled.set_result(None)

        threading.Thread(target=arrive, daemon=True).start()


@pytest.mark.parametrize("process", [False, True])
async def test_the_status_shows_an_engine_compiling_until_its_compiled_step_arrives(
        process, tmp_path):
    """It answers meanwhile; the status turns with no request running (an engine process sends
    it then, unasked)."""
    gate = tmp_path / "gate"
    worker = EngineWorker("w", process=process)
    await worker.load(partial(CompilesBeside, "fake", max_batch=4, gate=str(gate)))
    try:
        assert worker.runtime_status()["compiling"]
        assert (await run(worker, "abc"))[0] == "cba"
        assert worker.runtime_status()["compiling"]
        gate.touch()
        assert await until(lambda: not worker.runtime_status()["compiling"])
        assert worker.runtime_status()["compile_error"] is None
    finally:
        await worker.aclose(10)


def frozen_objects(engine, should_stop) -> tuple[int, int]:
    """What the child froze, and its oldest generation's threshold."""
    import gc

    return gc.get_freeze_count(), gc.get_threshold()[2]


@pytest.mark.parametrize("freeze", ["1", "0"])
async def test_an_engine_process_keeps_what_it_loaded_and_compiled_out_of_collections(
        freeze, tmp_path, monkeypatch):
    """gc.freeze() once the engine is loaded and again when its compiled step arrives, so a
    collection never walks them mid-step, and no collection of the oldest generation while the
    compiled step is made; DUET_GC_FREEZE=0 leaves the collector as it is."""
    import gc

    from engines.gc_pauses import HELD

    monkeypatch.setenv("DUET_GC_FREEZE", freeze)
    gate = tmp_path / "gate"
    worker = EngineWorker("w", process=True)
    await worker.load(partial(CompilesBeside, "fake", max_batch=4, gate=str(gate)))
    try:
        loaded, compiling_threshold = await worker.call("bench", frozen_objects)
        assert (await run(worker, "abc"))[0] == "cba"
        gate.touch()
        assert await until(lambda: not worker.runtime_status()["compiling"])
        compiled, threshold = await worker.call("bench", frozen_objects)
        usual = gc.get_threshold()[2]
        if freeze == "1":
            assert loaded > 1000 and compiled > loaded  # what served the request since, too
            assert (compiling_threshold, threshold) == (HELD, usual)
        else:
            assert loaded == compiled == 0
            assert compiling_threshold == threshold == usual
    finally:
        await worker.aclose(10)


class RecordsItsLoad(EchoEngine):
    """Keeps the oldest generation's threshold while it was built."""

    def __init__(self, *args, **kw):
        import gc

        self.threshold_while_loading = gc.get_threshold()[2]
        super().__init__(*args, **kw)


def thresholds(engine, should_stop) -> tuple[int, int]:
    """The oldest generation's threshold while the child loaded, and now."""
    import gc

    return engine.threshold_while_loading, gc.get_threshold()[2]


async def test_an_engine_process_collects_no_oldest_generation_till_it_loaded(monkeypatch):
    """Its imports and its load make what it keeps for good: no collection walks them meanwhile
    (they are collected and frozen once, when loaded)."""
    import gc

    from engines.gc_pauses import HELD

    monkeypatch.setenv("DUET_GC_FREEZE", "1")
    worker = EngineWorker("w", process=True)
    await worker.load(partial(RecordsItsLoad, "fake", max_batch=4))
    try:
        assert await worker.call("bench", thresholds) == (HELD, gc.get_threshold()[2])
        assert (await run(worker, "abc"))[0] == "cba"
    finally:
        await worker.aclose(10)


@pytest.mark.parametrize("process", [False, True])
async def test_the_status_says_why_a_compiled_step_failed(process, tmp_path):
    """The engine steps eagerly on; /health's status carries the error (and a benchmark that
    waits for the compiled step stops on it rather than time eager steps)."""
    gate = tmp_path / "gate"
    worker = EngineWorker("w", process=process)
    await worker.load(partial(CompilesBeside, "fake", max_batch=4, gate=str(gate)))
    try:
        assert worker.runtime_status()["compile_error"] is None
        gate.write_text("fail")
        assert await until(lambda: not worker.runtime_status()["compiling"])
        error = worker.runtime_status()["compile_error"]
        assert error == "RuntimeError: out of memory in the capture"
        assert (await run(worker, "abc"))[0] == "cba"
        health = {"engines": [{"model": "m", **worker.runtime_status()}]}
        with pytest.raises(SystemExit, match="m: RuntimeError: out of memory"):
            script("bench_concurrency").compiling(health)
    finally:
        await worker.aclose(10)


async def test_a_consumer_that_leaves_frees_its_sequence_in_the_child():
    worker = await started(echo(token_delay_s=0.01), max_queue=0)
    try:
        stream = worker.generate(worker.engine.tokenize("z" * 200), SamplingParams(max_tokens=300))
        await anext(stream)
        await stream.aclose()
        # Left alone it would run 3 s more.
        assert await until(lambda: worker.pending == 0, limit_s=1.0)
        assert await until(lambda: worker.runtime_status()["kv_cache_used_tokens"] == 0, 1.0)
        assert (await run(worker, "abc"))[0] == "cba"  # and the engine goes on
    finally:
        await worker.aclose(10)


async def test_a_time_limit_stops_the_sequence_in_the_child():
    worker = await started(echo(token_delay_s=0.02), timeout_s=0.3)
    try:
        with pytest.raises(APIError) as caught:
            await run(worker, "q" * 200, max_tokens=200)
        assert caught.value.status == 504
        # Left alone it would run 3.7 s more.
        assert await until(lambda: worker.pending == 0, limit_s=1.0)
        assert await until(lambda: worker.runtime_status()["kv_cache_used_tokens"] == 0, 1.0)
    finally:
        await worker.aclose(10)


async def test_a_stop_is_forwarded_while_events_never_pause():
    """While the child's events flow (a token a millisecond), stops are still looked at,
    every stops_every_s: not only when the pipe is quiet for poll_s, here longer than the
    whole generation."""
    long = partial(FakeEngine, "fake", reply="x" * 4000, token_delay_s=0.001,
                   context_length=8192)
    worker = await started(long, timeout_s=0.3)
    worker.loop.poll_s = 30.0
    try:
        started_at = time.perf_counter()
        with pytest.raises(APIError) as caught:
            await run(worker, "q", max_tokens=4000)
        assert caught.value.status == 504
        # Left alone the child would decode 3 s more, its blocks held.
        assert await until(lambda: worker.runtime_status()["kv_cache_used_tokens"] == 0, 1.0)
        assert time.perf_counter() - started_at < 2.0
    finally:
        await worker.aclose(10)


async def test_errors_cross_with_their_type():
    worker = await started(echo(context_length=64))
    try:
        with pytest.raises(ContextLengthExceeded) as caught:
            await run(worker, "p" * 60, max_tokens=10)
        assert (caught.value.prompt_tokens, caught.value.context_length) == (60, 64)
        assert worker.pending == 0
    finally:
        await worker.aclose(10)
    for exc in (KVPoolTooSmall(100, 64), BackendMissing("mlx", "mlx_lm", "mlx"),
                ContextLengthExceeded(5, 6, 7)):
        back = _portable(exc)
        assert type(back) is type(exc) and str(back) == str(exc)

    class Odd(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a}/{b}")

    # An exception that does not survive pickling still arrives, as its type and message.
    assert str(_portable(Odd(1, 2))) == "Odd: 1/2"


async def test_jobs_run_in_the_child_and_stop_when_asked():
    params = ClassifyParams(inputs=("this is about sport", "a text on cooking"),
                            labels=("sport", "cooking"))
    answers = []
    for process in (False, True):
        worker = EngineWorker("w", process=process)
        await worker.load(echo())
        try:
            result = await worker.call("classification", partial(_classify, params))
            answers.append([r.label for r in result.results])
            gone = threading.Event()
            gone.set()
            with pytest.raises(Cancelled):
                await worker.call("bench", partial(_classify, params), also_stop=gone)
            assert await until(lambda: worker.pending == 0)
        finally:
            await worker.aclose(10)
    assert answers == [["sport", "cooking"]] * 2

    worker = await started(echo())
    try:
        with pytest.raises(RuntimeError, match="cannot be sent"):
            await worker.call("bench", lambda engine, stop: 1)  # a lambda does not pickle
        assert worker.pending == 0
    finally:
        await worker.aclose(10)


@pytest.mark.parametrize("process,kind,beside", [
    (False, "classification", True), (True, "classification", True), (False, "bench", False)])
async def test_streams_go_on_beside_a_classification_and_wait_for_a_bench_run(process, kind,
                                                                              beside):
    # 20 inputs in two label listings and the content-free one: 42 prompts of 30 ms each.
    params = ClassifyParams(inputs=tuple(f"text {i}" for i in range(20)), labels=("a", "b"))
    worker = EngineWorker("w", process=process)
    await worker.load(partial(FakeEngine, "fake", max_batch=2, token_delay_s=0.03,
                              reply="x" * 400))
    stamps: list[float] = []

    async def stream():
        async for batch in worker.generate([1, 2, 3], SamplingParams(max_tokens=400)):
            stamps.extend(time.monotonic() for _ in batch)

    task = asyncio.create_task(stream())
    try:
        # The first job makes the child import the job's code.
        await worker.call(kind, partial(_classify, ClassifyParams(inputs=("t",), labels=("a",))))
        assert await until(lambda: len(stamps) > 3)
        began = time.monotonic()
        result = await worker.call(kind, partial(_classify, params))
        ended = time.monotonic()
        assert len(result.results) == 20
        times = [began, *(t for t in stamps if began < t < ended), ended]
        longest = max(b - a for a, b in itertools.pairwise(times))
        if beside:  # a step between two prompts of the classification
            assert longest < 0.5, (longest, ended - began)
        else:  # a bench run measures the engine alone
            assert longest > 0.9 * (ended - began) > 1.0, (longest, ended - began)
    finally:
        task.cancel()
        await worker.aclose(10)


async def test_close_ends_running_requests_and_the_process():
    worker = await started(echo(token_delay_s=0.02))
    process = worker.loop._process
    task = asyncio.create_task(run(worker, "w" * 200, max_tokens=200))
    assert await until(lambda: worker.status().running == 1)
    assert await worker.aclose(10)
    text, reason, _ = await asyncio.wait_for(task, 10)
    assert reason == "cancelled" and 0 < len(text) < 200
    assert not process.is_alive()


async def test_a_dead_engine_process_ends_its_requests_with_an_error(caplog):
    worker = await started(echo(token_delay_s=0.02), max_queue=4)
    try:
        tasks = [asyncio.create_task(run(worker, "v" * 200, max_tokens=200)) for _ in range(2)]
        assert await until(lambda: worker.status().running == 2)
        os.kill(worker.loop._process.pid, signal.SIGKILL)
        for task in tasks:
            with pytest.raises(EngineProcessError, match="exit code -9"):
                await asyncio.wait_for(task, 10)
        assert worker.pending == 0
        assert not worker.loaded  # so the registry loads it anew
        # The server's log says so, naming the signal (a crash leaves no other trace there).
        said = [r for r in caplog.records if r.name == "duet.runtime" and r.levelname == "ERROR"]
        assert len(said) == 1 and "(killed by SIGKILL); 2 requests failed" in said[0].getMessage()
    finally:
        await worker.aclose(10)
    assert len([r for r in caplog.records if r.levelname == "ERROR"]) == 1  # not on a close


async def test_a_crashed_engine_process_prints_its_threads_stacks(capfd, caplog):
    """A crash in the child's native code (here its SIGSEGV, sent): faulthandler prints every
    thread's Python stack on the stderr it shares with the server before it dies, and the
    server logs the signal."""
    worker = await started(echo(token_delay_s=0.02))
    try:
        task = asyncio.create_task(run(worker, "v" * 200, max_tokens=200))
        assert await until(lambda: worker.status().running == 1)
        os.kill(worker.loop._process.pid, signal.SIGSEGV)
        with pytest.raises(EngineProcessError, match="exit code -11"):
            await asyncio.wait_for(task, 10)
    finally:
        await worker.aclose(10)
    err = capfd.readouterr().err
    assert "Fatal Python error: Segmentation fault" in err and "most recent call first" in err
    assert any("killed by SIGSEGV" in r.getMessage() for r in caplog.records)


class LosesItsRank(EchoEngine):
    """A step fails as a tensor-parallel engine's does when a rank dies: with an
    EngineProcessError, while the child (whose engine exits soon after) still runs. Only
    while the file `lose` exists (it is removed then), so that an engine loaded anew works."""

    def __init__(self, *args, lose: str, **kw):
        super().__init__(*args, **kw)
        self.lose = Path(lose)

    def before_token(self, request_no, index):
        if index == 3 and self.lose.exists():
            self.lose.unlink()
            raise EngineProcessError("tensor-parallel rank 1 of the engine ended")


async def test_an_engine_lost_in_the_child_is_unloaded_before_its_process_ends(tmp_path):
    (tmp_path / "lose").touch()
    worker = await started(partial(LosesItsRank, "fake", max_batch=4,
                                   lose=str(tmp_path / "lose")))
    try:
        with pytest.raises(EngineProcessError, match="rank 1"):
            await run(worker, "abcdef")
        # At once, not when the child's pipe ends: a client that retries at once must reach
        # an engine loaded anew, not the one going down.
        assert not worker.loaded
        assert worker.loop._process.is_alive()
        with pytest.raises(EngineProcessError, match="process is gone"):
            await run(worker, "abc")
        assert worker.pending == 0
    finally:
        await worker.aclose(10)


async def test_a_load_that_fails_in_the_child_keeps_its_error(tmp_path):
    worker = EngineWorker("w", process=True)
    make = partial(create_engine, "mlx", tmp_path, context_length=64, task="classify")
    with pytest.raises(UnsupportedModel):
        await worker.load(make)
    assert not worker.loaded
    assert worker.loop.join(10)


class PreparesInItsProcess(FakeFactory):
    """prepare() leaves a file named by the pid of the process it ran in; estimate() (the
    server's budget, before the load) waits for one from another process: a load whose
    engine process started only after the budget was worked out would wait it out and fail."""

    def __init__(self, marks: str, **kw):
        super().__init__(**kw)
        self.marks = Path(marks)

    def prepare(self, name):
        (self.marks / str(os.getpid())).touch()

    def estimate(self, name, spec):
        deadline = time.monotonic() + 20
        while not any(p.name != str(os.getpid()) for p in self.marks.iterdir()):
            assert time.monotonic() < deadline, "the engine process was not started first"
            time.sleep(0.01)
        return super().estimate(name, spec)


def test_the_policy_guesses_the_decision_without_torch(monkeypatch, tmp_path):
    """likely() is the decision with a GPU the driver shows taken for CUDA; a mode other than
    auto, a split model and a classifier are decided alike."""
    from engines.models.config import load_models_file
    from server import registry
    from server.registry import ProcessPolicy

    (tmp_path / "m.toml").write_text(
        '[[models]]\nid = "g"\nsource = "path:/x"\n'
        '[[models]]\nid = "c"\nsource = "path:/x"\ntask = "classify"\n')
    generate, classify = load_models_file(tmp_path / "m.toml")
    monkeypatch.setattr(registry, "cuda_visible", lambda: True)
    assert ProcessPolicy("auto", "auto").likely(generate, "torch")
    assert not ProcessPolicy("auto", "auto").likely(classify, "torch")
    assert not ProcessPolicy("auto", "cpu").likely(generate, "torch")
    assert not ProcessPolicy("auto", "auto")(generate, "torch")  # this machine has no GPU
    monkeypatch.setattr(registry, "cuda_visible", lambda: False)
    assert not ProcessPolicy("auto", "auto").likely(generate, "torch")
    assert ProcessPolicy("on", "auto").likely(generate, "mlx")
    assert ProcessPolicy("off", "auto", tensor_parallel_default=2).likely(generate, "torch")
    with pytest.raises(ValueError):
        ProcessPolicy("sometimes", "auto")


def engine_processes() -> list:
    """This process's engine processes (multiprocessing's resource tracker stays)."""
    try:
        return [p for p in psutil.Process().children()
                if "resource_tracker" not in " ".join(p.cmdline())]
    except psutil.ZombieProcess:  # exited, not yet waited for
        return [None]


def no_engine_process_within(limit_s: float = 10.0) -> bool:
    deadline = time.monotonic() + limit_s
    while engine_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    return engine_processes() == []


def test_an_engine_process_started_on_a_wrong_guess_ends(make_client, monkeypatch, tmp_path):
    """Where the driver shows a GPU that torch does not see, a process is started on the guess
    (it prepares), then exits, and the engine runs in the server."""
    from server import registry
    from tests.server.helpers import CHAT, REPLY

    monkeypatch.setattr(registry, "cuda_visible", lambda: True)
    marks = tmp_path / "marks"
    marks.mkdir()
    factory = PreparesInItsProcess(str(marks), max_batch=4)
    with make_client(factory, engine_process="auto", device="auto") as client:
        body = client.post("/v1/chat/completions", json=CHAT).json()
        assert body["choices"][0]["message"]["content"] == REPLY
        (_, _, worker), = client.app.state.registry.loaded_workers()
        assert worker.loop.pid == os.getpid()
        assert no_engine_process_within()
        (mark,) = marks.iterdir()
        assert mark.name != str(os.getpid())


def test_the_auto_mode_asks_for_a_process_on_cuda_only():
    assert wants_process("auto", "cuda") and wants_process("auto", "cuda:1")
    assert not wants_process("auto", "cpu") and not wants_process("auto", "mps")
    assert wants_process("on", "cpu") and not wants_process("off", "cuda")
    with pytest.raises(ValueError):
        wants_process("sometimes", "cpu")
    assert pickle.loads(pickle.dumps(echo()))  # what the registry sends must pickle


def test_the_http_api_through_an_engine_process(make_client):
    """The server with --engine-process on: generation (plain and streamed), zero-shot
    classification, /health with the child's batch and KV pool; a killed child is loaded anew on
    the next request; closing the app leaves no engine process behind."""
    from tests.server.helpers import CHAT, REPLY, sse_events

    with make_client(FakeFactory(token_delay_s=0.002, max_batch=4), engine_process="on") as client:
        body = client.post("/v1/chat/completions", json=CHAT).json()
        assert body["choices"][0]["message"]["content"] == REPLY
        assert body["metrics"]["engine"] == "torch"
        events = sse_events(client.post("/v1/completions", json={
            "model": "tiny", "prompt": "Hi", "stream": True}).text)
        assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == REPLY
        labels = client.post("/v1/classifications", json={
            "model": "tiny", "input": ["all about sport", "all about cooking"],
            "labels": ["sport", "cooking"]}).json()
        assert [r["label"] for r in labels["data"]] == ["sport", "cooking"], labels
        bench = client.post("/bench", json={"engines": ["torch"], "prompts": ["a b", "c d"],
                                             "max_tokens": 4, "repeats": 1, "warmup": 0}).json()
        runs = [r for r in bench["runs"] if r["target"] == "torch"]
        assert len(runs) == 2 and all(r["completion_tokens"] == 4 for r in runs), bench
        (state,) = client.get("/health").json()["engines"]
        assert state["max_batch"] == 4 and state["kv_cache_tokens"] > 0
        registry = client.app.state.registry
        (_, _, worker), = registry.loaded_workers()
        child = worker.loop._process
        assert worker.loop.alive and child.is_alive()

        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while worker.loaded and time.monotonic() < deadline:
            time.sleep(0.02)
        body = client.post("/v1/chat/completions", json=CHAT).json()
        assert body["choices"][0]["message"]["content"] == REPLY  # a new child took over
        (_, _, worker), = registry.loaded_workers()
        child = worker.loop._process
        assert child.is_alive()
    child.join(10)
    assert not child.is_alive()


async def test_a_request_sent_to_a_gone_process_is_an_engine_error():
    """The child's pipe is gone: whether the reader has noticed yet (the child, reading the
    end of its commands, stops) or not (the send fails), the request fails at once as an
    EngineProcessError (a 503) and holds no slot."""
    worker = await started(echo())
    try:
        worker.loop._commands.close()
        with pytest.raises(EngineProcessError):
            await run(worker, "abc")
        assert await until(lambda: not worker.loop.alive)
        with pytest.raises(EngineProcessError):
            await run(worker, "abc")
        with pytest.raises(EngineProcessError):
            await worker.call("classification", partial(
                _classify, ClassifyParams(inputs=("x",), labels=("a", "b"))))
        assert worker.pending == 0
    finally:
        await worker.aclose(10)


def test_the_engine_process_prepares_while_the_server_sizes_the_budget(make_client, tmp_path):
    """The engine's process starts, and imports its backend, before the memory budget is worked
    out for it."""
    from tests.server.helpers import CHAT

    marks = tmp_path / "marks"
    marks.mkdir()
    factory = PreparesInItsProcess(str(marks), max_batch=4)
    with make_client(factory, engine_process="on") as client:
        response = client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 200, response.text
        (_, _, worker), = client.app.state.registry.loaded_workers()
        assert {p.name for p in marks.iterdir()} == {str(worker.loop._process.pid)}


def test_an_engine_process_the_budget_refuses_ends(make_client):
    """A model the budget cannot hold is a 503 naming the budget, and the engine process started
    for it (waiting to be told what to build) exits."""
    from tests.server.helpers import CHAT

    factory = FakeFactory(weights_bytes=1 << 41)  # the budget is 1 << 40
    with make_client(factory, engine_process="on", preload=False) as client:
        response = client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 503, response.text
        assert "--memory-budget" in response.json()["error"]["message"]
        assert client.app.state.registry.loaded_workers() == []
        assert no_engine_process_within()


async def test_a_child_started_ahead_loads_what_it_is_then_asked(tmp_path):
    """start() runs prepare in the child before load() sends what to build; a make that does
    not pickle is an error, and the child waiting for it exits."""
    worker = EngineWorker("w", process=True)
    worker.start(partial(Path.touch, tmp_path / "prepared"))
    assert await until(lambda: (tmp_path / "prepared").exists())
    await worker.load(echo())
    assert (await run(worker, "abc"))[0] == "cba"
    await worker.aclose(10)
    worker = EngineWorker("w", process=True)
    worker.start(None)
    with pytest.raises(RuntimeError, match="could not be asked to load"):
        await worker.load(lambda: EchoEngine("fake"))
    assert worker.loop.join(10)


def test_a_lost_engine_is_closed_before_the_registry_loads_it_anew(make_client, tmp_path):
    """The request the lost engine carried is a 503; the next loads a new child, once the old
    one (still running: only its engine was lost) has been told to close and has exited."""
    from tests.server.helpers import CHAT

    (tmp_path / "lose").touch()
    factory = FakeFactory(engine_class=LosesItsRank, lose=str(tmp_path / "lose"), max_batch=4)
    with make_client(factory, engine_process="on") as client:
        registry = client.app.state.registry
        response = client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 503, response.text
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        assert registry.loaded_workers() == []
        (lost,) = registry._workers.values()  # kept until the next request replaces it
        old = lost.loop._process
        assert not lost.loaded and old.is_alive()
        response = client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 200, response.text
        assert not old.is_alive()
        (_, _, worker), = registry.loaded_workers()
        assert worker is not lost and worker.loop._process.is_alive()
