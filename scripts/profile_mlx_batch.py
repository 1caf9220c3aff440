#!/usr/bin/env python3
"""The MLX engine's batched steps without HTTP: B greedy requests through the runtime, against
mlx-lm's own BatchGenerator on the same prompts (prefill included in both).

  python scripts/profile_mlx_batch.py --model llama-3.2-1b --batches 1,16,32
  python scripts/profile_mlx_batch.py --batches 32 --lead 1   # a burst: one prompt a step early

Prints each side's tok/s, time to first token (median over the batch) and step times: the
first steps (the prefill) apart from the decode steps after them."""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@contextmanager
def profiled(label: str, on: bool):
    """With on, cProfile the block and print its 25 costliest functions by own time."""
    if not on:
        yield
        return
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
        print(f"{label}:")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def ms(seconds: list[float]) -> str:
    return " ".join(f"{s * 1000:.1f}" for s in seconds)


def main() -> int:
    from engines.base import SamplingParams
    from engines.bench.core import step_in_waves
    from engines.bench.systems import MLXLMGenerate
    from engines.mlx_engine import MLXEngine
    from engines.models.dummy import write_dummy_model
    from engines.runtime.runtime import Runtime

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--batches", default="1,16,32")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--cache", default="/tmp/duet-profile")
    parser.add_argument("--waves", type=int, default=1,
                        help="add the prompts in this many groups, one group a step, as "
                        "requests arriving over a few ms reach a server")
    parser.add_argument("--lead", type=int, default=0,
                        help="add this many prompts a step before the others (the head of "
                        "a burst reaching an idle server)")
    parser.add_argument("--min-chunk", type=int, default=None,
                        help="the executor's fewest prompt tokens a step per prompt (a large "
                        "value prefills each prompt whole)")
    parser.add_argument("--max-prefill-tokens", type=int, default=None)
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the last batch size's timed runs (host time by function)")
    parser.add_argument("--inline-output", action="store_true",
                        help="deliver the requests' output on the step's thread, not beside it")
    parser.add_argument("--show-steps", type=int, default=8,
                        help="print this many first step times")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    path = write_dummy_model(args.model, Path(args.cache) / args.model)
    engine = MLXEngine(path, context_length=1024, max_batch=max(batches),
                       max_prefill_tokens=args.max_prefill_tokens)
    ref = MLXLMGenerate()
    ref.setup(path, "auto", args.prompt_tokens + args.max_tokens)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for b in batches:
        prompts = [[(31 * i + 7 * j) % 9000 + 100 for j in range(args.prompt_tokens)]
                   for i in range(b)]
        waves = [prompts[:args.lead]] if args.lead else []
        rest = prompts[args.lead:]
        waves += [rest[i::args.waves] for i in range(args.waves)]
        for attempt in range(2):  # the first of each is a warm-up
            profile = args.profile and attempt == 1
            runtime = Runtime(engine, max_batch=b,
                              threaded_output=False if args.inline_output else None)
            if args.min_chunk is not None:
                runtime.executor.min_chunk = args.min_chunk
            with profiled(f"duet, B={b}", profile):
                started = time.perf_counter()
                stats, steps = step_in_waves(runtime, waves, params)
                duet_s = time.perf_counter() - started
            runtime.close()
            with profiled(f"mlx-lm, B={b}", profile):
                ref_s, ref_firsts, ref_steps = ref.run_batch_timed(prompts, args.max_tokens)
        ttft = statistics.median(s.ttft_s for s in stats)
        ref_ttft = statistics.median(ref_firsts)
        k = args.show_steps
        print(f"B={b} (lead {args.lead}, {args.waves} wave(s)): duet engine "
              f"{b * args.max_tokens / duet_s:8.1f} tok/s, TTFT p50 {ttft * 1000:.1f} ms, "
              f"{len(steps)} steps, decode step p50 {statistics.median(steps[k:]) * 1000:.2f} ms; "
              f"mlx-lm BatchGenerator {b * args.max_tokens / ref_s:8.1f} tok/s, TTFT p50 "
              f"{ref_ttft * 1000:.1f} ms, {len(ref_steps)} steps, decode step p50 "
              f"{statistics.median(ref_steps[k:]) * 1000:.2f} ms; ratio {ref_s / duet_s:.2f}",
              flush=True)
        print(f"   first steps ms: duet {ms(steps[:k])} | mlx-lm {ms(ref_steps[:k])}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
