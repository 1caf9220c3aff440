"""One thread per loaded model. It owns the engine (MLX streams are thread-local; torch is
happiest that way too) and alternates between the runtime's steps, which advance every running
generation at once, and jobs (loading, a classification, a bench run, closing), which run one
at a time between two steps in the order they came. A job may let the batch go on beside it
(a classification): then the running generations take a step each time the job asks whether
to stop, which it does between two pieces of its work, so their streams do not wait for it.

Other threads talk to it only through submit(), load(), run_job(), add() and close(); events
flow back through each generation's emit callback, on this thread or on the runtime's delivery
thread (delivery.py). process.py offers the same
interface with the engine in a child process."""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from .. import gc_pauses
from ..base import Cancelled, EngineClosed, StopCheck
from ..generation import GenerationEngine
from .plan import RuntimeStatus
from .runtime import Runtime, Submission

log = logging.getLogger("duet.runtime")


class EngineLoop:
    def __init__(self, name: str, *, after: Callable[[], None] | None = None, **runtime_options):
        """after, if given, is called after every step or job (the engine process sends the
        step's events there): on the loop's thread, or after a step's events on the runtime's
        delivery thread."""
        self.name = name
        self._after = after
        self.engine: Any = None
        self.runtime: Runtime | None = None
        self._runtime_options = runtime_options
        self._jobs: deque[tuple[Callable[[], Any], Future]] = deque()
        self._new: deque[Submission] = deque()
        self._wake = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=f"engine-{name}", daemon=True)
        self._thread.start()

    # -- from any thread ----------------------------------------------------------------------

    def submit(self, fn: Callable[[], Any]) -> Future:
        """Run fn on the loop's thread between two steps, after the jobs submitted before it."""
        future: Future = Future()
        with self._wake:
            if self._closing:
                future.set_exception(EngineClosed(f"the {self.name} engine is closed"))
                return future
            self._jobs.append((fn, future))
            self._wake.notify()
        return future

    def load(self, make: Callable[[], Any]) -> Future:
        """Build the engine on the loop's thread (make()) and attach it; the future gives it."""
        def build():
            engine = make()
            self.attach(engine)
            return engine

        return self.submit(build)

    def run_job(self, fn: Callable[[Any, StopCheck], Any], should_stop: StopCheck,
                on_start: Callable[[], None] | None = None, *, beside_batch: bool = False
                ) -> Future:
        """fn(engine, should_stop) between two steps; Cancelled without running it if
        should_stop already says so when its turn comes. beside_batch: the running batch takes
        a step (and new generations join it) each time fn asks should_stop; fn must not
        generate itself (it shares the runtime's thread, not its batch)."""
        def job():
            if should_stop():
                raise Cancelled()
            if on_start is not None:
                on_start()
            check = self._stepping(should_stop) if beside_batch else should_stop
            return fn(self.engine, check)

        return self.submit(job)

    def attach(self, engine) -> None:
        """Called on the loop's thread (a job) once the engine exists."""
        self.engine = engine
        if isinstance(engine, GenerationEngine):  # a classifier or an embedder has no batch
            self.runtime = Runtime(engine, **self._runtime_options)
        gc_pauses.settle(f"the {self.name} engine loaded",
                         engine.compiled if isinstance(engine, GenerationEngine) else None)

    def add(self, sub: Submission) -> None:
        """Queue a generation; it joins the running batch at the next step. Errors that it can
        never get past arrive through sub.emit."""
        with self._wake:
            if self._closing:
                raise EngineClosed(f"the {self.name} engine is closed")
            self._new.append(sub)
            self._wake.notify()

    def close(self, engine=None) -> None:
        """Stop at the next step: running generations end as cancelled, queued jobs are
        refused, the thread exits. Jobs submitted before still run, then engine.close() if
        an engine is given."""
        if engine is not None:
            self.submit(engine.close)
        with self._wake:
            self._closing = True
            self._wake.notify()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closing

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- the loop's thread --------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._jobs or self._new or self._closing or self._busy()):
                    self._wake.wait()
                job = self._jobs.popleft() if self._jobs else None
                new = list(self._new)
                self._new.clear()
                closing = self._closing and not self._jobs and job is None
            for sub in new:
                self._admit(sub)
            if job is not None:
                self._run_job(*job)
            if closing:
                break
            if not self._step_then_after() and self._after is not None:
                self._after()
        if self.runtime is not None:
            self.runtime.close()
        if self._after is not None:
            self._after()

    def status(self) -> RuntimeStatus | None:
        """The runtime as of its last step (None for an engine that does not generate)."""
        return None if self.runtime is None else self.runtime.status()

    @property
    def pid(self) -> int | None:
        """The process the engine runs in: this one."""
        return os.getpid()

    def _stepping(self, should_stop: StopCheck) -> StopCheck:
        """should_stop, which first admits what arrived and takes one step of the batch."""
        def check() -> bool:
            with self._wake:
                new = list(self._new)
                self._new.clear()
            for sub in new:
                self._admit(sub)
            self._step_then_after()
            return should_stop()

        return check

    def _step_then_after(self) -> bool:
        """One step if there is work, `after` following its events (wherever the runtime
        delivers them); whether it stepped."""
        if not self._busy():
            return False
        self._step()
        if self._after is not None:
            self.runtime.delivery.post(self._after)
        return True

    def _busy(self) -> bool:
        return self.runtime is not None and self.runtime.has_work

    def _admit(self, sub: Submission) -> None:
        if self.runtime is None:
            sub.emit(RuntimeError(f"the {self.name} engine has no generation loop"))
            return
        try:
            self.runtime.add(sub)
        except Exception as exc:
            sub.emit(exc)

    def _run_job(self, fn: Callable[[], Any], future: Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)

    def _step(self) -> None:
        try:
            self.runtime.step()
        except Exception:  # a bug of ours: end every request rather than spin on it
            log.exception("the %s runtime failed", self.name)
            self.runtime.stop_all()
