"""One worker thread per engine: requests run one at a time, in arrival order, never mixed.

The engine lives on its thread (MLX streams are thread-local; torch is happiest that way too),
and each generation is pumped from that thread into the event loop through a queue.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from engines.base import Engine, GenerationEvent

T = TypeVar("T")
_END = object()


class EngineWorker:
    def __init__(self, label: str):
        self.label = label
        self.engine: Engine | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{label}")

    @property
    def loaded(self) -> bool:
        return self.engine is not None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn on the engine's thread, after every request queued before it."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def load(self, make: Callable[[], Engine]) -> Engine:
        self.engine = await self.run(make)
        return self.engine

    async def stream(
        self, start: Callable[[Engine, Callable[[], bool]], Iterator[GenerationEvent]]
    ) -> AsyncIterator[GenerationEvent]:
        """Yield the events of start(engine, should_stop) as the engine thread produces them.

        If the consumer stops early (a client went away), the engine is told to stop at its
        next step and the thread is freed for the next request."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()

        def produce() -> None:
            try:
                if cancelled.is_set():  # the client left while the request was queued
                    return
                for event in start(self.engine, cancelled.is_set):
                    loop.call_soon_threadsafe(queue.put_nowait, event)
                    if cancelled.is_set():
                        break
            except BaseException as exc:  # handed to the consumer, which re-raises it
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, _END)

        loop.run_in_executor(self._executor, produce)
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            cancelled.set()

    def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            self._executor.submit(engine.close)
        self._executor.shutdown(wait=False, cancel_futures=True)
