#!/usr/bin/env python3
"""Two ways to overlap a batch-1 decode step's kernels, measured apart from the model (CUDA):

- `pdl`: a stack of 32 Llama-3.1-8B-shaped layers (whole, or one rank's share of a split over
  --world GPUs), one row, compiled as duet compiles its step and replayed as one CUDA graph,
  with Inductor's programmatic dependent launch (`triton.enable_pdl`) off and on. Each variant
  compiles in a process of its own (the switch changes the generated code) into its own cache;
  --tuning off keeps coordinate descent out, so both draw the same tilings.
- `l2`: a latency-bound kernel (a pointer chase, ~2.6 or ~7.6 us) before a one-row product,
  32 layers of distinct weights in one CUDA graph, with and without that kernel prefetching
  the product's weights into L2 (`cp.async.bulk.prefetch.L2`) while it waits.

  python scripts/probe_launch_overlap.py pdl --world 2 --tuning off --repeats 2
  python scripts/probe_launch_overlap.py l2

Prints a table and writes JSON under docs/bench/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
LAYERS = 32


def replay_us(fn, reps: int = 50) -> float:
    """Median time of one replay of fn captured as a CUDA graph (as the engine captures its
    step: after warm-up runs)."""
    import torch

    from engines.torch_engine.cuda_graphs import CudaGraphs

    replay, _ = CudaGraphs().capture(fn)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def stack_once(pdl: bool, world: int, tuning: bool) -> dict:
    """One compile of the layer stack, in this process: its replay time."""
    import torch
    import torch._inductor.config as inductor_config
    import torch.nn.functional as F

    inductor_config.coordinate_descent_tuning = tuning
    inductor_config.use_static_cuda_launcher = False
    inductor_config.triton.enable_pdl = pdl
    d, inter, heads, kv, hd = 4096, 14336, 32, 8, 128
    q, kvs, hidden = heads * hd // world, kv * hd // world, inter // world
    gen = torch.Generator(device="cuda").manual_seed(0)

    def weight(*shape):
        return torch.randn(*shape, dtype=torch.bfloat16, device="cuda", generator=gen) * 0.02

    ones = torch.ones(d, dtype=torch.bfloat16, device="cuda")
    layers = [(weight(q + 2 * kvs, d), weight(d, q), weight(2 * hidden, d), weight(d, hidden))
              for _ in range(LAYERS)]

    def model(x, layers):
        for wqkv, wo, wgu, wd in layers:
            h = F.rms_norm(x, (d,), ones, 1e-5)
            qq, k, v = F.linear(h, wqkv).split([q, kvs, kvs], -1)
            # Small pointwise work where attention would be (the probe is about launches).
            a = qq * torch.sigmoid(k.sum(-1, keepdim=True)) + v.mean(-1, keepdim=True)
            x = x + F.linear(a, wo)
            gate, up = F.linear(F.rms_norm(x, (d,), ones, 1e-5), wgu).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, wd)
        return x

    step = torch.compile(model, fullgraph=True, dynamic=False)
    x = torch.randn(1, 1, d, dtype=torch.bfloat16, device="cuda")
    us = replay_us(lambda: step(x, layers))
    gb = sum(t.numel() * 2 for ws in layers for t in ws) / 1e9
    return {"pdl": pdl, "world": world, "tuning": tuning, "stack_us": round(us, 1),
            "layer_us": round(us / LAYERS, 2), "weights_gb": round(gb, 3),
            "tb_s": round(gb / us * 1e3, 3)}


def probe_pdl(args) -> list[dict]:
    rows = []
    for _ in range(args.repeats):
        for pdl in (False, True):
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
                done = subprocess.run(
                    [sys.executable, __file__, "stack", "--world", str(args.world), "--tuning",
                     args.tuning, "--pdl", "on" if pdl else "off"],
                    env=env, capture_output=True, text=True, timeout=600)
                if done.returncode:
                    raise SystemExit(done.stderr[-3000:])
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(f"PDL {'on ' if pdl else 'off'}  {rows[-1]['stack_us']:9.1f} us a stack",
                      flush=True)
    return rows


try:
    import triton
    import triton.language as tl
except ImportError:  # the L2 probe needs Triton, as the GPU's torch has it
    triton = None

if triton is not None:

    @triton.jit
    def _prefetch(P, nbytes, pid, programs, THREADS: tl.constexpr):
        """This program's share of nbytes at P (an address), one bulk prefetch a thread."""
        per = tl.cdiv(nbytes, programs * THREADS * 16) * 16
        offs = (pid * THREADS + tl.arange(0, THREADS)).to(tl.int64) * per
        size = tl.minimum(tl.maximum(nbytes - offs, 0), per).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $2, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [P + offs, size], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _chase(Buf, Out, iters, P, nbytes, PREFETCH: tl.constexpr, THREADS: tl.constexpr):
        """A latency-bound kernel: `iters` dependent loads; first, optionally, a prefetch."""
        pid = tl.program_id(0)
        if PREFETCH:
            _prefetch(P, nbytes, pid, tl.num_programs(0), THREADS)
        i = pid
        for _ in range(iters):
            i = tl.load(Buf + i, volatile=True)
        tl.store(Out + pid, i)


def probe_l2(args) -> list[dict]:
    import torch
    import torch.nn.functional as F

    buf = torch.arange(1, 4097, dtype=torch.int32, device="cuda") % 4096
    out = torch.zeros(256, dtype=torch.int32, device="cuda")

    def chase(iters, w=None, nbytes=0):
        _chase[(32,)](buf, out, iters, w.data_ptr() if w is not None else 0, nbytes,
                      PREFETCH=w is not None, THREADS=128, num_warps=4)

    shapes = [("output, split", 4096, 2048), ("QKV, split", 3072, 4096),
              ("output, whole", 4096, 4096), ("QKV, whole", 6144, 4096)]
    rows = []
    for iters in (10, 40):
        alone = replay_us(lambda: [chase(iters) for _ in range(LAYERS)]) / LAYERS
        rows.append({"what": "latency kernel alone", "iters": iters, "us": round(alone, 2)})
    for name, n, k in shapes:
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        size = n * k * 2
        row = {"product": name, "mib": size / 2**20,
               "product_cold_us": replay_us(lambda: [F.linear(x, w) for w in ws]) / LAYERS,
               "product_l2_hot_us": replay_us(lambda: [F.linear(x, ws[0]) for _ in ws]) / LAYERS}
        for iters in (10, 40):
            row[f"chase{iters}_then_product_us"] = replay_us(
                lambda: [(chase(iters), F.linear(x, w)) for w in ws]) / LAYERS
            row[f"chase{iters}_prefetching_then_product_us"] = replay_us(
                lambda: [(chase(iters, w, size // 16 * 16), F.linear(x, w)) for w in ws]) / LAYERS
            row[f"chase{iters}_prefetching_alone_us"] = replay_us(
                lambda: [chase(iters, w, size // 16 * 16) for w in ws]) / LAYERS
        rows.append({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("probe", choices=["pdl", "l2", "stack"])
    parser.add_argument("--world", type=int, default=2, help="pdl: the split's ranks (1: whole)")
    parser.add_argument("--tuning", choices=["on", "off"], default="off")
    parser.add_argument("--repeats", type=int, default=2, help="pdl: compiles of each variant")
    parser.add_argument("--pdl", choices=["on", "off"], default="off", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.probe == "stack":  # one variant's compile, run by the pdl probe
        print(json.dumps(stack_once(args.pdl == "on", args.world, args.tuning == "on")))
        return
    import torch

    rows = probe_pdl(args) if args.probe == "pdl" else probe_l2(args)
    if args.probe == "pdl":
        for pdl in (False, True):
            times = [r["stack_us"] for r in rows if r["pdl"] == pdl]
            print(f"PDL {'on ' if pdl else 'off'}: median {statistics.median(times):.1f} us "
                  f"a stack of {LAYERS} layers (world {args.world}, tuning {args.tuning})")
    out = Path(args.out or ROOT / "docs" / "bench" /
               f"launch-overlap-{args.probe}-{date.today().isoformat()}.json")
    out.write_text(json.dumps({"date": date.today().isoformat(),
                               "device": torch.cuda.get_device_name(0),
                               "torch": torch.__version__, "args": vars(args), "rows": rows},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
