"""The torch engine's sampler alone, timed on the device: a batch of B rows of logits [B, V]
drawn with temperature / top_k / top_p, against the full-vocabulary sort the sampler used
before (kept here as the baseline) and against greedy picks.

    python scripts/profile_sampler.py --device cuda --batches 1,16,64 --vocab 49152 \\
        --out docs/bench/profile-sampler-h100.json

Prints a table of the median device time per call (CUDA events; wall time elsewhere) and the
host's time to queue it. On CUDA the engine's way is timed too: the sampler compiled and
replayed as CUDA graphs (cuda_graphs.GraphSampler), and the same graphs ranking each row by a
sort instead of the border search (nucleus_kernel)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engines.torch_engine.sampling import Sampler, row_uniforms  # noqa: E402


def sorted_draw(logits, floats, ints, ranked: int):
    """The sampler before this script (eager): top_k by torch.topk, top_p by sorting the
    whole vocabulary with its indices and scattering the kept mass back, then the same
    exponential race."""
    x = logits.float() / floats[:, 0:1]
    x = x.masked_fill(x < x.max(dim=-1, keepdim=True).values + floats[:, 1:2], float("-inf"))
    k = ints[:, 2:3]
    if ranked and ranked < x.shape[-1]:
        top = torch.topk(x, ranked, dim=-1).values
        x = x.masked_fill(x < top.gather(1, k - 1), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if ranked:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= floats[:, 2:3]
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    noise = -torch.log(row_uniforms(ints[:, 0], ints[:, 1], logits.shape[-1]))
    return torch.argmax(probs / noise, dim=-1)


def timed(fn, device: str, repeats: int) -> tuple[float, float]:
    """Median device ms and host ms per call."""
    for _ in range(3):
        fn()
    cuda = device.startswith("cuda")
    device_ms, host_ms = [], []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        fn()
        host_ms.append((time.perf_counter() - t0) * 1000)
        if cuda:
            end.record()
            end.synchronize()
            device_ms.append(start.elapsed_time(end))
        else:
            device_ms.append(host_ms[-1])
    return statistics.median(device_ms), statistics.median(host_ms)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--scale", type=float, default=2.0, help="logits ~ N(0, scale)")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--compile", action="store_true",
                    help="also time the sampler compiled, without its graphs")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    cases = {
        "temperature": dict(top_k=0, top_p=1.0),
        "top_p 0.95": dict(top_k=0, top_p=0.95),
        "top_k 40, top_p 0.95": dict(top_k=40, top_p=0.95),
    }
    samplers = {"sort+scatter (before)": sorted_draw, "eager": Sampler()}
    if args.compile:
        samplers["compiled"] = Sampler("inductor")
    if args.device.startswith("cuda"):
        from engines.torch_engine.cuda_graphs import CudaGraphs, GraphSampler, configure_inductor

        configure_inductor()
        t0 = time.perf_counter()
        graphs = GraphSampler("inductor", CudaGraphs(), 64, args.vocab, args.device)
        graphs.warm_up()
        samplers["graphs"] = graphs
        from engines.torch_engine import nucleus_kernel

        if nucleus_kernel.available():  # the sort the border search replaced
            sorting = GraphSampler("inductor", CudaGraphs(), 64, args.vocab, args.device)
            sorting.sampler = Sampler("inductor", captured=True)
            sorting.warm_up()
            samplers["graphs, sorted"] = sorting
        print(f"compiled and captured the sampler's graphs in {time.perf_counter() - t0:.1f}s")
    results = []
    print(f"device {args.device}, vocabulary {args.vocab}; device ms (host ms) per call")
    for b in [int(x) for x in args.batches.split(",")]:
        logits = torch.randn(b, args.vocab, device=args.device, dtype=torch.bfloat16) * args.scale
        greedy = timed(lambda: torch.argmax(logits, dim=-1), args.device, args.repeats)
        results.append(dict(batch=b, case="greedy", sampler="argmax", device_ms=greedy[0],
                            host_ms=greedy[1]))
        print(f"B={b:3d} greedy argmax: {greedy[0]:.3f} ({greedy[1]:.3f})")
        for case, s in cases.items():
            floats = torch.tensor([[0.8, -float("inf"), s["top_p"]]]
                                  * b, device=args.device)
            ints = torch.tensor([[1234 + i, 7, s["top_k"] or args.vocab] for i in range(b)],
                                device=args.device)
            flags = (0 if s["top_p"] == 1.0 and not s["top_k"] else
                     args.vocab if s["top_p"] < 1.0 and not s["top_k"] else s["top_k"],)
            line = []
            for name, fn in samplers.items():
                dev, host = timed(lambda: fn(logits, floats, ints, *flags), args.device,
                                  args.repeats)
                results.append(dict(batch=b, case=case, sampler=name, device_ms=dev,
                                    host_ms=host))
                line.append(f"{name} {dev:.3f} ({host:.3f})")
            print(f"B={b:3d} {case:22s} " + "  ".join(line))
    if args.out:
        args.out.write_text(json.dumps(dict(device=args.device, vocab=args.vocab,
                                            gpu=torch.cuda.get_device_name()
                                            if args.device.startswith("cuda") else None,
                                            results=results), indent=1))


if __name__ == "__main__":
    main()
