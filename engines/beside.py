"""Work started on a thread of its own, beside the caller's, its outcome a Future."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


class _SwitchInterval:
    """The interpreter's GIL switch interval lowered while any such work runs, restored after
    the last: one process-wide setting, so its holders are counted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: list[float] = []
        self._saved = 0.0

    def enter(self, seconds: float) -> None:
        with self._lock:
            if not self._holders:
                self._saved = sys.getswitchinterval()
            self._holders.append(seconds)
            sys.setswitchinterval(min([self._saved, *self._holders]))

    def leave(self, seconds: float) -> None:
        with self._lock:
            self._holders.remove(seconds)
            sys.setswitchinterval(min([self._saved, *self._holders]))


_SWITCH = _SwitchInterval()


def run_beside(fn: Callable[[], T], name: str, switch_interval_s: float | None = None
               ) -> Future[T]:
    """fn() on a daemon thread (one that never holds up the interpreter's exit, as a compile
    under way would); the future holds its result, or what it raised.

    switch_interval_s: while fn runs, the GIL changes hands at least this often (and never
    less often than it did). For long pure-Python work (a compile) beside a thread that
    serves: each of the server's GPU ops lets go of the GIL and waits up to the switch
    interval to get it back, CPython's 5 ms, which made a 1B eager decode step take 1.4-2.4 s
    while the decode step compiled (py-spy, H100, 2026-11-27)."""
    future: Future[T] = Future()

    def run() -> None:
        if switch_interval_s is not None:
            _SWITCH.enter(switch_interval_s)
        try:
            result, error = fn(), None
        except BaseException as exc:  # noqa: BLE001  raised where the future is read
            result, error = None, exc
        if switch_interval_s is not None:  # restored before anyone waiting sees it done
            _SWITCH.leave(switch_interval_s)
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
