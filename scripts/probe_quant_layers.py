#!/usr/bin/env python3
"""One linear layer of the 8B shape in each weight format, compiled, at a few row counts: where
a quantized kernel wins or loses before a whole model is measured (CUDA). Each layer's time
also as the bandwidth its weight's bytes were read at.

  python scripts/probe_quant_layers.py --rows 1,64

With --tinygemm-layouts, tinygemm in each group size (32-256) and inner k tiling (2, 4, 8)
of its weight layout. With --fp8-plans, duet's fp8 kernel likewise in each tiling of
FP8_PLANS (72). With --int4-plans, duet's int4 kernel is also run in each tiling of
INT4_PLANS (48) beside the one int4_kernel.plan() picks (the kernel's tuning, measured in one
call).

  python scripts/probe_quant_layers.py --rows 1,16,64 --int4-plans

With --eager, the layers uncompiled at a prefill's rows (the host's share too):

  python scripts/probe_quant_layers.py --eager --rows 128,512,2048 --formats fp8-triton,int8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

# [N, K] of Llama-3.1-8B's fused gate/up projection, its down projection, its fused QKV and
# its output projection
SHAPES = [(28672, 4096), (4096, 14336), (6144, 4096), (4096, 4096)]
# int4: as served (tinygemm's words: tinygemm up to quant.TINYGEMM_ROWS, duet's kernel on
# them past it); int4-tiny: duet's kernel on tinygemm's words past one row; int4-tinygemm:
# tinygemm at every row count (int4 until 2026-11-27); int4-triton: duet's kernel on its own
# words (int4_kernel.py, DUET_INT4_KERNEL=triton)
# fp8: the compiled weight read at one row, torch._scaled_mm from two (DUET_FP8_KERNEL=aten);
# fp8-triton: duet's fp8 kernel for 2-64 rows instead (fp8_kernel.py, the default on Hopper);
# int8-read, fp8-read: the weight-read expression at every row count (what int8 and fp8 layers
# ran below 17 and 16 rows until 2026-11-27)
FORMATS = ("bf16", "int8", "int4", "int4-tiny", "int4-tinygemm", "int4-triton", "fp8",
           "fp8-triton", "int8-read", "fp8-read")


def microseconds(fn, x, n: int = 20) -> float:
    """One call's time inside a CUDA graph of n calls (as the decode step replays them: no
    launch overhead)."""
    from bench_all_reduce import capture, timed

    return timed(capture(lambda: [fn(x) for _ in range(n)]), x.device) * 1000 / n


def eager_microseconds(fn, x, n: int = 60) -> dict[str, float]:
    """One eager call (as the prefill runs them): `wall` in a loop paced by the host, `host`
    the host's share alone (the calls queued behind a long GPU sleep), `gpu` inside a CUDA
    graph. A layer whose wall is its host time holds the GPU idle between products."""
    import time

    import torch

    for _ in range(5):
        fn(x)
    torch.cuda.synchronize()
    walls = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(n):
            fn(x)
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - started) / n * 1e6)
    torch.cuda._sleep(int(2e9))  # about a second of GPU cycles: every call below waits behind
    started = time.perf_counter()
    for _ in range(n):
        fn(x)
    host = (time.perf_counter() - started) / n * 1e6
    torch.cuda.synchronize()
    return {"wall": round(statistics.median(walls), 1), "host": round(host, 1),
            "gpu": round(microseconds(fn, x), 1)}


# (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages) tried by --int4-plans at a few rows (BLOCK_M 16)
# and many (BLOCK_M 64, no split).
# Three pipeline stages only: a matrix-vector product has no reuse for deeper ones to feed.
INT4_PLANS = [(n, bk, split, w, 3) for n in (32, 64, 128) for bk in (128, 256)
              for split in (1, 2, 4, 8) for w in (4, 8)]


def int4_plans(n: int, k: int, rows: int, group: int = 64) -> dict[str, float]:
    """Microseconds of duet's int4 kernel on a random [N, K] weight in each plan that fits."""
    import torch

    from engines.device import cuda_multiprocessors
    from engines.torch_engine import int4_kernel, quant

    w = torch.randn(n, k, device="cuda") * 0.02
    q, scale, zero = quant.quantize_int4(w, group)
    qw = int4_kernel.pack(q)
    sc, ze = (t.t().contiguous().to(torch.bfloat16) for t in (scale, zero))
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    chosen = int4_kernel.plan(rows, n, k, group, cuda_multiprocessors(0))
    out = {f"chosen {chosen}": round(microseconds(
        lambda x: int4_kernel.launch(x, qw, sc, ze, group, chosen), x), 1)}
    for block_n, block_k, split, warps, stages in INT4_PLANS:
        if k % (block_k * split) or block_k % group or (rows > 16 and split > 1):
            continue
        for block_m in ((16,) if rows <= 16 else (64,)):
            p = int4_kernel.Plan(block_m, block_n, block_k, split, warps, stages)
            key = f"{block_m}x{block_n}x{block_k}/{split}/{warps}w{stages}s"
            try:
                out[key] = round(microseconds(
                    lambda x, p=p: int4_kernel.launch(x, qw, sc, ze, group, p), x), 1)
            except Exception as exc:  # a tiling past the GPU's shared memory or registers
                out[key] = type(exc).__name__
    return out


# (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages) tried by --fp8-plans, BLOCK_M as plan() has it.
# (A sweep of 2026-11-26 over BLOCK_N 64-256, BLOCK_K 64-256, splits to 8 and 8 warps found
# none of 8 warps, BLOCK_K 64 or splits past 2 among the fastest.)
FP8_PLANS = [(n, bk, split, 4, stages) for n in (32, 64, 128) for bk in (128, 256, 512)
             for split in (1, 2) for stages in (3, 4, 6)]
# Inputs summed by the tensor cores before the float32 sum, tried by --fp8-plans on the five
# fastest plans (fp8_kernel.PRECISE_EVERY, every one of them the whole step, or never).
FP8_PRECISE = (256, 512, 0)


def fp8_plans(n: int, k: int, rows: int) -> dict[str, float]:
    """Microseconds of duet's fp8 kernel on a random [N, K] weight in each plan that fits."""
    import torch

    from engines.torch_engine import fp8_kernel, quant

    w8, scale = quant.quantize_fp8(torch.randn(n, k, device="cuda") * 0.02)
    x8, x_scale = quant.quantize_rows(torch.randn(rows, k, device="cuda", dtype=torch.bfloat16))
    chosen = fp8_kernel.plan(rows, n, k)
    plans = {}
    out = {f"chosen {chosen}": round(microseconds(
        lambda x: fp8_kernel.launch(x, x_scale, w8, scale, chosen), x8), 1)}
    for block_n, block_k, split, warps, stages in FP8_PLANS:
        if k % (block_k * split):
            continue
        p = fp8_kernel.Plan(chosen.block_m, block_n, block_k, split, warps, stages)
        key = f"{p.block_m}x{block_n}x{block_k}/{split}/{warps}w{stages}s"
        try:
            out[key] = round(microseconds(
                lambda x, p=p: fp8_kernel.launch(x, x_scale, w8, scale, p), x8), 1)
        except Exception as exc:  # a tiling past the GPU's shared memory or registers
            out[key] = type(exc).__name__
        plans[key] = p
    best = sorted((v, key) for key, v in out.items() if isinstance(v, float) and key in plans)
    for _, key in best[:5]:
        p = plans[key]
        for every in FP8_PRECISE:
            if every > p.block_k:
                continue
            try:  # 0: the tensor cores' sums all along (Triton's default on sm_90)
                out[f"{key}/p{every or 'never'}"] = round(microseconds(
                    lambda x, p=p, e=every: fp8_kernel.launch(x, x_scale, w8, scale, p, e),
                    x8), 1)
            except Exception as exc:
                out[f"{key}/p{every or 'never'}"] = type(exc).__name__
    return out


# (group, inner k tiles) tried by --tinygemm-layouts: the groups tinygemm takes, and its
# weight layout's three widths (duet packs 64 / 8).
TINYGEMM_LAYOUTS = [(g, inner) for g in (32, 64, 128, 256) for inner in (2, 4, 8)]


def tinygemm_layouts(n: int, k: int, rows: int) -> dict[str, float]:
    """Microseconds of tinygemm on a random [N, K] weight in each of TINYGEMM_LAYOUTS."""
    import torch

    from engines.torch_engine import quant

    w = torch.randn(n, k, device="cuda") * 0.02
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    out = {}
    for group, inner in TINYGEMM_LAYOUTS:
        q, scale, zero = quant.quantize_int4(w, group)
        sz, packed = quant.scales_zeros(scale, zero), quant.tinygemm_pack(q, inner)
        out[f"g{group}/i{inner}"] = round(microseconds(
            lambda x, p=packed, g=group, sz=sz: torch._weight_int4pack_mm(x, p, g, sz), x), 1)
    return out


def report(kind: str, n: int, k: int, rows: int, plans: dict, weight: int) -> None:
    """The five fastest tilings of a sweep, with the bandwidth each read the weight at."""
    best = sorted((v, key) for key, v in plans.items() if isinstance(v, float))[:5]
    print(f"N={n} K={k} rows={rows} {kind} plans, fastest: " + ", ".join(
        f"{key} {v:.1f} us ({weight / v / 1e3:.0f} GB/s)" for v, key in best), flush=True)


def weight_read(linear, fmt: str):
    """`linear(x, w.to(dtype)) * scale` of the layer's int8 or fp8 weight, at any rows."""
    import torch
    import torch.nn.functional as F

    from engines.torch_engine import quant

    q, scale = (quant.quantize_int8 if fmt == "int8" else quant.quantize_fp8)(linear.weight)

    class WeightRead(torch.nn.Module):
        def forward(self, x):
            return F.linear(x, q.to(x.dtype)) * scale.to(x.dtype)

    return WeightRead()


def weight_bytes(fmt: str, n: int, k: int, group: int = 64) -> int:
    if fmt == "bf16":
        return 2 * n * k
    if fmt.startswith("int4"):
        return n * k // 2 + 4 * n * (k // group)  # bf16 scale and zero a group
    return n * k + 4 * n  # int8, fp8: a float32 scale a column


def main() -> int:
    import torch

    from engines.quantization import Quantization
    from engines.torch_engine import quant

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", default="1,64")
    p.add_argument("--int4-plans", action="store_true",
                   help="duet's int4 kernel in each tiling of INT4_PLANS too")
    p.add_argument("--fp8-plans", action="store_true",
                   help="duet's fp8 kernel in each tiling of FP8_PLANS too")
    p.add_argument("--tinygemm-layouts", action="store_true",
                   help="tinygemm in each group size and inner k tiling of TINYGEMM_LAYOUTS too")
    p.add_argument("--formats", default=",".join(FORMATS),
                   help=f"these of {','.join(FORMATS)} (bf16 always)")
    p.add_argument("--as-served", action="store_true",
                   help="Inductor configured as the decode step is (coordinate-descent tuning: "
                   "one-row weight reads become reductions)")
    p.add_argument("--eager", action="store_true",
                   help="the layers uncompiled, as a prefill runs them: wall, host and GPU "
                   "microseconds a call")
    p.add_argument("--out", type=Path, default=ROOT / "docs/bench/quant-layers.json")
    args = p.parse_args()
    if args.as_served:
        from engines.torch_engine.cuda_graphs import configure_inductor

        configure_inductor()
    # Every layer of a class shares its forward's code: past Dynamo's default of 8 compiled
    # versions of it, the later shapes would run eagerly (the 4096 x 4096 layer did, 3x slow).
    torch._dynamo.config.recompile_limit = 64
    torch.manual_seed(0)
    results = []
    formats = ["bf16"] + [f for f in args.formats.split(",") if f in FORMATS[1:]]
    for n, k in SHAPES:
        linear = torch.nn.Linear(k, n, bias=False).cuda().bfloat16()
        layers = {"bf16": linear}
        for fmt in formats[1:]:
            if fmt.endswith("-read"):
                layers[fmt] = weight_read(linear, fmt.split("-")[0])
            elif fmt.startswith("fp8"):
                layers[fmt] = quant.FP8Linear(linear, "triton" if "-" in fmt else "cuda", True)
            elif fmt == "int4-triton":
                layers[fmt] = quant.Int4Linear(linear, "triton", 64)
            elif fmt in ("int4-tiny", "int4-tinygemm"):
                layers[fmt] = quant.Int4Linear(linear, "cuda", 64)
                layers[fmt].tinygemm_rows = 1 if fmt == "int4-tiny" else 1 << 30
            else:
                layers[fmt] = quant.quantize_linear(linear, Quantization(fmt, 64), "cuda")
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            row = {"n": n, "k": k, "rows": rows}
            if args.eager:
                for fmt, layer in layers.items():
                    row[fmt] = eager_microseconds(layer, x)
                results.append(row)
                print(f"N={n} K={k} rows={rows}, eager wall / host / GPU us: " + " | ".join(
                    f"{f} {row[f]['wall']:.0f} / {row[f]['host']:.0f} / {row[f]['gpu']:.0f}"
                    for f in formats), flush=True)
                continue
            for fmt, layer in layers.items():
                row[fmt] = round(microseconds(torch.compile(layer), x), 1)
            if args.int4_plans:
                row["int4_plans"] = int4_plans(n, k, rows)
                report("int4", n, k, rows, row["int4_plans"], n * k // 2)
            if args.tinygemm_layouts:
                row["tinygemm_layouts"] = tinygemm_layouts(n, k, rows)
                report("tinygemm", n, k, rows, row["tinygemm_layouts"], n * k // 2)
            if args.fp8_plans:
                row["fp8_plans"] = fp8_plans(n, k, rows)
                report("fp8", n, k, rows, row["fp8_plans"], n * k)
            results.append(row)
            print(f"N={n} K={k} rows={rows}: " + " | ".join(
                f"{f} {row[f]:.1f} us ({weight_bytes(f, n, k) / row[f] / 1e3:.0f} GB/s)"
                for f in formats), flush=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                    "as_served": args.as_served, "eager": args.eager,
                                    "torch": torch.__version__, "results": results},
                                   indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
