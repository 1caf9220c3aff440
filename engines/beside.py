"""Work started on a thread of its own, beside the caller's, its outcome a Future."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


def run_beside(fn: Callable[[], T], name: str) -> Future[T]:
    """fn() on a daemon thread (one that never holds up the interpreter's exit, as a compile
    under way would); the future holds its result, or what it raised."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001  raised where the future is read
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
