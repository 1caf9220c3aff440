#!/usr/bin/env python3
"""One linear layer of the 8B shape in each weight format, compiled, at a few row counts: where
a quantized kernel wins or loses before a whole model is measured (CUDA). Each layer's time
also as the bandwidth its weight's bytes were read at.

  python scripts/probe_quant_layers.py --rows 1,64
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

# [N, K] of Llama-3.1-8B's fused gate/up projection, its down projection, its fused QKV and
# its output projection
SHAPES = [(28672, 4096), (4096, 14336), (6144, 4096), (4096, 4096)]
# int4-triton: duet's own int4 kernel (int4_kernel.py, DUET_INT4_KERNEL=triton), beside
# tinygemm's (int4)
FORMATS = ("bf16", "int8", "int4", "int4-triton", "fp8")


def microseconds(fn, x, n: int = 20) -> float:
    """One call's time inside a CUDA graph of n calls (as the decode step replays them: no
    launch overhead)."""
    from bench_all_reduce import capture, timed

    return timed(capture(lambda: [fn(x) for _ in range(n)]), x.device) * 1000 / n


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
    p.add_argument("--out", type=Path, default=ROOT / "docs/bench/quant-layers.json")
    args = p.parse_args()
    torch.manual_seed(0)
    results = []
    for n, k in SHAPES:
        linear = torch.nn.Linear(k, n, bias=False).cuda().bfloat16()
        layers = {"bf16": linear}
        for fmt in FORMATS[1:]:
            layers[fmt] = (quant.Int4Linear(linear, "triton", 64) if fmt == "int4-triton" else
                           quant.quantize_linear(linear, Quantization(fmt, 64), "cuda"))
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            row = {"n": n, "k": k, "rows": rows}
            for fmt, layer in layers.items():
                row[fmt] = round(microseconds(torch.compile(layer), x), 1)
            results.append(row)
            print(f"N={n} K={k} rows={rows}: " + " | ".join(
                f"{f} {row[f]:.1f} us ({weight_bytes(f, n, k) / row[f] / 1e3:.0f} GB/s)"
                for f in FORMATS), flush=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                    "torch": torch.__version__, "results": results},
                                   indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
