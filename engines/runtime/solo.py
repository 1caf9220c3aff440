"""One generation run inline on the caller's thread: the runtime with a batch of one. What
Engine.generate() is, for scripts, tests, benchmarks and the warm-up; the server batches
through loop.py instead."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from ..base import GenerationEvent, RequestStats, SamplingParams, StopCheck
from .runtime import Runtime, Submission


def generate_one(
    engine, prompt_ids: Sequence[int], params: SamplingParams,
    should_stop: StopCheck | None = None,
) -> Iterator[GenerationEvent]:
    # Events read after each step; a grammar made in add(), so its errors are raised there.
    # No prefix cache: a bench's repeats of a prompt each measure its whole prefill.
    runtime = Runtime(engine, max_batch=1, threaded_output=False, prepare_aside=False,
                      prefix_cache=False)
    events: list = []
    # Raised here, before the iterator exists, so the caller hears of it before any token.
    runtime.add(Submission(list(prompt_ids), params, events.append, should_stop))
    return _drive(runtime, events)


def _drive(runtime: Runtime, events: list) -> Iterator[GenerationEvent]:
    try:
        while True:
            runtime.step()
            batch, events[:] = list(events), []
            for event in batch:
                if isinstance(event, BaseException):
                    raise event
                yield event
                if isinstance(event, RequestStats):
                    return
    finally:
        runtime.stop_all()  # a caller that stopped early: the blocks go back to the pool
