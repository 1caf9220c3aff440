"""The async face of one loaded engine: its EngineLoop (engines/runtime/loop.py) owns the
engine's thread; this admits work against the queue bound and carries events back to asyncio.

Generations join the loop's running batch; other units of work (a classification, a bench run)
run one at a time between two steps, a classification with the batch stepping beside it. Each
is a Job: admitted against the bound (max_batch running plus max_queue waiting), given a stop
flag and a deadline (the request time limit, its wait included), and counted as pending until
the engine thread has finished with it, not merely until its caller gave up. A caller that
leaves or runs out of time sets the stop flag; the loop reads it at its next step and the
sequence leaves the batch there.

The loop runs on a thread of this process (EngineLoop) or, with process=True, in a child
process of its own (engines/runtime/process.py), where the HTTP side's work does not hold up
the engine's steps. The worker is the same either way; a job's function must then pickle.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import psutil

from engines.base import Engine, GenerationEvent, RequestStats, SamplingParams, StopCheck
from engines.runtime.loop import EngineLoop
from engines.runtime.process import ProcessLoop
from engines.runtime.runtime import Submission

from .errors import queue_full, request_timed_out

T = TypeVar("T")
JobKind = Literal["generation", "classification", "embedding", "bench"]
# Jobs that only score with the model: running streams go on between their pieces. A bench run
# measures the engine alone, so it keeps it whole.
_BESIDE_BATCH: frozenset[JobKind] = frozenset({"classification", "embedding"})


@dataclass(eq=False)
class Job:
    kind: JobKind
    deadline: float | None  # time.monotonic() by which the caller gives up
    started: float | None = None  # when the engine thread took it up
    # Set by the caller when it leaves or its time runs out (its own timer, so that the answer
    # is a clean 504 rather than a race with an engine that noticed the deadline first).
    stop: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class WorkerStatus:
    running: int
    waiting: int
    busy_since: float | None  # time.time() at which the oldest running job started
    overdue_s: float  # how far the most overdue running job is past its deadline (0 if not)
    kind: JobKind | None  # the oldest running job's


DEFAULT_QUEUE = 32  # requests that may wait behind a batch smaller than this


class EngineWorker:
    def __init__(self, label: str, *, max_queue: int | None = 32,
                 timeout_s: float | None = None, process: bool = False):
        """max_queue None: as many may wait as run at once, at least DEFAULT_QUEUE."""
        self.label = label
        self.engine: Engine | None = None
        self._max_queue = max_queue
        self.timeout_s = timeout_s
        self._jobs: list[Job] = []  # admitted and not finished by the engine thread, in order
        self._lock = threading.Lock()  # _jobs changes on the event loop and the engine thread
        self._mean_s = 1.0  # a running mean of job times, for Retry-After
        self.loop: EngineLoop | ProcessLoop = ProcessLoop(label) if process else EngineLoop(label)
        self._waker: Waker | None = None

    @property
    def loaded(self) -> bool:
        """An engine is there to take work (false once an engine process died: the registry
        then loads it again)."""
        return self.engine is not None and self.loop.alive

    @property
    def pending(self) -> int:
        """Jobs admitted and not finished on the engine thread, the running ones included."""
        return len(self._jobs)

    @property
    def max_running(self) -> int:
        """Units of work that run at once: the runtime's batch, or one (an engine without)."""
        status = self.loop.status()
        return 1 if status is None else status.max_batch

    @property
    def max_queue(self) -> int:
        if self._max_queue is not None:
            return self._max_queue
        return max(DEFAULT_QUEUE, self.max_running)

    def status(self) -> WorkerStatus:
        with self._lock:
            jobs = list(self._jobs)
        running = [j for j in jobs if j.started is not None]
        if not running:
            return WorkerStatus(0, len(jobs), None, 0.0, None)
        now = time.monotonic()
        oldest = min(running, key=lambda j: j.started)
        overdue = max((now - j.deadline for j in running if j.deadline is not None), default=0.0)
        return WorkerStatus(len(running), len(jobs) - len(running),
                            time.time() - (now - oldest.started), max(0.0, overdue), oldest.kind)

    def runtime_status(self) -> dict | None:
        """The running batch and the KV pool, for a generating engine (None for others)."""
        status = self.loop.status()
        if status is None:
            return None
        per_token = status.kv_bytes_per_token
        return {"batch": status.batch, "max_batch": status.max_batch,
                "step_ms": round(status.step_s * 1000, 3),
                "engine_step_ms": round(status.execute_s * 1000, 3),
                "compiling": status.compiling,
                "compile_error": status.compile_error,
                "kv_cache_used_bytes": status.kv_used_tokens * per_token,
                "kv_cache_bytes": status.kv_tokens * per_token,
                "kv_cache_used_tokens": status.kv_used_tokens,
                "kv_cache_tokens": status.kv_tokens,
                "prefix_cache_tokens": status.prefix_cache_tokens,
                "prefix_cache_hit_tokens": status.prefix_cached_tokens,
                "process_rss_bytes": self.process_rss_bytes(),
                "gc_pause_ms": round(status.gc_pause_s * 1000, 3),
                "gc_oldest_collections": status.gc_oldest_collections,
                **({"ranks": [{"rank": r.rank, "pid": r.pid, "memory_bytes": r.memory_bytes,
                               "peak_memory_bytes": r.peak_memory_bytes}
                              for r in status.ranks]} if status.ranks else {})}

    def process_rss_bytes(self) -> int | None:
        """The resident memory of the process the engine runs in (the server's own, or its
        engine process's): the one memory figure measured alike for every engine and device."""
        pid = self.loop.pid
        if pid is None:
            return None
        try:
            return psutil.Process(pid).memory_info().rss
        except psutil.Error:  # the engine process is gone: its restart will say more
            return None

    def _waker_for(self, loop: asyncio.AbstractEventLoop) -> Waker:
        if self._waker is None or self._waker.loop is not loop:
            self._waker = Waker(loop)
        return self._waker

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn on the engine's thread, after the jobs submitted before it. Not admitted nor
        counted: for loading and closing, not for requests. In-process loops only."""
        return await asyncio.wrap_future(self.loop.submit(lambda: fn(*args)))

    async def call(self, kind: JobKind, fn: Callable[[Engine, StopCheck], T], *,
                   bounded: bool = True, also_stop: threading.Event | None = None) -> T:
        """fn(engine, should_stop) on the engine's thread as one job, between two steps (the
        batch stepping beside it for the kinds that allow it). A caller that is cancelled, or
        whose time runs out (504), stops the job at its next step; either way the job stays
        pending until the engine is done with it. bounded=False admits
        past the queue bound (a bench's next run, which keeps at most one job queued);
        also_stop stops the job too once set. fn must pickle (a module-level function or a
        partial of one): the engine may run in another process."""
        job = self._admit(kind, bounded)

        def should_stop() -> bool:
            return job.stop.is_set() or (also_stop is not None and also_stop.is_set())

        def on_start() -> None:
            job.started = time.monotonic()

        future = self.loop.run_job(fn, should_stop, on_start,
                                   beside_batch=kind in _BESIDE_BATCH)
        # Released once the engine is done with it, not when its caller gives up.
        future.add_done_callback(lambda _: self._release(job))
        done = asyncio.wrap_future(future)
        # Read the outcome even when nobody waits for it any more (no "never retrieved" noise).
        done.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            # shield: a queued job must still reach the engine, which is where it is released.
            return await asyncio.wait_for(asyncio.shield(done), self._time_left(job))
        except TimeoutError:
            raise request_timed_out(self.timeout_s) from None
        finally:
            job.stop.set()

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams
                       ) -> AsyncIterator[list[GenerationEvent]]:
        """The events of one generation, in batches: whatever the loop produced since the
        consumer last looked (one step's token when it keeps up; several when it falls behind,
        so a busy server sends fewer, larger chunks instead of falling further behind). The
        last batch ends with the RequestStats.

        If the consumer stops early (a client went away) or the time limit passes, the
        sequence leaves the batch at the next step; the job is released once the loop has let
        it go."""
        job = self._admit("generation", True)
        loop = asyncio.get_running_loop()
        waker = self._waker_for(loop)
        arrived: deque = deque()
        ready = asyncio.Event()
        woken = [False]  # a wake-up is on its way to the event loop
        expired = [False]

        def emit(event: Any) -> None:  # on the engine thread
            if isinstance(event, (RequestStats, BaseException)):
                self._release(job)  # the loop is done with it
            arrived.append(event)
            if not woken[0]:
                woken[0] = True
                if not waker.wake(ready):  # the event loop is gone: the server is shutting down
                    job.stop.set()

        def on_start() -> None:
            job.started = time.monotonic()

        try:
            self.loop.add(Submission(list(prompt_ids), params, emit, job.stop.is_set, on_start))
        except BaseException:
            self._release(job)
            raise

        def expire() -> None:
            expired[0] = True
            ready.set()

        # One timer for the request's time limit, not one per batch: asyncio.wait_for made a
        # task, a timer and two callbacks for every token of every stream (a tenth of the HTTP
        # process's busy time at 64 streams, py-spy on a fake engine).
        left = self._time_left(job)
        timer = None if left is None else loop.call_later(left, expire)
        try:
            while True:
                await ready.wait()
                if expired[0]:
                    raise request_timed_out(self.timeout_s)
                ready.clear()
                woken[0] = False  # before draining: an event appended after it wakes us again
                batch = []
                while arrived:
                    item = arrived.popleft()
                    if isinstance(item, BaseException):
                        if not batch:
                            raise item
                        arrived.appendleft(item)  # the tokens before it go out first
                        ready.set()
                        break
                    batch.append(item)
                if batch:
                    yield batch
                    if isinstance(batch[-1], RequestStats):
                        break
        finally:
            if timer is not None:
                timer.cancel()
            job.stop.set()

    def _time_left(self, job: Job) -> float | None:
        return None if job.deadline is None else max(0.0, job.deadline - time.monotonic())

    def _admit(self, kind: JobKind, bounded: bool) -> Job:
        now = time.monotonic()
        running, queue = self.max_running, self.max_queue
        with self._lock:
            if bounded and len(self._jobs) >= running + queue:
                waiting = len(self._jobs) - running
                retry = min(60, max(1, math.ceil(self._mean_s * (waiting + 1 - queue))))
                raise queue_full(self.label, waiting, retry)
            job = Job(kind, now + self.timeout_s if self.timeout_s else None)
            self._jobs.append(job)
        return job

    def _release(self, job: Job) -> None:
        with self._lock:
            if job in self._jobs:
                self._jobs.remove(job)
                if job.started is not None:
                    self._mean_s = 0.8 * self._mean_s + 0.2 * (time.monotonic() - job.started)

    def start(self, prepare: Callable[[], None] | None = None) -> None:
        """Start the engine's process ahead of load(), running prepare() there (its imports)
        until load() says what to build; an engine in this process has nothing to start."""
        if isinstance(self.loop, ProcessLoop):
            self.loop.start(prepare)

    async def load(self, make: Callable[[], Engine]) -> Engine:
        """make() builds the engine on the engine's thread (or in its process: then make must
        pickle)."""
        self.engine = await asyncio.wrap_future(self.loop.load(make))
        return self.engine

    def stop_all(self) -> None:
        """Ask every admitted job to stop at its next step (shutdown)."""
        with self._lock:
            for job in self._jobs:
                job.stop.set()

    async def aclose(self, timeout_s: float) -> bool:
        """Close the engine after its current step (stopped jobs end there), waiting at most
        timeout_s. Returns whether it closed in time."""
        self.stop_all()
        engine, self.engine = self.engine, None
        self.loop.close(engine)
        # The loop ends stopped generations, closes the engine and exits: wait for all of it,
        # so nothing of the engine's is still running when the process goes on to exit.
        return await asyncio.to_thread(self.loop.join, timeout_s)

    def close(self) -> None:
        self.stop_all()
        engine, self.engine = self.engine, None
        self.loop.close(engine)


class Waker:
    """Sets asyncio events from the engine's thread, many per hand-over: each step wakes every
    running stream, and one call_soon_threadsafe per stream (a lock and a write to the loop's
    self-pipe each) cost the engine thread ~0.3 ms a step at 64 streams."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._due: list[asyncio.Event] = []
        self._lock = threading.Lock()

    def wake(self, event: asyncio.Event) -> bool:
        """Set event on the event loop soon; False if that loop is closed."""
        with self._lock:
            self._due.append(event)
            if len(self._due) > 1:
                return True  # a hand-over is already on its way
        try:
            self.loop.call_soon_threadsafe(self._set_due)
        except RuntimeError:
            with self._lock:
                self._due.clear()
            return False
        return True

    def _set_due(self) -> None:
        with self._lock:
            due, self._due = self._due, []
        for event in due:
            event.set()
