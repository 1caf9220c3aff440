#!/usr/bin/env python3
"""The MLX engine's batched steps without HTTP: B greedy requests through the runtime, against
mlx-lm's own BatchGenerator on the same prompts (prefill included in both).

  python scripts/profile_mlx_batch.py --model llama-3.2-1b --batches 1,16,32
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    from engines.base import SamplingParams
    from engines.bench.systems import MLXLMGenerate
    from engines.dummy import write_dummy_model
    from engines.mlx_engine import MLXEngine
    from engines.runtime.runtime import Runtime, Submission

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--batches", default="1,16,32")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--cache", default="/tmp/duet-profile")
    parser.add_argument("--waves", type=int, default=1,
                        help="add the prompts in this many groups, one group a step, as "
                        "requests arriving over a few ms reach a server")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    path = write_dummy_model(args.model, Path(args.cache) / args.model)
    engine = MLXEngine(path, context_length=1024, max_batch=max(batches))
    reference = MLXLMGenerate()
    reference.setup(path, "auto", args.prompt_tokens + args.max_tokens)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for b in batches:
        prompts = [[(31 * i + 7 * j) % 9000 + 100 for j in range(args.prompt_tokens)]
                   for i in range(b)]
        for attempt in range(2):  # the first of each is a warm-up
            runtime = Runtime(engine, max_batch=b)
            done = []
            started = time.perf_counter()
            waves = [prompts[i::args.waves] for i in range(args.waves)]
            steps = 0
            while waves or runtime.has_work:
                for p in waves.pop(0) if waves else ():
                    runtime.add(Submission(p, params, lambda e: done.append(e)))
                runtime.step()
                steps += 1
            duet_s = time.perf_counter() - started
            ref_s = reference.run_batch(prompts, args.max_tokens)
        print(f"B={b} in {args.waves} wave(s): duet engine {b * args.max_tokens / duet_s:8.1f} tok/s ({steps} steps, "
              f"{duet_s / steps * 1000:.2f} ms a step); mlx-lm BatchGenerator "
              f"{b * args.max_tokens / ref_s:8.1f} tok/s; ratio {ref_s / duet_s:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
