"""The engine in a process of its own.

In one process the HTTP side (parsing, JSON, SSE, sockets) and the engine's loop take turns on
one GIL: at 64 streams on a GPU the loop waited for the interpreter more than for the device
(2.5-4 ms a step through the server against 1.4 ms alone). ProcessLoop offers EngineLoop's
interface (load, add, run_job, close, join, runtime) with the engine, its runtime and
its loop in a spawned child, the way vLLM splits its engine core from its API server.

The child may start before it is asked to load (start()): it imports its backend meanwhile
(seconds of torch or MLX), while the parent still decides and sizes the memory budget.

The wire, one pipe each way:
- parent -> child: ("load", make) first, then ("add", key, prompt_ids, params, arrival),
  ("stop", key), ("job", key, fn, beside_batch), ("close",). A stop is what the parent sees in
  a request's should_stop, forwarded when it first says so (looked at every stops_every_s while
  messages flow, every poll_s when the child is quiet).
- child -> parent: ("loaded", description, RuntimeStatus | None) or ("failed", exc) once, then
  after every step or job one ("events", items, RuntimeStatus | None) with all that happened in
  it, and ("closed",) at the end.
  A token travels as a plain tuple, its log-probabilities too: a dataclass costs ten times as
  much to pickle, and at 64 streams the child pickles 64 of them every 1-2 ms.
Times (a request's arrival) are time.perf_counter(), one clock for every process on the machine.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import pickle
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any

from .. import crash_stacks, gc_pauses
from ..base import (
    Cancelled,
    EngineClosed,
    EngineError,
    EngineInfo,
    Step,
    StopCheck,
    TokenLogprobs,
)
from ..generation import GenerationEngine, PromptSide
from ..tokenizer import import_transformers
from .loop import EngineLoop
from .plan import RuntimeStatus
from .runtime import Submission

log = logging.getLogger("duet.runtime")


def exit_reason(code: int | None) -> str:
    """A child's exit code as words: a negative code is the signal that ended it."""
    if code is None:
        return "still running or its exit code unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"

MODES = ("auto", "on", "off")


def wants_process(mode: str, device: str) -> bool:
    """on / off as asked; auto: on where the device is CUDA, where one step takes about a
    millisecond and sharing the GIL with the HTTP side costs most of it."""
    if mode not in MODES:
        raise ValueError(f"engine process mode '{mode}' is not one of {', '.join(MODES)}")
    return mode == "on" or (mode == "auto" and device.startswith("cuda"))


class EngineProcessError(EngineClosed):
    """The engine's process ended under running work (killed, out of memory, a crash)."""


class RemoteEngine(PromptSide):
    """What the HTTP side reads of an engine that runs in a child process: its name, info and
    tokenizer (a copy: prompts are encoded here, the child detokenizes). Its runtime's batch
    and KV pool come as the loop's status. Work goes through the ProcessLoop."""

    def __init__(self, *, name: str, device: str, info: EngineInfo, tokenizer):
        self.name = name
        self.device = device
        self.info = info
        self.tokenizer = tokenizer
        self.context_length = info.context_length

    def close(self) -> None:  # the child closes the real one
        pass


def _describe(engine) -> dict:
    return {"name": engine.name, "device": engine.device, "info": engine.info,
            "tokenizer": engine.tokenizer}


def _plain(scores: TokenLogprobs | None) -> tuple | None:
    """A token's log-probabilities as a plain tuple for the pipe: pickling the dataclass cost
    2.5 times as much (62 against 24 us for a step of 64 rows with 5 alternatives each)."""
    return None if scores is None else (scores.logprob, scores.top)


def _scores(plain: tuple | None) -> TokenLogprobs | None:
    return None if plain is None else TokenLogprobs(*plain)


def _portable(exc: BaseException) -> BaseException:
    """exc if it survives pickling (an EngineError keeps its type, so the HTTP side answers
    with the same status); else a RuntimeError carrying its type and message."""
    try:
        return pickle.loads(pickle.dumps(exc))
    except Exception:
        kind = EngineError if isinstance(exc, EngineError) else RuntimeError
        return kind(f"{type(exc).__name__}: {exc}")


# -- the child ------------------------------------------------------------------------------


class _Child:
    def __init__(self, conn, name: str):
        self.engine = None
        self.conn = conn
        self._out: list[tuple] = []
        self._out_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._stopped: set[int] = set()
        self.loop = EngineLoop(name, after=self.flush)

    def serve(self, commands) -> None:
        """Read the parent's commands until it says close or goes away."""
        while True:
            try:
                msg = commands.recv()
            except (EOFError, OSError):
                msg = ("close",)  # the parent is gone: stop as it would have asked
            kind = msg[0]
            if kind == "add":
                _, key, prompt_ids, params, arrival = msg
                sub = Submission(prompt_ids, params, partial(self._event, key),
                                 partial(self._is_stopped, key), partial(self._put, ("start", key)),
                                 arrival)
                try:
                    self.loop.add(sub)
                except RuntimeError as exc:  # closing
                    self._event(key, exc)
                    self.flush()
            elif kind == "stop":
                self._stopped.add(msg[1])
            elif kind == "job":
                _, key, fn, beside_batch = msg
                future = self.loop.run_job(fn, partial(self._is_stopped, key),
                                           partial(self._put, ("start", key)),
                                           beside_batch=beside_batch)
                future.add_done_callback(partial(self._job_done, key))
            elif kind == "close":
                self.loop.close(self.engine)
                self.loop.join()
                self.flush()
                self._send(("closed",))
                return

    def _is_stopped(self, key: int) -> bool:
        return key in self._stopped

    def _put(self, item: tuple) -> None:
        with self._out_lock:
            self._out.append(item)

    def _event(self, key: int, event) -> None:
        if type(event) is Step:
            prompt = event.prompt_logprobs
            self._put(("s", key, event.token_id, event.text, event.finish_reason,
                       _plain(event.logprobs),
                       None if prompt is None else tuple(_plain(p) for p in prompt)))
            return
        # Anything else ends the request: its RequestStats, or the exception that ended it.
        if isinstance(event, BaseException):
            event = _portable(event)
        self._stopped.discard(key)
        self._put(("e", key, event))

    def _job_done(self, key: int, future: Future) -> None:
        self._stopped.discard(key)
        exc = future.exception()
        if exc is not None:
            self._put(("fail", key, _portable(exc)))
            return
        try:  # pickled here, once: a result that cannot be must not break the whole message
            result = pickle.dumps(future.result())
        except Exception as err:
            self._put(("fail", key, RuntimeError(f"the job's result cannot be sent: {err}")))
            return
        self._put(("done", key, result))

    def flush(self) -> None:
        """On the loop's thread after each step or job: everything since the last flush."""
        with self._out_lock:
            items, self._out = self._out, []
        if items:
            self._send(("events", items, self.loop.status()))

    def send_status(self) -> None:
        """The runtime's status on its own, when it changes between steps (the engine's compiled
        step arrived while nothing ran)."""
        self._send(("events", [], self.loop.status()))

    def _send(self, msg: tuple) -> None:
        try:
            with self._send_lock:
                self.conn.send(msg)
        except (OSError, ValueError):
            pass  # the parent is gone; serve() sees it too and closes


def serve(commands, events, name: str, log_level: int,
          prepare: Callable[[], None] | None) -> None:
    """The child's main: prepare (imports) while the parent decides, then build the engine it
    is asked for, say so, and run its loop for the parent."""
    # Ctrl-C reaches the whole process group; the parent decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    crash_stacks.enable()
    logging.basicConfig(level=log_level,
                        format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    gc_pauses.watch()
    with gc_pauses.held():  # imports and the load: settled (collected, frozen) once loaded
        child = _start(commands, events, name, prepare)
    if child is not None:
        child.serve(commands)


def _start(commands, events, name: str, prepare: Callable[[], None] | None) -> _Child | None:
    """The engine built as asked, and the parent told; None if it was not (the parent went
    away, closed before asking, or the load failed: the parent was told)."""
    started = time.perf_counter()
    if prepare is not None:
        try:
            prepare()
        except Exception:  # the load says what is wrong, in its own words
            log.debug("preparing the engine process failed", exc_info=True)
    prepared = time.perf_counter()
    try:
        msg = commands.recv()
    except (EOFError, OSError):
        return None  # the parent went away before asking
    except Exception as exc:  # what to build could not be read here (an import it needs)
        events.send(("failed", _portable(exc)))
        return None
    if msg[0] != "load":
        return None  # closed before it was asked to load (the budget refused the model)
    # Where a start's seconds go before the load: the imports, then the parent's decisions.
    log.info("engine process: its imports took %.1fs, then it waited %.1fs to be asked to load",
             prepared - started, time.perf_counter() - prepared)
    make = msg[1]
    child = _Child(events, name)
    try:
        # Built on the loop's thread, which owns it from then on (MLX streams are per thread).
        engine = child.loop.load(make).result()
        description = _describe(engine)
    except BaseException as exc:
        child.loop.close()
        events.send(("failed", _portable(exc)))
        return None
    child.engine = engine
    child._send(("loaded", description, child.loop.status()))
    if isinstance(engine, GenerationEngine) and engine.compiled is not None:
        engine.compiled.add_done_callback(lambda _: child.send_status())
    return child


# -- the parent -----------------------------------------------------------------------------


@dataclass(eq=False)
class _Job:
    future: Future
    should_stop: StopCheck
    on_start: Callable[[], None] | None


class ProcessLoop:
    """EngineLoop's interface over an engine in a spawned child process. Its reader thread
    hands each request its events (on that thread, as EngineLoop does on its own) and forwards
    stops."""

    poll_s = 0.02  # how often stops are looked at while the child is quiet (a long job)
    # And while messages flow: not on every one, which at 64 streams come every 1-2 ms, and
    # asking 64 requests each time took a tenth of the reader's time (py-spy, H100).
    stops_every_s = 0.005

    def __init__(self, name: str):
        self.name = name
        self.engine: RemoteEngine | None = None
        self._status: RuntimeStatus | None = None  # None: the engine does not generate
        self._keys = itertools.count()
        self._subs: dict[int, Submission] = {}
        self._jobs: dict[int, _Job] = {}
        self._stop_sent: set[int] = set()
        self._lock = threading.Lock()  # _subs, _jobs and _closed
        self._send_lock = threading.Lock()
        # Two threads waiting on one child race in waitpid (the loser reads it as alive).
        self._wait_lock = threading.Lock()
        self._closed = False
        self._gone = False  # the child ended by itself (not closed by us)
        self._process = None
        self._commands = None
        self._events = None
        self._reader: threading.Thread | None = None

    # -- from any thread ----------------------------------------------------------------------

    def start(self, prepare: Callable[[], None] | None = None) -> None:
        """Start the child now, before load(): it runs prepare() (pickled, as make is; its
        imports, say) while the caller works out what to load."""
        if self._process is not None:
            return
        context = multiprocessing.get_context("spawn")  # CUDA and MLX do not survive a fork
        commands_in, commands_out = context.Pipe(duplex=False)
        events_in, events_out = context.Pipe(duplex=False)
        try:
            process = context.Process(
                target=serve, name=f"duet-engine-{self.name}", daemon=True,
                args=(commands_in, events_out, self.name, logging.getLogger().level, prepare))
            process.start()
        finally:
            commands_in.close()
            events_out.close()
        self._process = process
        self._commands, self._events = commands_out, events_in

    def load(self, make: Callable[[], Any]) -> Future:
        """Start the child unless start() did, and have it build the engine with make()
        (pickled: a module-level function or a partial of one); the future gives the
        RemoteEngine."""
        future: Future = Future()
        threading.Thread(target=self._start, args=(make, future), daemon=True,
                         name=f"engine-{self.name}-start").start()
        return future

    def add(self, sub: Submission) -> None:
        with self._lock:
            if self._closed:
                raise self._closed_error()
            key = next(self._keys)
            self._subs[key] = sub
        try:
            self._send(("add", key, list(sub.prompt_ids), sub.params, sub.arrival))
        except (OSError, ValueError) as exc:  # the child died before the reader noticed
            with self._lock:
                self._subs.pop(key, None)
            raise EngineProcessError(f"the {self.name} engine's process is gone: {exc}") from exc

    def run_job(self, fn: Callable[[Any, StopCheck], Any], should_stop: StopCheck,
                on_start: Callable[[], None] | None = None, *, beside_batch: bool = False
                ) -> Future:
        """fn(engine, should_stop) in the child between two steps (EngineLoop.run_job's
        beside_batch too); fn must pickle."""
        future: Future = Future()
        if should_stop():  # stopped before it was sent: the child would start it first
            future.set_exception(Cancelled())
            return future
        with self._lock:
            if self._closed:
                future.set_exception(self._closed_error())
                return future
            key = next(self._keys)
            self._jobs[key] = _Job(future, should_stop, on_start)
        try:
            self._send(("job", key, fn, beside_batch))
        except Exception as exc:  # fn does not pickle: a bug of ours, said plainly
            with self._lock:
                self._jobs.pop(key, None)
            future.set_exception(RuntimeError(f"the job cannot be sent to the engine: {exc}"))
        return future

    def close(self, engine=None) -> None:
        """The child ends running generations as cancelled at its next step, closes its
        engine and exits."""
        with self._lock:
            if self._closed and not self._gone:
                return
            self._closed = True
        try:  # a child whose engine was lost may still run: it is told too
            self._send(("close",))
        except (OSError, ValueError, AttributeError):
            pass  # never started, or already gone

    @property
    def pid(self) -> int | None:
        """The process the engine runs in: the child (None before it started)."""
        return None if self._process is None else self._process.pid

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the child to exit; one that has not by then is killed (no process of ours
        outlives the server). True when it exited by itself."""
        if self._process is None:
            return True
        with self._wait_lock:
            self._process.join(timeout)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(5)
                return False
        if self._reader is not None:
            self._reader.join(timeout)
        return True

    @property
    def alive(self) -> bool:
        """False once the child is gone or closing: its worker is then loaded anew."""
        # Not is_alive(): a waitpid here would race the one in join() on another thread. The
        # reader marks the loop closed when the child's pipe ends, which is how death shows.
        return not self._closed and self.engine is not None

    # -- internals ------------------------------------------------------------------------------

    def _send(self, msg: tuple) -> None:
        with self._send_lock:
            self._commands.send(msg)

    def _start(self, make: Callable[[], Any], future: Future) -> None:
        try:
            self.start()
        except Exception as exc:
            future.set_exception(RuntimeError(f"the engine process could not start: {exc}"))
            return
        events_in = self._events
        try:
            self._send(("load", make))
        except Exception as exc:  # make does not pickle (a bug of ours), or the child is gone
            self.close()  # a child still waiting for what to build exits
            future.set_exception(RuntimeError(f"the engine process could not be asked to load: "
                                              f"{exc}"))
            return
        # What its answer unpickles with (its tokenizer's library: seconds), while it loads.
        import_transformers()
        try:
            msg = events_in.recv()
        except (EOFError, OSError):
            self._process.join(5)
            future.set_exception(RuntimeError(
                f"the engine process exited while loading (exit code {self._process.exitcode})"))
            return
        if msg[0] == "failed":
            self._process.join(30)
            future.set_exception(msg[1])
            return
        engine = RemoteEngine(**msg[1])
        self.engine = engine
        self._status = msg[2]  # None: the engine does not generate
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name=f"engine-{self.name}-events")
        self._reader.start()
        future.set_result(engine)

    def _read(self) -> None:
        checked = time.perf_counter()
        while True:
            try:
                msg = self._events.recv() if self._events.poll(self.poll_s) else None
            except (EOFError, OSError):
                self._ended()
                return
            if msg is not None:
                if msg[0] == "closed":
                    self._ended()
                    return
                self._dispatch(msg[1], msg[2])
            now = time.perf_counter()
            if msg is None or now - checked >= self.stops_every_s:
                checked = now
                self._forward_stops()

    def status(self) -> RuntimeStatus | None:
        """The child's runtime as of its last step (None for an engine that does not
        generate)."""
        return self._status

    def _dispatch(self, items: list[tuple], status: RuntimeStatus | None) -> None:
        self._status = status
        subs, jobs = self._subs, self._jobs
        for item in items:
            kind, key = item[0], item[1]
            if kind == "s":
                sub = subs.get(key)
                if sub is not None:
                    token, text, finish, scored, prompt = item[2:]
                    sub.emit(Step(token, text, finish, _scores(scored), None if prompt is None
                                  else tuple(_scores(p) for p in prompt)))
            elif kind == "e":  # a request's last event: its stats or the error that ended it
                with self._lock:
                    sub = subs.pop(key, None)
                    self._stop_sent.discard(key)
                    if isinstance(item[2], EngineProcessError):
                        # The child's engine is lost and its process ending (a tensor-parallel
                        # rank died): refuse new work now, before its pipe closes, so that a
                        # client that retries at once gets an engine loaded anew.
                        self._gone = self._closed = True
                if sub is not None:
                    sub.emit(item[2])
            elif kind == "start":
                target = subs.get(key) or jobs.get(key)
                if target is not None and target.on_start is not None:
                    target.on_start()
            else:  # "done" / "fail": a job's end
                with self._lock:
                    job = jobs.pop(key, None)
                    self._stop_sent.discard(key)
                if job is not None:
                    if kind == "done":
                        job.future.set_result(pickle.loads(item[2]))
                    else:
                        job.future.set_exception(item[2])

    def _forward_stops(self) -> None:
        with self._lock:
            checks = [(k, s.should_stop) for k, s in self._subs.items()]
            checks += [(k, j.should_stop) for k, j in self._jobs.items()]
        for key, should_stop in checks:
            if key not in self._stop_sent and should_stop is not None and should_stop():
                self._stop_sent.add(key)
                try:
                    self._send(("stop", key))
                except (OSError, ValueError):
                    return  # gone: _read sees it next

    def _closed_error(self) -> EngineClosed:
        if self._gone:
            return EngineProcessError(f"the {self.name} engine's process is gone")
        return EngineClosed(f"the {self.name} engine is closed")

    def _ended(self) -> None:
        """The child is gone: whatever it still owed ends with an error, never a hang."""
        with self._lock:
            self._gone = self._gone or not self._closed
            self._closed = True
            subs, self._subs = self._subs, {}
            jobs, self._jobs = self._jobs, {}
        code = None
        if self._process is not None:
            with self._wait_lock:
                self._process.join(5)
                code = self._process.exitcode
        error = EngineProcessError(f"the {self.name} engine's process ended (exit code {code})")
        if self._gone:
            # Said where the operator looks: the requests it fails say it too, but a process
            # killed by a signal (a crash in native code, the kernel's OOM killer) leaves no
            # other trace in the server's log.
            log.error("the %s engine's process ended unexpectedly (%s); %d requests failed with "
                      "it", self.name, exit_reason(code), len(subs) + len(jobs))
        for sub in subs.values():
            sub.emit(error)
        for job in jobs.values():
            job.future.set_exception(error)
