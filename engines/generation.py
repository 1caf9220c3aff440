"""The decode loop's bookkeeping, shared by every engine.

An engine supplies only an iterator of sampled token ids (prefill first, then one decode step
per id). This module turns it into steps: detokenized text, stop strings, end-of-sequence,
max_tokens, cancellation, timings and peak memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

from .base import (
    ClassificationResult,
    ClassifyParams,
    ContextLengthExceeded,
    GenerationEvent,
    RequestStats,
    SamplingParams,
    Step,
)
from .tokenizer import ChatTokenizer, IncrementalDetokenizer, StopMatcher


class MemoryMeter:
    """Peak memory for one request; each backend overrides how it is read."""

    def reset(self) -> None: ...

    def sample(self) -> None: ...

    def peak_bytes(self) -> int:
        return 0


def stream_steps(
    token_ids: Iterator[int],
    *,
    tokenizer: ChatTokenizer,
    params: SamplingParams,
    prompt_tokens: int,
    engine: str,
    device: str,
    meter: MemoryMeter,
    kv_cache_bytes: Callable[[], int],
    should_stop: Callable[[], bool] | None = None,
) -> Iterator[GenerationEvent]:
    detok = IncrementalDetokenizer(tokenizer)
    stops = StopMatcher(params.stop)
    eos = frozenset() if params.ignore_eos else tokenizer.eos_token_ids
    start = time.perf_counter()
    first_at = last_at = start
    n = 0
    finish = "length"
    last_token = -1
    try:
        for token_id in token_ids:
            now = time.perf_counter()
            n += 1
            if n == 1:
                first_at = now
            last_at = now
            last_token = token_id
            meter.sample()
            if token_id in eos:
                finish = "stop"
                break
            text = stops.feed(detok.add(token_id))
            yield Step(token_id, text)
            if stops.stopped:
                finish = "stop"
                break
            if n >= params.max_tokens:
                break
            if should_stop is not None and should_stop():
                finish = "cancelled"
                break
    finally:
        close = getattr(token_ids, "close", None)
        if close is not None:
            close()
    tail = ""
    if not stops.stopped:
        # Release what the detokenizer and the stop matcher still hold back.
        tail = stops.feed(detok.flush())
        if not stops.stopped:
            tail += stops.flush()
        if stops.stopped:
            finish = "stop"
    yield Step(last_token, tail, finish)
    decode_s = last_at - first_at
    ttft = first_at - start
    yield RequestStats(
        prompt_tokens=prompt_tokens,
        completion_tokens=n,
        ttft_s=ttft,
        prefill_tokens_per_s=prompt_tokens / ttft if ttft > 0 else 0.0,
        decode_tokens_per_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
        peak_memory_bytes=meter.peak_bytes(),
        kv_cache_bytes=kv_cache_bytes(),
        engine=engine,
        device=device,
        finish_reason=finish,
        total_s=time.perf_counter() - start,
    )


def warm_up(engine) -> float:
    """Run one tiny generation so the first real request does not pay for lazy set-up
    (allocator growth, kernel selection, MLX graph compilation). Returns seconds taken."""
    start = time.perf_counter()
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompt = (engine.tokenizer.encode("Hello, world") or [0])[: max(1, engine.context_length - 2)]
    for _ in engine.generate(prompt, params):
        pass
    return time.perf_counter() - start


class TokenLoopEngine:
    """What every engine shares above its sampled-token iterator.

    A subclass sets name, device, context_length, tokenizer and _meter, and implements
    _token_ids (prefill, then one id per decode step) and _kv_cache_bytes."""

    name: str
    device: str
    context_length: int

    def _token_ids(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[int]:
        raise NotImplementedError

    def _kv_cache_bytes(self) -> int:
        return 0

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode_prompt(text)

    def apply_chat_template(self, messages: Sequence[dict]) -> list[int]:
        return self.tokenizer.apply_chat_template(messages)

    def classify(
        self, params: ClassifyParams, should_stop: Callable[[], bool] | None = None
    ) -> ClassificationResult:
        from .classify import zero_shot

        return zero_shot(self, params, should_stop)

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        if prompt_tokens + max_tokens > self.context_length:
            raise ContextLengthExceeded(prompt_tokens, max_tokens, self.context_length)

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        should_stop: Callable[[], bool] | None = None,
    ) -> Iterator[GenerationEvent]:
        # Checked here, not inside the iterator, so the caller hears of it before any token.
        self.check_fits(len(prompt_ids), params.max_tokens)
        self._meter.reset()
        return stream_steps(
            self._token_ids(prompt_ids, params),
            tokenizer=self.tokenizer,
            params=params,
            prompt_tokens=len(prompt_ids),
            engine=self.name,
            device=self.device,
            meter=self._meter,
            kv_cache_bytes=self._kv_cache_bytes,
            should_stop=should_stop,
        )
