"""One worker thread per engine: requests run one at a time, in arrival order, never mixed.

The engine lives on its thread (MLX streams are thread-local; torch is happiest that way too),
and each generation is pumped from that thread into the event loop through a queue. Admission is
bounded (max_queue requests may wait behind the running one) and each generation has a time
limit, its wait included.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from engines.base import Engine, GenerationEvent

from .errors import queue_full, request_timed_out

T = TypeVar("T")
_END = object()


class EngineWorker:
    def __init__(self, label: str, *, max_queue: int = 32, timeout_s: float | None = None):
        self.label = label
        self.engine: Engine | None = None
        self.max_queue = max_queue
        self.timeout_s = timeout_s
        # Generations admitted and not finished, the running one included.
        self.pending = 0
        self._mean_s = 1.0  # a running mean of generation times, for Retry-After
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{label}")

    @property
    def loaded(self) -> bool:
        return self.engine is not None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn on the engine's thread, after every request queued before it."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """fn on the engine's thread as one admitted request (a classification): it counts
        against the queue bound like a generation, and in the queue depth."""
        started = self._admit()
        try:
            return await self.run(fn, *args)
        finally:
            self._release(started)

    def _admit(self) -> float:
        if self.pending > self.max_queue:
            retry = min(60, max(1, math.ceil(self._mean_s * (self.pending - self.max_queue))))
            raise queue_full(self.label, self.pending - 1, retry)
        self.pending += 1
        return time.monotonic()

    def _release(self, started: float) -> None:
        self.pending -= 1
        self._mean_s = 0.8 * self._mean_s + 0.2 * (time.monotonic() - started)

    async def load(self, make: Callable[[], Engine]) -> Engine:
        self.engine = await self.run(make)
        return self.engine

    async def stream(
        self, start: Callable[[Engine, Callable[[], bool]], Iterator[GenerationEvent]]
    ) -> AsyncIterator[GenerationEvent]:
        """Yield the events of start(engine, should_stop) as the engine thread produces them.

        If the consumer stops early (a client went away) or the time limit passes, the engine is
        told to stop at its next step and the thread is freed for the next request."""
        started = self._admit()
        deadline = started + self.timeout_s if self.timeout_s else None
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()

        def post(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the event loop is gone: the server is shutting down
                cancelled.set()

        def produce() -> None:
            try:
                if cancelled.is_set():  # the client left while the request was queued
                    return
                for event in start(self.engine, cancelled.is_set):
                    post(event)
                    if cancelled.is_set():
                        break
            except BaseException as exc:  # handed to the consumer, which re-raises it
                post(exc)
            finally:
                post(_END)

        try:
            loop.run_in_executor(self._executor, produce)
            while True:
                try:
                    left = None if deadline is None else deadline - time.monotonic()
                    item = await asyncio.wait_for(queue.get(), left)
                except TimeoutError:
                    raise request_timed_out(self.timeout_s) from None
                if item is _END:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            cancelled.set()
            self._release(started)

    async def aclose(self, timeout_s: float) -> bool:
        """Close the engine after its current step (a cancelled generation stops there), waiting
        at most timeout_s. Returns whether it closed in time."""
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
        engine, self.engine = self.engine, None
        if engine is not None:
            self._executor.submit(engine.close)
        self._executor.shutdown(wait=False, cancel_futures=True)
