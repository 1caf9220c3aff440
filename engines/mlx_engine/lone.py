"""A sequence that runs alone, decoded outside mlx-lm's BatchGenerator.

The generator's step is built for a batch: a batched KV cache with its masks, per-row
bookkeeping and responses. For one sequence that costs host time on every token (MLX's CUDA
backend, Llama 3.2 1B shape, batch 1: 3.5 ms a step against 2.3 ms for mlx-lm's generate_step),
and a lone stream is what most local users run. So the executor decodes a sequence that joins
an idle generator here, generate_step's way: a plain KV cache, and each step's forward queued
(mx.async_eval) before the token of the step before is read. When another prompt joins, the
sequence is handed to the generator with its KV (insert(caches=...)), as a prompt of the
tokens it has not fed yet; its sampler and processors go with it, so its draws and penalties
continue where they were."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from ..base import TokenLogprobs
from .sampling import token_logprobs


@dataclass
class Handover:
    """What the generator needs to take the sequence on: the tokens it has not fed yet (its
    prompt there), its KV cache and the tokens that cache holds."""

    prompt: list[int]
    cache: list
    fed: list[int]


@dataclass
class LoneStream:
    seq_id: int
    model: Callable
    cache: list  # mlx-lm KVCache per layer, holding `fed`
    unfed: list[int]  # prompt tokens still to prefill
    sampler: Callable[[mx.array], mx.array]
    processors: list[Callable]
    logprobs: int | None  # top-k asked for, None: no logprobs
    prefill_chunk: int
    fed: list[int] = field(default_factory=list)
    _next: mx.array | None = None  # the sampled token of the last step, maybe not computed yet
    _next_logprobs: mx.array | None = None

    def step(self) -> tuple[int, TokenLogprobs | None] | None:
        """One step: a prefill chunk, or the next token queued and the one before it read.
        Returns the token read (and its logprobs when asked), or None."""
        if len(self.unfed) > 1:  # all but the last prompt token, in chunks
            chunk = self.unfed[: min(self.prefill_chunk, len(self.unfed) - 1)]
            self.model(mx.array(chunk)[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
            self.fed += chunk
            del self.unfed[: len(chunk)]
            return None
        if self.unfed:  # the last prompt token gives the first token's logits
            self._queue(self.unfed[0])
            self.unfed = []
            return None
        token, row = self._next, self._next_logprobs
        self._queue(token)
        value = token.item()
        self.fed[-1] = value  # _queue put the token in, unread
        return value, (None if self.logprobs is None
                       else token_logprobs(row, value, self.logprobs))

    def _queue(self, token) -> None:
        """Feed `token` (an int, or the last step's unread array) and queue the next pick."""
        inputs = token.reshape(1) if isinstance(token, mx.array) else mx.array([token])
        self.fed.append(-1 if isinstance(token, mx.array) else token)
        logits = self.model(inputs[None], cache=self.cache)[:, -1, :]
        if self.processors:
            context = mx.concatenate([mx.array(self.fed[:-1], dtype=inputs.dtype), inputs])
            for processor in self.processors:
                logits = processor(context, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        self._next = self.sampler(logprobs).reshape(())
        self._next_logprobs = logprobs[0]
        mx.async_eval(self._next, self._next_logprobs)

    def hand_over(self) -> tuple[tuple[int, TokenLogprobs | None] | None, Handover]:
        """Stop decoding here: the token picked but not yet read (if any, with its logprobs)
        and what the generator takes the sequence on from."""
        if self.unfed or self._next is None:
            return None, Handover(list(self.unfed), self.cache, list(self.fed))
        value = self._next.item()
        scored = (None if self.logprobs is None
                  else token_logprobs(self._next_logprobs, value, self.logprobs))
        self._next = None
        return (value, scored), Handover([value], self.cache, list(self.fed))

    def kept(self) -> tuple[list[int], list]:
        """The tokens the KV cache holds and the cache (a prompt cache keeps them)."""
        return list(self.fed), self.cache
