"""A scheduler, an executor and the requests' outputs, advanced one step at a time.

The server's loop (loop.py) drives one on its own thread; a one-off generation (solo.py) drives
one inline. Everything here runs on the thread that calls step()."""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .. import gc_pauses
from ..base import Cancelled, SamplingParams, StopCheck, TokenLogprobs
from ..grammar import GrammarState, PreparedGrammars
from ..processing import Processing
from .delivery import Delivery
from .output import RequestOutput
from .plan import RowSampling, RuntimeStatus, StepPlan
from .prepare import Preparer
from .scheduler import Scheduler, Sequence

if TYPE_CHECKING:  # generation.py builds on this module
    from ..generation import GenerationEngine

log = logging.getLogger("duet.runtime")

Emit = Callable[[object], None]  # Step / RequestStats, or the exception that ended it


@dataclass(eq=False)
class Submission:
    """A generation handed to the runtime. emit is called on the runtime's thread with each
    event; the last is a RequestStats or an exception."""

    prompt_ids: list[int]
    params: SamplingParams
    emit: Emit
    should_stop: StopCheck | None = None
    on_start: Callable[[], None] | None = None  # first scheduled
    arrival: float = field(default_factory=time.perf_counter)


@dataclass(eq=False)
class _Live:
    sub: Submission
    seq: Sequence
    out: RequestOutput
    started: bool = False


class Runtime:
    def __init__(self, engine: GenerationEngine, *, max_batch: int | None = None,
                 max_prefill_tokens: int | None = None, threaded_output: bool | None = None,
                 prepare_aside: bool = True, prefix_cache: bool | None = None):
        """threaded_output: deliver each step's output on a thread of its own (None: as the
        engine's executor asks). prepare_aside: make a request's grammar on a thread beside
        the steps (prepare.py), not in add(). prefix_cache: reuse the KV of earlier
        sequences' blocks, where the executor's KV lives in the pool (kv.py); None: as the
        engine was set up."""
        self.engine = engine
        prefix_cache = engine.prefix_cache if prefix_cache is None else prefix_cache
        self.executor = engine.executor(prefix_cache=prefix_cache)
        traits = self.executor.traits
        self.pipelined = traits.pipelined
        self.answers_late = traits.answers_late
        self.scheduler = Scheduler(
            engine.kv_pool,
            max_batch=max_batch or engine.max_batch,
            max_prefill_tokens=max_prefill_tokens or engine.max_prefill_tokens,
            chunked_prefill=not traits.answers_late,
            pipelined=self.pipelined, processes_in_flight=traits.processes_in_flight,
            prefix_cache=prefix_cache and traits.reuses_kv_blocks,
        )
        self._launched = None  # (plan, handle) of a pipelined step not read back yet
        self._live: dict[int, _Live] = {}
        # Requests whose prompt the engine scores apart, a piece a step, before they join.
        self._scoring: deque[tuple[_Live, Generator]] = deque()
        self._preparing: Preparer[Submission] | None = (
            Preparer(f"{engine.name}-prepare") if prepare_aside else None)
        self._grammars: PreparedGrammars | None = None  # each grammar's matcher, made once
        self._ids = engine.seq_ids
        self._meter = engine.meter
        self.last_batch = 0
        # Off the step's thread for an executor that asks for it (MLX): see delivery.py.
        threaded = traits.output_thread if threaded_output is None else threaded_output
        self.delivery = Delivery(f"{engine.name}-output" if threaded else None)
        # Ended by their text (a stop string), seen on the delivery thread: they leave the
        # batch at the next step.
        self._ended: deque[int] = deque()
        # Running means of a step's wall time and of the executor's share of it: what is left
        # is the runtime's own host work (scheduling, detokenizing, handing events over).
        self.step_s = 0.0
        self.execute_s = 0.0
        self._kept = 0  # tokens the executor's own prefix cache keeps, as it last said

    @property
    def has_work(self) -> bool:
        return (self.scheduler.has_work or self._launched is not None
                or bool(self._preparing) or bool(self._scoring))

    def status(self) -> RuntimeStatus:
        pool = self.scheduler.pool
        collections = gc_pauses.watch().by_generation
        return RuntimeStatus(self.last_batch, self.step_s, self.execute_s, pool.used_blocks,
                             self.scheduler.max_batch, pool.num_blocks, pool.block_size,
                             pool.bytes_per_token,
                             pool.cached_blocks * pool.block_size + self._kept,
                             self.scheduler.cached_tokens, self.engine.rank_status(),
                             self.engine.compiled is not None and not self.engine.compiled.done(),
                             compile_error(self.engine.compiled),
                             sum(g.total_s for g in collections), collections[-1].collections)

    def add(self, sub: Submission) -> None:
        """Queue a generation. Errors a request can never get past (too long for the context or
        the KV pool) are raised here, before any event."""
        self.engine.check_fits(len(sub.prompt_ids), sub.params.max_tokens)
        if sub.params.grammar is not None and self._preparing is not None:
            self._preparing.submit(sub, lambda: self._grammar(sub.params))
            return
        self._queue(sub, self._grammar(sub.params))

    def _queue(self, sub: Submission, grammar: GrammarState | None) -> None:
        seed = sub.params.seed if sub.params.seed is not None else random.getrandbits(63)
        seq = Sequence(next(self._ids), list(sub.prompt_ids), sub.params,
                       RowSampling.of(sub.params, seed, Processing.of(sub.params, grammar)),
                       arrival=sub.arrival)
        out = RequestOutput(self.engine.tokenizer, sub.params, prompt_tokens=len(sub.prompt_ids),
                            engine=self.engine.name, device=self.engine.device,
                            arrival=sub.arrival)
        live = _Live(sub, seq, out)
        self._live[seq.seq_id] = live
        if sub.params.prompt_logprobs is not None and not self.executor.traits.scores_prompts:
            # Beside the batch, a piece a step, for an executor that does not score the chunks
            # it prefills. The sequence joins once its prompt is scored.
            self._scoring.append(
                (live, self.engine.score_prompt(sub.prompt_ids, sub.params.prompt_logprobs)))
            return
        self.scheduler.add(seq)

    def _score_piece(self) -> None:
        """One piece of the first prompt waiting to be scored; a scored sequence joins."""
        while self._scoring and self._scoring[0][0].seq.seq_id not in self._live:
            self._scoring.popleft()  # stopped meanwhile
        if not self._scoring:
            return
        live, scorer = self._scoring[0]
        try:
            next(scorer)
            return
        except StopIteration as done:
            live.out.prompt_scores = done.value
        except Exception as exc:  # noqa: BLE001  this request's failure, not the batch's
            self._scoring.popleft()
            del self._live[live.seq.seq_id]
            self.delivery.post(self._fail_one, live, exc)
            return
        self._scoring.popleft()
        self.scheduler.add(live.seq)

    def _grammar(self, params: SamplingParams) -> GrammarState | None:
        """The request's grammar's matcher, with its first mask (it then lives with the
        request)."""
        if params.grammar is None:
            return None
        tokenizer = self.engine.tokenizer
        if self._grammars is None:  # the vocabulary's llguidance view: made on first use
            self._grammars = PreparedGrammars(tokenizer.grammar_vocabulary())
        return self._grammars.state(
            params.grammar, frozenset() if params.ignore_eos else tokenizer.eos_token_ids)

    def _take_prepared(self) -> None:
        """Requests whose grammar is ready join the queue; one whose grammar failed ends."""
        if not self._preparing:
            return
        for sub, made in self._preparing.ready():
            if isinstance(made, BaseException):
                self.delivery.post(sub.emit, made)
            else:
                self._queue(sub, made)

    def step(self) -> None:
        """One step: drop what was stopped, run the plan, hand every request its events.

        Pipelined, the step is launched before the last one is read back: the host handles
        the last step's tokens (detokenizing, stops, events) while the device runs this one."""
        if not self.pipelined and self.executor.traits.pipelined:
            # The executor's compiled step arrived (captured beside the eager steps): nothing
            # is in flight between two steps of an unpipelined runtime, so it turns here.
            self.pipelined = self.scheduler.pipelined = True
        self._stop_requested()
        self._take_prepared()
        self._score_piece()
        plan = self.scheduler.schedule()
        for row in plan.rows:
            live = self._live[row.seq_id]
            if not live.started:
                live.started = True
                live.out.scheduled_at = live.seq.first_scheduled
                live.out.cached_tokens = live.seq.cached_tokens
                if live.sub.on_start is not None:
                    live.sub.on_start()
        self.last_batch = len(self.scheduler.running)
        # An executor that answers late (MLX) still has work while its sequences await tokens.
        if not plan and not self.scheduler.running and self._launched is None:
            if self._preparing:  # nothing else to do: not a busy loop while it is made
                self._preparing.wait(0.01)
            return
        self._meter.reset()
        started = time.perf_counter()
        last, self._launched = self._launched, None
        if plan or not self.pipelined:  # an executor that answers late runs without a plan too
            try:
                launched = (plan, self.executor.launch(plan))
            except Exception as exc:
                self._fail(plan, exc)
                launched = None
            if self.pipelined:
                self._launched = launched
            else:
                last = launched  # read back now
        executed = time.perf_counter()
        if last is not None:
            done, handle = last
            try:
                output = self.executor.collect(handle)
            except Exception as exc:
                self._fail(done, exc)
                return
            executed = time.perf_counter()
            self._handle(done, output)
        self.execute_s = 0.9 * self.execute_s + 0.1 * (executed - started)
        self.step_s = 0.9 * self.step_s + 0.1 * (time.perf_counter() - started)

    def _handle(self, plan: StepPlan, output) -> None:
        """On the step's thread: the scheduler's bookkeeping and the endings that need no text
        (end-of-sequence, max_tokens), so the sequence leaves the batch now. The text, stop
        strings and events are the delivery's."""
        peak = self._meter.peak_bytes()
        for seq_id, (first, scores) in output.prompt_logprobs.items():
            live = self._live.get(seq_id)
            if live is not None and live.out.prompt_scores is not None:
                live.out.prompt_scores.update(enumerate(scores, first))
        if output.kept_tokens is not None:
            self._kept = output.kept_tokens
        for seq_id, n in output.cached_tokens.items():
            live = self._live.get(seq_id)
            if live is not None and not live.out.cached_tokens:  # its first join counts
                live.out.cached_tokens = n
                self.scheduler.cached_tokens += n
        sampled = self.scheduler.update(plan, output)
        now = time.perf_counter()
        for live in self._live.values():
            if live.started:
                live.out.peak_memory_bytes = max(live.out.peak_memory_bytes, peak)
        batch = []
        ended = []
        logprobs = output.logprobs
        for seq, token in sampled:
            live = self._live.get(seq.seq_id)
            if live is None:
                continue
            batch.append((live, token, logprobs.get(seq.seq_id) if logprobs else None))
            if live.out.ends(token, len(seq.generated)):
                ended.append(live)
        for live in ended:
            self._leave(live)  # the delivery closes it once it has read its last token
        if batch:
            # The step before's output is out before this one's is posted: a sequence whose
            # stop string the delivery sees runs one step more, not as many as it lags.
            self.delivery.wait_behind(1)
            self.delivery.post(self._deliver, batch, now)

    def _deliver(self, batch: list[tuple[_Live, int, TokenLogprobs | None]], now: float) -> None:
        """On the delivery's thread: each token's text and events; a request whose text ended
        it (a stop string) is closed here and leaves the batch at the next step. Tokens of a
        request already closed (a step it ran after its stop string) are dropped."""
        for live, token, logprobs in batch:
            out = live.out
            if out.closed:
                continue
            try:
                for event in out.add(token, now, logprobs):
                    live.sub.emit(event)
                if out.done:
                    self._close(live)
                    self._ended.append(live.seq.seq_id)
            except Exception as exc:  # a bug of ours: this request ends with it, not the rest
                log.exception("delivering a token failed")
                out.closed = True
                self._ended.append(live.seq.seq_id)
                live.sub.emit(exc)

    def stop_all(self) -> None:
        """End every request now, as cancelled (shutdown, or a one-off caller that left); on
        return every event is out."""
        for live in list(self._live.values()):
            self._finish(live, "cancelled")
        if self._preparing:
            for sub in self._preparing.drop(lambda sub: False):
                self.delivery.post(sub.emit, Cancelled())  # never ran
        self._launched = None  # its tokens have nobody left to go to
        released = self.scheduler.take_released()
        if released:
            self.executor.release(released)
        self.delivery.drain()

    def close(self) -> None:
        """stop_all(), then the delivery's and the preparer's threads end."""
        self.stop_all()
        if self._preparing is not None:
            self._preparing.close()
        self.delivery.close()

    def _stop_requested(self) -> None:
        while self._ended:
            live = self._live.get(self._ended.popleft())
            if live is not None:
                self._leave(live)
        for live in list(self._live.values()):
            stop = live.sub.should_stop
            if stop is not None and stop():
                self._finish(live, "cancelled")
        if self._preparing:
            for sub in self._preparing.drop(
                    lambda sub: sub.should_stop is None or not sub.should_stop()):
                self.delivery.post(sub.emit, Cancelled())

    def _leave(self, live: _Live) -> None:
        """The sequence leaves the batch and its blocks go back to the pool."""
        self.scheduler.remove(live.seq)
        del self._live[live.seq.seq_id]

    def _finish(self, live: _Live, reason=None) -> None:
        """End a request from the step's thread (cancelled): it leaves now, and its last events
        follow whatever the delivery still holds for it."""
        self._leave(live)
        self.delivery.post(self._close, live, reason)

    def _close(self, live: _Live, reason=None) -> None:
        """On the delivery's thread: the request's last events, once."""
        out = live.out
        if out.closed:
            return
        pool = self.scheduler.pool
        out.kv_cache_bytes = live.seq.peak_blocks * pool.block_size * pool.bytes_per_token
        if not live.started and reason == "cancelled":
            out.closed = True
            live.sub.emit(Cancelled())  # never ran: nothing to report
            return
        for event in out.close(reason):
            live.sub.emit(event)

    def _fail(self, plan: StepPlan, exc: Exception) -> None:
        """A step that raised fails the requests it carried; the others go on. An executor that
        answers late (MLX) runs its whole batch each step, sequences awaiting a token included,
        which no plan carries: they fail with it instead of waiting for good."""
        ids = [row.seq_id for row in plan.rows]
        if self.answers_late:
            carried = set(ids)
            ids += [seq.seq_id for seq in self.scheduler.running if seq.seq_id not in carried]
        log.error("a step of %d sequences failed: %s", len(ids), exc)
        self.scheduler.pool.drop_cache()  # what the step wrote is not to be trusted
        try:
            self.executor.release(ids)
        except Exception:
            log.exception("releasing the failed step's sequences failed too")
        for seq_id in ids:
            live = self._live.pop(seq_id, None)
            if live is not None:
                self.scheduler.remove(live.seq, tell_executor=False)
                self.delivery.post(self._fail_one, live, exc)

    @staticmethod
    def _fail_one(live: _Live, exc: Exception) -> None:
        if not live.out.closed:
            live.out.closed = True
            live.sub.emit(exc)


def sequence_ids() -> itertools.count:
    return itertools.count()


def compile_error(compiled) -> str | None:
    """A failed compiled step's error, in a line (at most 300 characters); None while it is
    made, once it serves, or for an engine that compiles none."""
    if compiled is None or not compiled.done() or compiled.exception() is None:
        return None
    exc = compiled.exception()
    return f"{type(exc).__name__}: {exc}"[:300]
