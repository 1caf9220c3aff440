"""Work a request needs before it can join the batch, done on a thread beside the step's: a
grammar's matcher and first mask (a few milliseconds each, and the vocabulary's llguidance view
once per model, over a second), which on the step's thread held up every running stream."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Generic, TypeVar

T = TypeVar("T")


class Preparer(Generic[T]):
    """make() run on a thread of its own for each item; ready() hands back the finished ones,
    in the order they were submitted among those finished."""

    def __init__(self, name: str):
        self._name = name
        self._pool: ThreadPoolExecutor | None = None  # made on first use
        self._pending: list[tuple[T, Future]] = []

    def __bool__(self) -> bool:
        return bool(self._pending)

    def submit(self, item: T, make: Callable[[], object]) -> None:
        if self._pool is None:
            # One thread: preparations come one per request and llguidance parallelises its
            # own work; more would only compete with the step for the CPU.
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=self._name)
        self._pending.append((item, self._pool.submit(make)))

    def ready(self) -> list[tuple[T, object]]:
        """(item, make()'s result or the exception it raised) for each finished one."""
        done, pending = [], []
        for entry in self._pending:
            (done if entry[1].done() else pending).append(entry)
        self._pending = pending
        return [(item, f.exception() or f.result()) for item, f in done]

    def wait(self, timeout: float) -> None:
        """Until one finishes or timeout seconds pass."""
        if self._pending:
            wait([f for _, f in self._pending], timeout, return_when=FIRST_COMPLETED)

    def drop(self, keep: Callable[[T], bool]) -> list[T]:
        """Forget the items keep() refuses (their work finishes unread); they are returned."""
        dropped, kept = [], []
        for entry in self._pending:
            (kept if keep(entry[0]) else dropped).append(entry)
        self._pending = kept
        return [item for item, _ in dropped]

    def close(self) -> None:
        self._pending = []
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
