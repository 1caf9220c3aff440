"""One request's output, token by token: detokenized deltas, stop strings, end-of-sequence,
max_tokens, cancellation, and its statistics. The same for every engine.

Times run from the request's arrival: queue_s until it was first scheduled, ttft_s until its
first token. Its decode speed is its own tokens over its own decode time, however many other
sequences shared its steps."""

from __future__ import annotations

import time
from collections.abc import Callable

from ..base import FinishReason, RequestStats, SamplingParams, Step, TokenLogprobs
from ..tokenizer import IncrementalDetokenizer, StopMatcher


class RequestOutput:
    def __init__(self, tokenizer, params: SamplingParams, *, prompt_tokens: int, engine: str,
                 device: str, arrival: float, clock: Callable[[], float] = time.perf_counter):
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stops = StopMatcher(params.stop)
        self.eos = frozenset() if params.ignore_eos else tokenizer.eos_token_ids
        self.max_tokens = params.max_tokens
        self.prompt_tokens = prompt_tokens
        self.engine, self.device = engine, device
        self.clock = clock
        self.arrival = arrival
        self.scheduled_at: float | None = None
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.n = 0
        self.last_token = -1
        self.finish: FinishReason | None = None
        self.closed = False  # close() has run: its events are out
        self.peak_memory_bytes = 0
        self.kv_cache_bytes = 0
        self.cached_tokens = 0  # of the prompt, from the prefix cache: not prefilled
        # The prompt's scores by position, when asked for: they ride on the first Step out.
        self.prompt_scores: dict[int, TokenLogprobs] | None = (
            {} if params.prompt_logprobs is not None else None)

    @property
    def done(self) -> bool:
        return self.finish is not None

    def ends(self, token_id: int, n: int) -> bool:
        """Whether the n-th token, token_id, ends the generation without looking at its text
        (an end-of-sequence id, max_tokens): what the step's thread decides on its own."""
        return token_id in self.eos or n >= max(1, self.max_tokens)

    def add(self, token_id: int, now: float | None = None,
            logprobs: TokenLogprobs | None = None) -> list[Step]:
        """The step's token (sampled at `now`, with its log-probabilities when they were asked
        for); [] when it only ended the generation (an end-of-sequence id)."""
        if now is None:
            now = self.clock()
        if self.first_at is None:
            self.first_at = now
        self.last_at = now
        self.last_token = token_id
        if self.max_tokens == 0:  # a prompt scored only (echo): its sampled token is not kept
            self.finish = "length"
            return []
        self.n += 1
        if token_id in self.eos:
            self.finish = "stop"
            return []
        step = Step(token_id, self._stops.feed(self._detok.add(token_id)), None, logprobs,
                    self._prompt_logprobs())
        if self._stops.stopped:
            self.finish = "stop"
        elif self.n >= self.max_tokens:
            self.finish = "length"
        return [step]

    def close(self, reason: FinishReason | None = None) -> list:
        """The last Step (whatever text was still held back, and the finish reason) and the
        RequestStats. `reason` ends a generation that had not ended by itself."""
        finish = self.finish or reason or "length"
        tail = ""
        if not self._stops.stopped:
            tail = self._stops.feed(self._detok.flush())
            if not self._stops.stopped:
                tail += self._stops.flush()
            if self._stops.stopped:
                finish = "stop"
        self.finish = finish
        self.closed = True
        now = self.clock()
        first = self.first_at if self.first_at is not None else now
        last = self.last_at if self.last_at is not None else now
        scheduled = self.scheduled_at if self.scheduled_at is not None else now
        ttft = first - self.arrival
        prefill_s = first - scheduled
        decode_s = last - first
        stats = RequestStats(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.n,
            ttft_s=ttft,
            prefill_tokens_per_s=((self.prompt_tokens - self.cached_tokens) / prefill_s
                                  if prefill_s > 0 else 0.0),
            decode_tokens_per_s=(self.n - 1) / decode_s if self.n > 1 and decode_s > 0 else 0.0,
            peak_memory_bytes=self.peak_memory_bytes,
            kv_cache_bytes=self.kv_cache_bytes,
            engine=self.engine,
            device=self.device,
            finish_reason=finish,
            total_s=now - self.arrival,
            queue_s=scheduled - self.arrival,
            cached_tokens=self.cached_tokens,
        )
        return [Step(self.last_token, tail, finish, None, self._prompt_logprobs()), stats]

    def _prompt_logprobs(self) -> tuple[TokenLogprobs | None, ...] | None:
        """The prompt's scores, once (None after, or when not asked for): None for its first
        token, which nothing scores."""
        if self.prompt_scores is None:
            return None
        scores, self.prompt_scores = self.prompt_scores, None
        return (None, *(scores.get(p) for p in range(1, self.prompt_tokens)))
