"""What every generating engine shares: its place under the runtime (engines/runtime/), a
one-request generate(), the context rule, the warm-up and the memory meter's interface."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Future, wait
from typing import Any

from .base import (
    ClassificationResult,
    ClassifyParams,
    GenerationEvent,
    SamplingParams,
    TokenLogprobs,
    check_context,
)
from .runtime.kv import BlockPool
from .runtime.plan import RankStatus, StepExecutor
from .runtime.sizing import KVFacts, RuntimeOptions, RuntimeShape, shape_runtime
from .runtime.solo import generate_one


class MemoryMeter:
    """Peak memory for one request; each backend overrides how it is read."""

    # What peak_bytes() counts, in words a reader of /bench and /health is shown beside it:
    # the backends' figures differ (a whole process's resident set against an allocator's).
    measures = "nothing"

    def reset(self) -> None: ...

    def sample(self) -> None: ...

    def peak_bytes(self) -> int:
        return 0


def warm_up(engine) -> float:
    """Run one tiny generation so the first real request does not pay for lazy set-up
    (allocator growth, kernel selection, MLX graph compilation). Returns seconds taken."""
    start = time.perf_counter()
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompt = (engine.tokenizer.encode("Hello, world") or [0])[: max(1, engine.context_length - 2)]
    for _ in engine.generate(prompt, params):
        pass
    return time.perf_counter() - start


class PromptSide:
    """An engine's prompt handling, which needs only its tokenizer and context length: shared by
    the engines and by the HTTP side's view of an engine in another process."""

    context_length: int

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode_prompt(text)

    def apply_chat_template(self, messages: Sequence[dict],
                            tools: Sequence[dict] | None = None) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, tools=tools)

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        """The context rule, for every engine: prompt plus completion within the context."""
        check_context(prompt_tokens, max_tokens, self.context_length)


class GenerationEngine(PromptSide):
    """What every generating engine shares above its step executor.

    A subclass sets name, device, tokenizer and meter, declares its KV facts to
    start_runtime (engines/runtime/sizing.py decides the pool, the batch and the context from
    them), allocates the storage it is told to (allocate_kv), and implements executor() (a new StepExecutor over its weights and KV storage). The runtimes
    made over it (the server's loop, a one-off generate()) share the pool and the sequence ids
    and read the batch settings from here. generate() runs one request inline; the server
    batches through engines/runtime/loop.py."""

    name: str
    device: str
    context_length: int
    tokenizer: Any  # engines.tokenizer.ChatTokenizer or the fake engine's ByteTokenizer
    meter: MemoryMeter
    kv_pool: BlockPool
    max_batch: int
    max_prefill_tokens: int
    prefix_cache: bool  # the server's runtime reuses cached prefixes (where the executor can)
    seq_ids: Iterator[int]
    # The engine's compiled step, made beside its eager steps after the load: done once it
    # serves (or failed: the steps stay eager). None where nothing is made beside.
    compiled: Future | None = None

    def wait_compiled(self) -> None:
        """Wait until the compiled step made beside serves (or failed: the steps stay eager),
        for a measure of the engine's steady state."""
        if self.compiled is not None:
            wait([self.compiled])

    def start_runtime(self, facts: KVFacts, options: RuntimeOptions) -> RuntimeShape:
        """Size the runtime from the engine's facts by the runtime's rules (runtime/sizing.py),
        take its decisions, and have the engine allocate its KV storage for them."""
        shape = shape_runtime(self.name, facts, options)
        self.context_length = shape.context_length
        self.init_runtime(shape.pool, max_batch=shape.max_batch,
                          max_prefill_tokens=shape.max_prefill_tokens,
                          prefix_cache=shape.prefix_cache)
        self.allocate_kv(shape)
        return shape

    def allocate_kv(self, shape: RuntimeShape) -> None:
        """Storage on the engine's device for the shape's pool of blocks (nothing to do for
        an engine whose caches grow as they fill)."""

    def init_runtime(self, kv_pool: BlockPool, *, max_batch: int, max_prefill_tokens: int,
                     prefix_cache: bool = True) -> None:
        self.kv_pool = kv_pool
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.prefix_cache = prefix_cache
        self.seq_ids = itertools.count()

    def rank_status(self) -> tuple[RankStatus, ...]:
        """A tensor-parallel engine's ranks (none for an engine on one device)."""
        return ()

    def score_prompt(self, prompt_ids: Sequence[int],
                     k: int) -> Generator[None, None, dict[int, TokenLogprobs]]:
        """A prompt's log-probabilities by position (1 on: position 0 has none), each with its
        k likeliest tokens, for an executor that does not score the chunks it prefills. A
        generator that yields between pieces of the work (the runtime steps its batch there)
        and returns the scores. This default scores the engine's logits() over the whole
        prompt in one piece."""
        import numpy as np

        yield from ()
        prompt = list(prompt_ids)
        logits = np.asarray(self.logits(prompt), dtype=np.float64)[:-1]
        scores = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
        out = {}
        for position, row in enumerate(scores, 1):
            best = np.argsort(-row)[:k]
            out[position] = TokenLogprobs(float(row[prompt[position]]),
                                          tuple((int(t), float(row[t])) for t in best))
        return out

    def executor(self, *, prefix_cache: bool = False) -> StepExecutor:
        """A new executor over the weights and KV storage. prefix_cache: an executor that keeps
        its own KV outside the pool (MLX) keeps earlier sequences' for reuse; where the KV
        lives in the pool's blocks (torch) the scheduler reuses it (its traits say which)."""
        raise NotImplementedError

    def classify(
        self, params: ClassifyParams, should_stop: Callable[[], bool] | None = None
    ) -> ClassificationResult:
        from .classify import zero_shot

        return zero_shot(self, params, should_stop)

    def kv_cache_bytes(self) -> int:
        """The KV pool's bytes in use now (by every running sequence)."""
        return self.kv_pool.used_bytes

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        should_stop: Callable[[], bool] | None = None,
    ) -> Iterator[GenerationEvent]:
        return generate_one(self, prompt_ids, params, should_stop)
