"""Where the runtime's per-request output work runs: detokenizing, stop strings, events, stats.

Inline, it runs at once on the step's thread. Threaded, it runs in the order it was posted on a
thread of its own, beside the engine's next step: an executor whose step is bound by the host
(mlx-cuda builds and launches a 1B model's step in about as long as the GPU runs it) would
otherwise wait for every microsecond of it, and MLX lets go of the GIL while it evaluates."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

log = logging.getLogger("duet.runtime")


class Delivery:
    def __init__(self, name: str | None = None):
        """name: run on a thread of that name; None: inline."""
        self.threaded = name is not None
        if not self.threaded:
            return
        self._work: deque[tuple[Callable, tuple]] = deque()
        self._cv = threading.Condition()
        self._running = False  # a batch taken off the queue is being run
        self._unfinished = 0  # posted and not run yet
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def post(self, fn: Callable, *args) -> None:
        """fn(*args), after everything posted before it. Inline, what fn raises reaches the
        caller; threaded, it is logged (a bug of ours) and the work after it still runs."""
        if not self.threaded:
            fn(*args)
            return
        with self._cv:
            self._work.append((fn, args))
            self._unfinished += 1
            self._cv.notify_all()

    def wait_behind(self, most: int) -> None:
        """Return once at most `most` of the posted works are unfinished: the step's thread
        runs ahead of the output by that much and no further, however busy the machine (a
        stop string the delivery sees ends its sequence a bounded number of steps later)."""
        if not self.threaded or threading.current_thread() is self._thread:
            return
        with self._cv:
            while self._unfinished > most:
                self._cv.wait()

    def drain(self) -> None:
        """Return once everything posted so far has run."""
        if not self.threaded or threading.current_thread() is self._thread:
            return
        with self._cv:
            while self._work or self._running:
                self._cv.wait()

    def close(self) -> None:
        """Run what is posted, then end the thread."""
        if not self.threaded:
            return
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._work and not self._closing:
                    self._cv.wait()
                if not self._work:
                    return
                work = list(self._work)
                self._work.clear()
                self._running = True
            for fn, args in work:
                try:
                    fn(*args)
                except Exception:
                    log.exception("delivering a step's output failed")
                with self._cv:
                    self._unfinished -= 1
                    self._cv.notify_all()
            with self._cv:
                self._running = False
                self._cv.notify_all()

