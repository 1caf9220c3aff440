"""The MLX engine's batching paths run once at load.

MLX's CUDA backend compiles kernels the first time a graph needs them, and a batch needs some
only when sequences join it (their caches padded and merged), leave it, or sample: on an H200
the first batch of 32 after a one-request warm-up stalled on steps of 0.8-0.9 s, and the first
prompt joining a running batch on one of 3.4 s. Here that is paid at load, not by the first
clients that arrive together. The engine runs it on a GPU only."""

from __future__ import annotations

import time

from ..base import SamplingParams
from ..runtime.runtime import Runtime, Submission

_TOKENS = 16  # the longest sequence's prompt, tokens and a token of room ahead
_WIDE_ROWS, _WIDE_TOKENS = 8, 64


def warm_up_batching(engine) -> float:
    """Three sequences of different lengths through the engine's own executor: one alone,
    then two joining it (one of them sampled), each leaving at its own step; a prompt scored
    as it prefills; then up to eight prompts of 64 tokens prefilled together. Returns seconds taken (nothing is run where the
    context or the KV pool is too small for them); raises what a sequence failed with."""
    started = time.perf_counter()
    if min(engine.context_length, engine.kv_pool.capacity_tokens) < _TOKENS:
        return 0.0  # a model too small to hold them: a test's
    ids = engine.tokenizer.encode("Hello, world. The quick brown fox jumps.") or [0]
    ids = (ids * 9)[:9]
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    longer = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=5, temperature=0.8, top_k=20, top_p=0.9, seed=0,
                             ignore_eos=True)
    rows = min(_WIDE_ROWS, engine.max_batch)
    runtime = Runtime(engine, max_batch=max(3, rows), threaded_output=False)
    executor = runtime.executor
    executor.gather_s = executor.quiet_s = 0.0  # each arrival joins at once
    failures: list[BaseException] = []

    def emit(event):
        if isinstance(event, BaseException):
            failures.append(event)

    try:
        runtime.add(Submission(ids[:5], greedy, emit))
        for _ in range(2):
            runtime.step()
        runtime.add(Submission(ids[:3], sampled, emit))
        runtime.add(Submission(ids[:9], longer, emit))
        _run_out(runtime)
        # An echoed prompt scored as it prefills (lm-eval's loglikelihood): its kernels too.
        runtime.add(Submission(ids[:9], SamplingParams(max_tokens=0, temperature=0.0,
                                                       prompt_logprobs=1), emit))
        _run_out(runtime)
        # Then a wider prefill at once, as a burst of clients brings: its kernels too.
        if engine.kv_pool.capacity_tokens >= rows * (_WIDE_TOKENS + 4) \
                and engine.context_length >= _WIDE_TOKENS + 2:
            short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
            for i in range(rows):
                prompt = [ids[(t + i) % len(ids)] for t in range(_WIDE_TOKENS)]
                runtime.add(Submission(prompt, short, emit))
            _run_out(runtime)
    finally:
        runtime.close()
        executor.close()
    if failures:
        raise failures[0]
    return time.perf_counter() - started


def _run_out(runtime: Runtime) -> None:
    for _ in range(200):
        if not runtime.has_work:
            return
        runtime.step()
