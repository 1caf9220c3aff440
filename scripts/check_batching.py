#!/usr/bin/env python3
"""On a GPU: the torch engine's batched CUDA-graph decode gives every request the greedy tokens
it gets alone, and the same tokens as eager decode (float32, where ties cannot flip).

  python scripts/check_batching.py --model llama-3.2-1b --requests 6 --tokens 48
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    from engines.base import SamplingParams, Step
    from engines.dummy import write_dummy_model
    from engines.runtime.runtime import Runtime, Submission
    from engines.torch_engine import TorchEngine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--cache", default="/tmp/duet-check")
    args = parser.parse_args()
    path = write_dummy_model(args.model, Path(args.cache) / args.model)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    prompts = [[(7 * i + j) % 30000 + 100 for j in range(5 + 37 * i)] for i in range(args.requests)]
    runs = {}
    for compile in ("auto", "off"):
        engine = TorchEngine(path, context_length=1024, dtype="float32", compile=compile,
                             max_batch=8)
        solo = [[e.token_id for e in engine.generate(p, params) if isinstance(e, Step)][:-1]
                for p in prompts]
        got = {i: [] for i in range(len(prompts))}
        runtime = Runtime(engine, max_prefill_tokens=64)
        for i, p in enumerate(prompts):
            runtime.add(Submission(p, params, lambda e, i=i: isinstance(e, Step) and
                                   e.finish_reason is None and got[i].append(e.token_id)))
        while runtime.has_work:
            runtime.step()
        batched = [got[i] for i in range(len(prompts))]
        same = sum(a == b for a, b in zip(solo, batched))
        print(f"compile={compile}: {same}/{len(prompts)} requests batched = solo", flush=True)
        runs[compile] = (solo, batched)
        del engine, runtime
    agree = sum(a == b for a, b in zip(runs["auto"][0], runs["off"][0]))
    print(f"compiled graphs vs eager-op graphs, solo: {agree}/{len(prompts)} identical")
    ok = all(s == b for s, b in runs.values()) and agree == len(prompts)
    print("check: ok" if ok else "check: MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
