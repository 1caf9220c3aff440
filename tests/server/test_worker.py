"""EngineWorker's bookkeeping on its own: every admitted job gives its queue slot back once the
engine thread is done with it, whatever way it ended, so a small queue never fills for good."""

import asyncio
import threading
import time
from types import SimpleNamespace

import psutil
import pytest

from engines import gc_pauses
from engines.base import Cancelled, ContextLengthExceeded, EngineClosed, SamplingParams, Step
from engines.fake import FakeEngine
from server.errors import APIError, from_engine_error
from server.worker import EngineWorker, Job, Waker, WorkerStatus

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def settled(worker: EngineWorker, limit_s: float = 5.0) -> int:
    """Pending jobs once the engine thread has drained (it may still be letting one go)."""
    await worker.run(lambda: None)  # queued behind every job already on the thread
    for _ in range(int(limit_s / 0.01)):
        if worker.pending == 0:
            break
        await asyncio.sleep(0.01)
    return worker.pending


def fresh(max_queue=0, timeout_s=None) -> EngineWorker:
    worker = EngineWorker("test", max_queue=max_queue, timeout_s=timeout_s)
    worker.engine = SimpleNamespace(close=lambda: None)
    return worker


async def test_every_way_a_call_ends_gives_its_slot_back():
    # max_queue=0: one job at a time, so any slot kept would refuse the next call.
    worker = fresh()
    for kind in ("classification", "generation", "bench"):
        assert await worker.call(kind, lambda engine, stop: 42) == 42
        assert await settled(worker) == 0

    def fail(engine, stop):
        raise ValueError("engine error")

    for _ in range(3):
        with pytest.raises(ValueError):
            await worker.call("classification", fail)
        assert await settled(worker) == 0

    def cancelled(engine, stop):
        raise Cancelled()

    with pytest.raises(Cancelled):
        await worker.call("classification", cancelled)
    assert await settled(worker) == 0
    assert await worker.call("classification", lambda engine, stop: "still serving") == (
        "still serving")
    worker.close()


async def test_a_caller_that_leaves_stops_the_job_and_its_slot_comes_back():
    worker = fresh()
    started, saw_stop = threading.Event(), threading.Event()

    def long(engine, should_stop):
        started.set()
        while not should_stop():
            threading.Event().wait(0.005)
        saw_stop.set()
        raise Cancelled()

    task = asyncio.create_task(worker.call("classification", long))
    while not started.is_set():
        await asyncio.sleep(0.005)
    # The slot is held while the thread runs it: a second job is refused (429).
    with pytest.raises(APIError) as refused:
        await worker.call("classification", lambda e, s: None)
    assert refused.value.status == 429
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await settled(worker) == 0 and saw_stop.is_set()
    assert await worker.call("classification", lambda e, s: 1) == 1
    worker.close()


async def test_a_timed_out_call_is_a_504_and_its_slot_comes_back():
    worker = fresh(timeout_s=0.2)

    def long(engine, should_stop):
        while not should_stop():
            threading.Event().wait(0.005)
        raise Cancelled()

    with pytest.raises(APIError) as timed_out:
        await worker.call("classification", long)
    assert timed_out.value.status == 504
    assert await settled(worker) == 0
    worker.close()


async def test_generations_give_their_slot_back_finished_failed_or_abandoned():
    class Failing(FakeEngine):
        def before_token(self, request_no, index):
            if request_no == 1 and index == 2:
                raise RuntimeError("mid-stream failure")

    worker = EngineWorker("test", max_queue=0)  # one sequence at a time and no queue
    await worker.load(lambda: Failing(reply="abc", max_batch=1))
    params = SamplingParams(max_tokens=50)
    texts = [e.text async for batch in worker.generate([1, 2], params) for e in batch
             if isinstance(e, Step)]
    assert "".join(texts) == "abc"
    assert await settled(worker) == 0
    with pytest.raises(RuntimeError, match="mid-stream"):
        async for _ in worker.generate([1, 2], params):
            pass
    assert await settled(worker) == 0
    gen = worker.generate([1, 2], params)
    assert (await gen.__anext__())[0].text == "a"
    await gen.aclose()  # the client went away after one token
    assert await settled(worker) == 0
    with pytest.raises(ContextLengthExceeded):  # refused by the runtime before any token
        async for _ in worker.generate([1] * 600, params):
            pass
    assert await settled(worker) == 0
    texts = [e.text async for batch in worker.generate([1, 2], params) for e in batch
             if isinstance(e, Step)]
    assert "".join(texts) == "abc"
    worker.close()


async def test_a_job_stopped_while_queued_never_runs_and_is_released():
    worker = fresh(max_queue=4)
    gate = threading.Event()
    ran = []
    first = asyncio.create_task(worker.call("generation", lambda e, s: gate.wait(5)))
    await asyncio.sleep(0.05)
    second = asyncio.create_task(worker.call("classification", lambda e, s: ran.append(1)))
    await asyncio.sleep(0.05)
    assert worker.status().waiting == 1
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second  # its caller is gone before the thread is free to take it up
    assert worker.pending == 2  # still counted: the thread has not let it go yet
    gate.set()
    assert await first is True
    assert await settled(worker) == 0 and ran == []
    worker.close()


async def test_status_says_what_runs_since_when_and_how_late():
    worker = fresh(max_queue=4, timeout_s=30)
    assert worker.status() == WorkerStatus(0, 0, None, 0.0, None)
    gate, started = threading.Event(), threading.Event()

    def job(engine, should_stop):
        started.set()
        gate.wait(5)

    running = asyncio.create_task(worker.call("classification", job))
    while not started.is_set():
        await asyncio.sleep(0.005)
    waiting = asyncio.create_task(worker.call("generation", lambda e, s: None))
    await asyncio.sleep(0.05)
    status = worker.status()
    assert (status.running, status.waiting, status.kind) == (1, 1, "classification")
    assert status.overdue_s == 0.0  # well inside its 30 s
    assert abs(status.busy_since - time.time()) < 2
    gate.set()
    await running
    await waiting
    assert await settled(worker) == 0
    assert worker.status() == WorkerStatus(0, 0, None, 0.0, None)
    worker.close()


async def test_close_closes_the_engine_on_its_thread():
    closed = threading.Event()
    worker = EngineWorker("test", max_queue=1)
    worker.engine = SimpleNamespace(close=lambda: closed.set())
    worker.close()
    assert closed.wait(5) and worker.engine is None


async def test_work_sent_to_a_closed_engine_is_a_503_and_holds_no_slot():
    """A request routed just before its engine was unloaded: an EngineClosed (503, retry),
    not a RuntimeError (500), for a generation and for a job alike."""
    worker = fresh()
    await worker.load(lambda: FakeEngine("fake", max_batch=2))
    worker.close()
    with pytest.raises(EngineClosed) as caught:
        async for _ in worker.generate([1, 2], SamplingParams(max_tokens=4)):
            pass
    assert from_engine_error(caught.value).status == 503
    with pytest.raises(EngineClosed):
        await worker.call("classification", lambda engine, should_stop: 1)
    assert worker.pending == 0


async def test_runtime_status_reports_the_batch_and_the_pool_as_they_are():
    """What /health and /v1/models show of a generating engine, figure by figure."""
    worker = EngineWorker("test")
    engine = await worker.load(lambda: FakeEngine("fake", max_batch=3, kv_bytes_per_token=8,
                                                  kv_tokens=64))
    try:
        runtime = worker.loop.runtime
        runtime.last_batch, runtime.step_s, runtime.execute_s = 2, 0.0012341, 0.0004567
        blocks: list[int] = []
        assert engine.kv_pool.grow(blocks, 20)  # two 16-token blocks
        engine.kv_pool.register(blocks[0], 7, 0, tuple(range(16)))  # the first one cached
        runtime.scheduler.cached_tokens = 48
        collections = gc_pauses.watch().by_generation  # the engine's process is this one
        oldest_before = collections[2].collections
        status = worker.runtime_status()
        oldest = status.pop("gc_oldest_collections")
        assert oldest_before <= oldest <= collections[2].collections
        assert 0 <= status.pop("gc_pause_ms") <= sum(g.total_s for g in collections) * 1000 + 1e-3
        rss = status.pop("process_rss_bytes")  # the engine runs in this process
        assert psutil.Process().memory_info().rss * 0.9 < rss < psutil.Process().memory_info().rss * 1.1
        assert status == {
            "batch": 2, "max_batch": 3, "step_ms": 1.234, "engine_step_ms": 0.457,
            "kv_cache_used_bytes": 2 * 16 * 8, "kv_cache_bytes": 64 * 8,
            "kv_cache_used_tokens": 32, "kv_cache_tokens": 64,
            "prefix_cache_tokens": 16, "prefix_cache_hit_tokens": 48, "compiling": False,
            "compile_error": None,
        }
        engine.kv_pool.release(blocks)
        status = worker.runtime_status()
        assert status["kv_cache_used_bytes"] == 0 and status["prefix_cache_tokens"] == 16
    finally:
        worker.close()
    classifier = EngineWorker("classifier")
    classifier.engine = SimpleNamespace()  # no KV pool: not a generating engine
    assert classifier.runtime_status() is None


def test_status_names_the_oldest_running_job_and_no_overdue_without_deadlines():
    worker = EngineWorker("test")
    now = time.monotonic()
    older, newer, queued = Job("generation", None), Job("classification", None), Job("bench", None)
    newer.started, older.started = now - 1.0, now - 5.0
    worker._jobs += [newer, older, queued]
    status = worker.status()
    assert (status.running, status.waiting, status.kind) == (2, 1, "generation")
    assert abs(status.busy_since - (time.time() - 5.0)) < 0.5
    assert status.overdue_s == 0.0


async def test_a_running_generation_is_reported_as_one():
    worker = EngineWorker("test")
    await worker.load(lambda: FakeEngine("fake", token_delay_s=0.05))
    try:
        stream = worker.generate([1, 2], SamplingParams(max_tokens=50, ignore_eos=True))
        await stream.__anext__()  # it is running now
        assert worker.status().kind == "generation"
        await stream.aclose()
    finally:
        worker.close()


async def test_run_gives_back_what_the_function_returns():
    worker = EngineWorker("test")
    try:
        assert await worker.run(lambda x, y: x * y, 6, 7) == 42
    finally:
        worker.close()


def test_a_worker_serves_one_event_loop_after_another():
    """Each asyncio.run() is a new event loop: its streams are woken on it, not on the last
    one (closed by then, where a wake-up would be lost and the stream would hang)."""
    worker = EngineWorker("test")
    asyncio.run(worker.load(lambda: FakeEngine("fake", reply="hi")))

    async def ask():
        async def collect():
            return [e for batch in [b async for b in worker.generate(
                [1, 2], SamplingParams(max_tokens=8))] for e in batch]
        return await asyncio.wait_for(collect(), 10)

    try:
        assert len(asyncio.run(ask())) == len(asyncio.run(ask())) > 1
    finally:
        worker.close()


def test_one_hand_over_wakes_every_event_and_a_closed_loop_says_so():
    """Events woken together share one call into the loop, and each waker is told it worked
    (a False would stop its stream); on a closed loop every wake says False."""
    loop = asyncio.new_event_loop()
    waker = Waker(loop)
    events = [asyncio.Event() for _ in range(3)]
    assert all(waker.wake(e) for e in events)
    loop.run_until_complete(asyncio.sleep(0))
    assert all(e.is_set() for e in events)
    loop.close()
    assert waker.wake(asyncio.Event()) is False


async def test_aclose_closes_the_engine_and_says_it_did_in_time():
    worker = EngineWorker("test")
    engine = await worker.load(lambda: FakeEngine("fake"))
    closed = threading.Event()
    engine.close = closed.set
    assert await worker.aclose(5) is True
    assert closed.is_set() and worker.engine is None


def test_a_full_queue_answers_with_the_waiting_count_and_a_retry_after_from_the_mean_job_time():
    """Retry-After: the mean job time (a running mean, 0.2 of each finished job) times how many
    must go before a new request could be admitted; between 1 and 60 s."""
    worker = EngineWorker("mine", max_queue=2)
    running = worker.max_running
    jobs = [worker._admit("generation", True) for _ in range(running + 2)]
    jobs.append(worker._admit("bench", False))  # a bench's next run goes past the bound
    worker._mean_s = 4.0
    with pytest.raises(APIError) as caught:
        worker._admit("generation", True)
    error = caught.value  # 3 waiting, 2 of them must go first: 2 x 4 s
    assert error.status == 429 and error.headers == {"Retry-After": "8"}
    assert "the mine engine is busy: 3 requests are already waiting" in error.message
    jobs[0].started = time.monotonic() - 10.0
    worker._release(jobs[0])
    assert 5.19 < worker._mean_s < 5.3  # 0.8 * 4.0 + 0.2 * 10
    worker._mean_s = 1000.0
    with pytest.raises(APIError) as caught:
        worker._admit("generation", True)
    assert caught.value.headers == {"Retry-After": "60"}
    worker._mean_s = 0.001
    with pytest.raises(APIError) as caught:
        worker._admit("generation", True)
    assert caught.value.headers == {"Retry-After": "1"}
