"""One worker thread per engine: units of work run one at a time, in arrival order, never mixed.

The engine lives on its thread (MLX streams are thread-local; torch is happiest that way too).
Every unit of work (a generation, a classification, a bench run) is a Job: admitted against the
queue bound, given a stop flag and a deadline (the request time limit, its wait included), and
counted as pending until the engine thread has finished with it, not merely until its caller
gave up. A caller that leaves or runs out of time sets the stop flag; the engine reads it at its
next step (a decode step, a piece of a classification) and the thread moves on.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from engines.base import Cancelled, Engine, GenerationEvent, StopCheck

from .errors import queue_full, request_timed_out

T = TypeVar("T")
_END = object()
JobKind = Literal["generation", "classification", "bench"]


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
    busy_since: float | None  # time.time() at which the running job started
    overdue_s: float  # how far the running job is past its deadline (0 if not)
    kind: JobKind | None  # the running job's


class EngineWorker:
    def __init__(self, label: str, *, max_queue: int = 32, timeout_s: float | None = None):
        self.label = label
        self.engine: Engine | None = None
        self.max_queue = max_queue
        self.timeout_s = timeout_s
        self._jobs: list[Job] = []  # admitted and not finished by the engine thread, in order
        self._lock = threading.Lock()  # _jobs changes on the event loop and the engine thread
        self._mean_s = 1.0  # a running mean of job times, for Retry-After
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{label}")

    @property
    def loaded(self) -> bool:
        return self.engine is not None

    @property
    def pending(self) -> int:
        """Jobs admitted and not finished on the engine thread, the running one included."""
        return len(self._jobs)

    def status(self) -> WorkerStatus:
        with self._lock:
            jobs = list(self._jobs)
        running = next((j for j in jobs if j.started is not None), None)
        if running is None:
            return WorkerStatus(0, len(jobs), None, 0.0, None)
        now = time.monotonic()
        overdue = max(0.0, now - running.deadline) if running.deadline is not None else 0.0
        return WorkerStatus(1, len(jobs) - 1, time.time() - (now - running.started), overdue,
                            running.kind)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn on the engine's thread, after everything queued before it. Not admitted nor
        counted: for loading and closing, not for requests."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def call(self, kind: JobKind, fn: Callable[[Engine, StopCheck], T], *,
                   bounded: bool = True) -> T:
        """fn(engine, should_stop) on the engine's thread as one job. A caller that is
        cancelled, or whose time runs out (504), stops the job at its next step; either way
        the job stays pending until the thread is done with it. bounded=False admits past the
        queue bound (a bench's next run, which keeps at most one job queued)."""
        job = self._admit(kind, bounded)
        done = self._submit(job, fn)
        try:
            # shield: a queued job must still reach the thread, which is where it is released.
            return await asyncio.wait_for(asyncio.shield(done), self._time_left(job))
        except TimeoutError:
            raise request_timed_out(self.timeout_s) from None
        finally:
            job.stop.set()

    async def stream(
        self, start: Callable[[Engine, StopCheck], Iterator[GenerationEvent]]
    ) -> AsyncIterator[GenerationEvent]:
        """Yield the events of start(engine, should_stop) as the engine thread produces them.

        If the consumer stops early (a client went away) or the time limit passes, the engine is
        told to stop at its next step; the job is released once the thread has let it go."""
        job = self._admit("generation", True)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def post(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the event loop is gone: the server is shutting down
                job.stop.set()

        def produce(engine: Engine, should_stop: StopCheck) -> None:
            try:
                for event in start(engine, should_stop):
                    post(event)
                    if job.stop.is_set():
                        break
            except BaseException as exc:  # handed to the consumer, which re-raises it
                post(exc)
            finally:
                post(_END)

        try:
            self._submit(job, produce)
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), self._time_left(job))
                except TimeoutError:
                    raise request_timed_out(self.timeout_s) from None
                if item is _END:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            job.stop.set()

    def _time_left(self, job: Job) -> float | None:
        return None if job.deadline is None else max(0.0, job.deadline - time.monotonic())

    def _admit(self, kind: JobKind, bounded: bool) -> Job:
        now = time.monotonic()
        with self._lock:
            if bounded and len(self._jobs) > self.max_queue:
                waiting = len(self._jobs) - 1
                retry = min(60, max(1, math.ceil(self._mean_s * (waiting + 1 - self.max_queue))))
                raise queue_full(self.label, waiting, retry)
            job = Job(kind, now + self.timeout_s if self.timeout_s else None)
            self._jobs.append(job)
        return job

    def _submit(self, job: Job, fn: Callable[[Engine, StopCheck], T]) -> asyncio.Future:
        done = asyncio.get_running_loop().run_in_executor(self._executor, self._execute, job, fn)
        # Read the outcome even when nobody waits for it any more (no "never retrieved" noise).
        done.add_done_callback(lambda f: f.cancelled() or f.exception())
        return done

    def _execute(self, job: Job, fn: Callable[[Engine, StopCheck], T]) -> T:
        """On the engine thread: run the job unless it was stopped while it waited."""
        try:
            if job.stop.is_set():
                raise Cancelled()
            job.started = time.monotonic()
            return fn(self.engine, job.stop.is_set)
        finally:
            with self._lock:
                self._jobs.remove(job)
                if job.started is not None:
                    self._mean_s = 0.8 * self._mean_s + 0.2 * (time.monotonic() - job.started)

    async def load(self, make: Callable[[], Engine]) -> Engine:
        self.engine = await self.run(make)
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
        closed = True
        if engine is not None:
            done = asyncio.get_running_loop().run_in_executor(self._executor, engine.close)
            try:
                await asyncio.wait_for(done, timeout_s)
            except TimeoutError:
                closed = False
        self._executor.shutdown(wait=False, cancel_futures=True)
        return closed

    def close(self) -> None:
        self.stop_all()
        engine, self.engine = self.engine, None
        if engine is not None:
            self._executor.submit(engine.close)
        self._executor.shutdown(wait=False, cancel_futures=True)
