#!/usr/bin/env python3
"""Where a decode step's time goes on the GPU: device time of the captured step alone, the
whole token loop, and the heaviest kernels. Run on the lent GPU:

  python scripts/profile_decode.py --model llama-3.2-1b
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


# A position in the second half of the benchmark (128-token prompt + 256 new tokens), so the
# step attends over the same cache bucket as most of a benchmark run.
POS = 300


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--no-tune", action="store_true", help="no coordinate-descent tuning")
    p.add_argument("--no-kernels", action="store_true", help="PyTorch ops for attention and SiLU")
    p.add_argument("--no-act-kernel", action="store_true", help="PyTorch ops for SiLU * up")
    p.add_argument("--split-len", type=int, help="cache slots per decode-attention program")
    args = p.parse_args()

    import torch

    from engines import benchmark as core
    from engines.base import RequestStats, SamplingParams
    from engines.dummy import write_dummy_model
    from engines.torch_engine import TorchEngine

    path = write_dummy_model(args.model, Path.home() / ".cache/duet/dummy" / args.model)
    from engines.torch_engine.runner import CudaGraphRunner

    engine = TorchEngine(path, context_length=args.context, dtype="bfloat16", device="cuda", compile="off")
    if args.split_len:
        from engines.torch_engine import decode_attention

        decode_attention.SPLIT_LEN = args.split_len
    runner = engine.runner = CudaGraphRunner(
        engine.model, "cuda", tune=not args.no_tune, kernels=not args.no_kernels,
        act_kernel=not args.no_act_kernel,
    )
    runner.warm_up()
    bw = core.copy_bandwidth("cuda")
    floor_ms = core.weight_bytes(path, "bfloat16", "cuda") / bw * 1000
    runner.prefill(list(range(3, 131)))
    token = torch.zeros(1, dtype=torch.long, device="cuda")
    for _ in range(5):
        runner.decode(token, POS)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(args.steps):
        runner.decode(token, POS)  # no readback: the device's own pace
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t) / args.steps * 1000
    runner.prefill(list(range(3, 131)))
    params = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
    stats = [e for e in engine.generate(list(range(3, 131)), params) if isinstance(e, RequestStats)][0]
    print(f"{args.model}: floor {floor_ms:.3f} ms/token; replayed step {step_ms:.3f} ms "
          f"({floor_ms / step_ms:.0%} of floor); full loop {1000 / stats.decode_tokens_per_s:.3f} ms "
          f"({stats.decode_tokens_per_s:.0f} tok/s, {floor_ms * stats.decode_tokens_per_s / 1000:.0%})")
    from torch.profiler import ProfilerActivity, profile

    runner.prefill(list(range(3, 131)))
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            runner.decode(token, POS)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))
    return 0


if __name__ == "__main__":
    sys.exit(main())
