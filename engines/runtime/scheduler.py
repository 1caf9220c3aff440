"""Which sequences run each step: FIFO admission under a batch and a KV budget, chunked
prefill under a per-step token budget, and preemption when the pool runs dry.

Pure bookkeeping over plain objects, so it is tested with a fake executor and no model.

Rules:
- Arrival order is admission order. A waiting sequence that does not fit (batch full, too few
  free KV blocks) holds back every later one: nothing jumps the queue, so nothing starves.
- A running sequence is fed what it has not been fed: the rest of its prompt (in chunks of at
  most the step's prefill budget, shared by all prefilling sequences, oldest first) or its last
  sampled token. Decode rows cost no budget, so running streams keep flowing while a long
  prompt is prefilled a chunk per step. A token of a scored prompt chunk (echo's
  log-probabilities) costs SCORED_TOKEN_COST of the budget. An executor without chunked
  prefill (MLX) is handed whole prompts as they are admitted, and keeps to the budget in its
  own chunks.
- A sequence holds KV blocks for every token it has been fed. Its prompt's blocks are taken
  at admission; decoding takes one more block every block_size tokens. When none is free, the
  newest running sequence is preempted: its blocks return to the pool and it goes back to the
  head of the queue, to be prefilled again (prompt and generated tokens) when blocks free up.
- With the prefix cache (an executor whose KV lives in the pool's blocks), a sequence admitted
  takes the cached blocks its tokens start with (kv.py), all but at least its last token, and
  is fed from there. A block is registered in the cache at the first plan after the one that
  fed its last token (so its KV is queued before anyone reads it), or when its sequence leaves
  or is preempted. A prompt scored for echo takes none (each position must be scored). A
  sequence whose prompt starts with blocks a running sequence is still prefilling (`n`
  siblings, requests sharing a system prompt that arrive together) waits, at the head of the
  queue, until those blocks are cached, and then takes them instead of computing them again.
- A pipelined executor runs a step before the host has read the last one's tokens: a sequence
  then has a token in flight, which its next decode row feeds as PENDING (the executor takes it
  from the device), and it is not scheduled past max_tokens. A sequence is never re-admitted
  with a token in flight. A sequence whose logits are processed from its history (penalties, a
  grammar) waits for its token instead, unless the executor processes rows with a token in
  flight: then it runs every step of a pipelined executor, else every other.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..base import SamplingParams
from .kv import ROOT, BlockPool, chain
from .plan import PENDING, RowSampling, ScheduledSeq, StepOutput, StepPlan

SCORED_TOKEN_COST = 2


@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt: list[int]
    params: SamplingParams
    sampling: RowSampling
    arrival: float = field(default_factory=time.perf_counter)
    generated: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # how many tokens the executor has been fed (their KV exists or will)
    inflight: int = 0  # tokens sampled by a launched step that the host has not read yet
    first_scheduled: float | None = None
    peak_blocks: int = 0
    keys: list[int] = field(default_factory=list)  # the prefix cache's keys of its full blocks
    cached_tokens: int = 0  # of its prompt, taken from the prefix cache when first admitted

    @property
    def length(self) -> int:
        """Tokens the sequence has or will have once its in-flight token is read."""
        return len(self.prompt) + len(self.generated) + self.inflight

    def feed(self, start: int, n: int) -> tuple[int, ...]:
        """(prompt + generated)[start:start + n] without building the whole list; PENDING for
        the in-flight token."""
        p = len(self.prompt)
        if start + n <= p:
            return tuple(self.prompt[start : start + n])
        out = tuple(self.prompt[start:p]) + tuple(self.generated[max(0, start - p) : start + n - p])
        return out + (PENDING,) * (n - len(out))

    @property
    def at_limit(self) -> bool:
        """Its last token is sampled or in flight: nothing more to schedule."""
        return len(self.generated) + self.inflight >= self.params.max_tokens


class Scheduler:
    def __init__(self, pool: BlockPool, *, max_batch: int, max_prefill_tokens: int,
                 chunked_prefill: bool = True, pipelined: bool = False,
                 processes_in_flight: bool = False, prefix_cache: bool = False,
                 clock: Callable[[], float] = time.perf_counter):
        if max_batch < 1 or max_prefill_tokens < 1:
            raise ValueError("max_batch and max_prefill_tokens must be at least 1")
        self.pool = pool
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.chunked_prefill = chunked_prefill
        self.pipelined = pipelined
        self.processes_in_flight = processes_in_flight
        self.prefix_cache = prefix_cache
        self.cached_tokens = 0  # tokens admitted sequences took from the prefix cache, in all
        # An executor that prefills on its own terms may compute a sequence's next token before
        # it reports the last one: keep a token of room ahead for it.
        self._lag = 0 if chunked_prefill else 1
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self._released: list[int] = []
        self._awaited: dict[int, Sequence] = {}  # seq id -> a sequence with tokens in flight

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._released)

    def add(self, seq: Sequence) -> None:
        """Queue a sequence; KVPoolTooSmall if it could never fit."""
        self.pool.check_fits(len(seq.prompt) + seq.params.max_tokens + self._lag)
        self.waiting.append(seq)

    def remove(self, seq: Sequence, *, tell_executor: bool = True) -> None:
        """A sequence leaves (finished, aborted, failed): its blocks go back at once, and the
        executor hears of it at the next step (unless it already dropped it, as from a failed
        step, whose KV is not cached)."""
        if seq in self.running:
            self.running.remove(seq)
            if tell_executor:
                self._register(seq)
                self._released.append(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pool.release(seq.blocks)
        self._awaited.pop(seq.seq_id, None)  # a token still in flight is dropped
        seq.inflight = 0

    def take_released(self) -> list[int]:
        """The sequences gone since the last plan, for an executor told outside a step."""
        released, self._released = self._released, []
        return released

    def schedule(self) -> StepPlan:
        if self.prefix_cache:
            for seq in self.running:
                self._register(seq)
        budget = self.max_prefill_tokens
        rows: list[tuple[Sequence, int]] = []
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            pending = seq.length - seq.computed
            processing = seq.sampling.processing
            if seq.inflight and (seq.at_limit or not self.pipelined
                                 or (processing is not None
                                     and processing.waits_for_tokens(self.processes_in_flight))):
                # Its last token is in flight (it ends once that is read), the executor
                # answers late and has not answered yet, or its logits are processed from its
                # history on the host, which must hold that token first.
                i += 1
                continue
            cost = self._cost(seq)
            n = 1 if pending == 1 else self._chunk(pending, self._affords(budget, cost))
            if not self._make_room(seq, seq.computed + n + self._lag):
                continue  # seq itself was preempted; the list shifted under i
            if n > 0:
                rows.append((seq, n))
                if pending > 1:
                    budget -= n * cost
            i += 1
        self._admit(rows, budget)
        prefill, decode = [], []
        for seq, n in rows:
            row = self._row(seq, n)
            (decode if n == 1 and seq.computed > 0 else prefill).append(row)
            seq.computed = row.end  # fed from now on: a pipelined step may not be read yet
            if row.sample:
                seq.inflight += 1
                self._awaited[seq.seq_id] = seq
        return StepPlan(tuple(prefill), tuple(decode), tuple(self.take_released()))

    def update(self, plan: StepPlan, output: StepOutput) -> list[tuple[Sequence, int]]:
        """Record the tokens a step sampled; returns (sequence, token) for each one whose
        sequence is still here (running, or preempted while its token was in flight)."""
        sampled = []
        for seq_id, token in output.tokens.items():
            seq = self._awaited.get(seq_id)
            if seq is not None:
                seq.inflight -= 1
                if not seq.inflight:
                    del self._awaited[seq_id]
                seq.generated.append(token)
                sampled.append((seq, token))
        return sampled

    def _chunk(self, pending: int, budget: int) -> int:
        if self.chunked_prefill:
            return max(0, min(pending, budget))
        # An executor that prefills on its own terms takes every prompt whole and chunks it
        # itself: holding prompts back to the step's budget only made them join its running
        # batch in more groups, and each join costs it a prefill and a merge of its own.
        return pending

    def _admit(self, rows: list[tuple[Sequence, int]], budget: int) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            if seq.inflight:
                return  # preempted with a token in flight: it is read before the next step
            if self.prefix_cache and seq.sampling.prompt_logprobs is None:
                seq.blocks, seq.keys = self.pool.take_cached(
                    [*seq.prompt, *seq.generated], seq.length - 1)
                seq.computed = len(seq.blocks) * self.pool.block_size
                if self._prefilled_soon(seq):
                    self._untake(seq)
                    return
            pending = seq.length - seq.computed
            cost = self._cost(seq)
            n = 1 if pending == 1 else self._chunk(pending, self._affords(budget, cost))
            # The whole prompt's blocks are taken now, so its later chunks never stall.
            if n == 0 or not self.pool.grow(seq.blocks, seq.length + self._lag):
                self._untake(seq)
                return
            self.waiting.popleft()
            self.cached_tokens += seq.computed
            self.running.append(seq)
            seq.peak_blocks = max(seq.peak_blocks, len(seq.blocks))
            if seq.first_scheduled is None:
                seq.first_scheduled = self.clock()
                seq.cached_tokens = seq.computed
            rows.append((seq, n))
            if pending > 1:
                budget -= n * cost

    @staticmethod
    def _cost(seq: Sequence) -> int:
        """What a token of seq's next chunk costs of the step's prefill budget: a scored
        prompt chunk (echo's log-probabilities) also projects each of its positions onto the
        vocabulary and takes its log-softmax, which about doubled its time (the default model,
        CPU: 1.65 s for 512 tokens against 0.85 s), and with it the stall of the step's
        decoding rows."""
        scored = seq.sampling.prompt_logprobs is not None and seq.computed + 1 < len(seq.prompt)
        return SCORED_TOKEN_COST if scored else 1

    @staticmethod
    def _affords(budget: int, cost: int) -> int:
        """Tokens of that cost the budget pays for (one at least while any budget is left,
        so a budget smaller than the cost still moves)."""
        return budget // cost or min(budget, 1)

    def _make_room(self, seq: Sequence, tokens: int) -> bool:
        """Grow seq's blocks to cover tokens, preempting the newest running sequences while the
        pool is short. False when seq itself had to go."""
        while not self.pool.grow(seq.blocks, tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        seq.peak_blocks = max(seq.peak_blocks, len(seq.blocks))
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._released.append(seq.seq_id)
        self._register(seq)
        self.pool.release(seq.blocks)
        seq.computed = 0
        seq.keys = []
        self.waiting.appendleft(seq)

    def _untake(self, seq: Sequence) -> None:
        """A sequence that stays waiting gives back the cached blocks it took, as they were."""
        self.pool.release(seq.blocks)
        seq.keys, seq.computed = [], 0

    def _prefilled_soon(self, seq: Sequence) -> bool:
        """Whether a running sequence is prefilling full blocks of seq's prompt beyond those
        seq took from the cache: they will be cached once fed."""
        size = self.pool.block_size
        usable = (seq.length - 1) // size  # full blocks seq could take
        have = seq.computed // size
        for other in self.running:
            if other.computed >= len(other.prompt) or other.computed >= usable * size:
                continue  # decoding, or already past every block seq could share with it
            shared = 0
            while (shared < usable and (shared + 1) * size <= len(other.prompt)
                   and seq.prompt[shared * size:(shared + 1) * size]
                   == other.prompt[shared * size:(shared + 1) * size]):
                shared += 1
            if shared > have and other.computed < shared * size:
                return True
        return False

    def _register(self, seq: Sequence) -> None:
        """Cache seq's full blocks whose KV has been queued and whose tokens are all known (a
        token in flight is not)."""
        if not self.prefix_cache:
            return
        size = self.pool.block_size
        full = min(seq.computed, len(seq.prompt) + len(seq.generated)) // size
        keys = seq.keys
        while len(keys) < full:
            j = len(keys)
            tokens = seq.feed(j * size, size)
            parent = keys[-1] if keys else ROOT
            key = chain(parent, tokens)
            self.pool.register(seq.blocks[j], key, parent, tokens)
            keys.append(key)

    def _row(self, seq: Sequence, n: int) -> ScheduledSeq:
        start = seq.computed
        return ScheduledSeq(
            seq_id=seq.seq_id, tokens=seq.feed(start, n), start=start, blocks=tuple(seq.blocks),
            sample=start + n == seq.length, sampling=seq.sampling,
            draws=len(seq.generated) + seq.inflight,
            history=None if seq.sampling.processing is None else (seq.prompt, seq.generated),
            score_next=self._score_next(seq, start, n),
        )

    @staticmethod
    def _score_next(seq: Sequence, start: int, n: int) -> tuple[int, ...] | None:
        """The prompt tokens a scored chunk's positions predict (a chunk past the prompt, fed
        again after a preemption, scores nothing)."""
        if seq.sampling.prompt_logprobs is None or start + 1 >= len(seq.prompt):
            return None
        return tuple(seq.prompt[start + 1: min(start + n + 1, len(seq.prompt))])
