#!/usr/bin/env python3
"""Where a batched step's time goes, on the torch engine: the runtime driven directly (no HTTP)
with B requests of --prompt-tokens prompts decoding together. Per batch size: the prefill
step of one prompt, then over steady decode steps the wall time per step split into the
executor (host preparation, GPU, read-back) and the runtime's own work (scheduling,
detokenizing, events), and the top GPU kernels from torch.profiler.

  python scripts/profile_step.py --model llama-3.2-1b --batches 1,64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class Timer:
    def __init__(self):
        self.spent: dict[str, list[float]] = {}

    def wrap(self, obj, name: str, label: str, sync=None):
        fn = getattr(obj, name)

        def timed(*a, **k):
            started = time.perf_counter()
            out = fn(*a, **k)
            if sync is not None:
                sync()
            self.spent.setdefault(label, []).append(time.perf_counter() - started)
            return out

        setattr(obj, name, timed)

    def median_ms(self, label: str) -> float:
        values = self.spent.get(label, [])
        return round(statistics.median(values) * 1000, 3) if values else float("nan")


def main() -> int:
    import torch

    from engines.base import SamplingParams
    from engines.dummy import write_dummy_model
    from engines.runtime.runtime import Runtime, Submission
    from engines.torch_engine import TorchEngine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--compile", default="auto")
    parser.add_argument("--cache", default="/tmp/duet-profile")
    parser.add_argument("--trace", default=None, help="write a Chrome trace of B=max here")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    path = write_dummy_model(args.model, Path(args.cache) / args.model)
    started = time.perf_counter()
    engine = TorchEngine(path, context_length=args.context, dtype="bfloat16",
                         compile=args.compile, max_batch=max(batches))
    print(f"load {time.perf_counter() - started:.1f} s", flush=True)
    params = SamplingParams(max_tokens=args.context - args.prompt_tokens - 1, temperature=0.0,
                            ignore_eos=True)
    for b in batches:
        runtime = Runtime(engine, max_batch=b, max_prefill_tokens=max(512, args.prompt_tokens))
        timer = Timer()
        ex = runtime.executor
        timer.wrap(ex, "launch", "executor.launch")
        timer.wrap(ex, "collect", "executor.collect (read-back)")
        if ex.decoder is not None:
            timer.wrap(ex.decoder, "run", "decoder.run (host + launch)")
        sync = torch.cuda.synchronize if engine.device.startswith("cuda") else None
        timer.wrap(ex, "_forward", "prefill forward", sync=sync)
        timer.wrap(runtime, "step", "runtime.step")
        prompts = [[(31 * i + 7 * j) % 9000 + 100 for j in range(args.prompt_tokens)]
                   for i in range(b)]
        for p in prompts:
            runtime.add(Submission(p, params, lambda e: None))
        while any(live.out.n == 0 for live in runtime._live.values()):
            runtime.step()
        prefill = dict(timer.spent)
        timer.spent.clear()
        for _ in range(args.steps):
            runtime.step()
        line = {k: timer.median_ms(k) for k in timer.spent}
        line["prefill forward (all prompts)"] = round(sum(prefill.get("prefill forward", [0]))
                                                      * 1000, 2)
        print(f"B={b}: {line}", flush=True)
        print(f"B={b}: {b / (line['runtime.step'] / 1000):.0f} tok/s at the step's median",
              flush=True)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                runtime.step()
            if sync is not None:
                sync()
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14,
                                          max_name_column_width=60)
        print(table, flush=True)
        if args.trace and b == max(batches):
            prof.export_chrome_trace(args.trace)
        runtime.stop_all()
        while runtime.has_work:
            runtime.step()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
