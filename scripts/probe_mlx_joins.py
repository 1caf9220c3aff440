#!/usr/bin/env python3
"""Time the MLX engine's runtime over join patterns: how a burst of B prompts reaches the
generator (all at once, or a group joining one a step later). Each pattern's first run shows
what compiling its kernels costs (MLX's CUDA backend compiles on first use; its PTX cache is
under /tmp/mlx), a repeat what the pattern itself costs.

  python scripts/probe_mlx_joins.py --patterns 32 31+1 32 16+16 1+31 32

Prints each run's wall time, tok/s and its three slowest steps."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    from engines.base import SamplingParams
    from engines.bench.core import step_in_waves
    from engines.mlx_engine import MLXEngine
    from engines.models.dummy import write_dummy_model
    from engines.runtime.runtime import Runtime

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--patterns", nargs="+", default=["32", "31+1", "32", "16+16", "1+31"],
                        help="group sizes joined a step apart, e.g. 31+1")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--cache", default="/tmp/duet-profile")
    args = parser.parse_args()
    patterns = [[int(n) for n in p.split("+")] for p in args.patterns]
    rows = max(sum(p) for p in patterns)
    path = write_dummy_model(args.model, Path(args.cache) / args.model)
    started = time.perf_counter()
    engine = MLXEngine(path, context_length=1024, max_batch=rows)
    print(f"load (warm-up included) {time.perf_counter() - started:.1f} s", flush=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    runtime = Runtime(engine, max_batch=rows)
    runtime.executor.quiet_s = 0.0  # each group its own insert, as a split burst
    for n, pattern in enumerate(patterns):
        waves, k = [], 0
        for size in pattern:
            waves.append([[(31 * i + 7 * j + n) % 9000 + 100 for j in range(args.prompt_tokens)]
                          for i in range(k, k + size)])
            k += size
        t0 = time.perf_counter()
        _, steps = step_in_waves(runtime, waves, params)
        wall = time.perf_counter() - t0
        slowest = [round(s * 1000, 1) for s in sorted(steps)[-3:]]
        print(f"{'+'.join(map(str, pattern)):>8}: {wall * 1000:7.0f} ms "
              f"{k * args.max_tokens / wall:7.0f} tok/s, {len(steps)} steps, slowest ms {slowest}",
              flush=True)
    runtime.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
