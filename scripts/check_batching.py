#!/usr/bin/env python3
"""On a GPU: the torch engine's batched CUDA-graph decode scores every request as it is scored
alone. Random weights leave near-ties between the top logits that any change of reduction
order (another batch size picks other GEMM kernels) may flip, so tokens are compared up to a
request's first flip and the logits at every step before it must agree to a tolerance.

  python scripts/check_batching.py --model llama-3.2-1b --requests 6 --tokens 48
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run(engine, prompts, params, together: bool):
    from engines.base import Step
    from engines.runtime.runtime import Runtime, Submission

    scored: dict = {}
    tokens = {i: [] for i in range(len(prompts))}
    runtime = Runtime(engine, max_batch=len(prompts) if together else 1, max_prefill_tokens=64)
    ids = {}

    def record(rows, logits):
        for r, row in zip(rows, logits.float().cpu()):
            scored[(ids[r.seq_id], r.draws)] = row

    runtime.executor.on_logits = record
    for i, p in enumerate(prompts):
        before = set(runtime._live)
        runtime.add(Submission(p, params, lambda e, i=i: isinstance(e, Step) and
                               e.finish_reason is None and tokens[i].append(e.token_id)))
        ids[(set(runtime._live) - before).pop()] = i
        if not together:
            while runtime.has_work:
                runtime.step()
    while runtime.has_work:
        runtime.step()
    return tokens, scored


def main() -> int:
    import torch

    from engines.base import SamplingParams
    from engines.models.dummy import write_dummy_model
    from engines.torch_engine import TorchEngine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--compile", default="auto")
    parser.add_argument("--cache", default="/tmp/duet-check")
    args = parser.parse_args()
    path = write_dummy_model(args.model, Path(args.cache) / args.model)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    prompts = [[(7 * i + j) % 30000 + 100 for j in range(5 + 37 * i)] for i in range(args.requests)]
    engine = TorchEngine(path, context_length=1024, dtype="float32", compile=args.compile,
                         max_batch=8)
    engine.wait_compiled()  # compared through the compiled step
    solo_tokens, solo = run(engine, prompts, params, together=False)
    batch_tokens, batched = run(engine, prompts, params, together=True)
    worst, compared, same = 0.0, 0, 0
    for i in range(len(prompts)):
        a, b = solo_tokens[i], batch_tokens[i]
        agree = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        same += agree == len(a)
        for step in range(agree + 1):  # the flipped step itself was scored from equal inputs
            if (i, step) in solo and (i, step) in batched:
                x, y = solo[(i, step)], batched[(i, step)]
                worst = max(worst, float((x - y).abs().max() / x.abs().max()))
                compared += 1
        print(f"request {i}: tokens agree for {agree} of {len(a)}", flush=True)
    print(f"{same}/{len(prompts)} requests identical; {compared} steps' logits compared, "
          f"largest difference {worst:.2e} of the logits' scale")
    ok = worst < 1e-3 and compared >= len(prompts)
    print("check: ok" if ok else "check: MISMATCH")
    del torch
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
