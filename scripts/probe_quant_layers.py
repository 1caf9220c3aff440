#!/usr/bin/env python3
"""One linear layer of the 8B shape in each weight format, compiled, at a few row counts: where
a quantized kernel wins or loses before a whole model is measured (CUDA).

  python scripts/probe_quant_layers.py --rows 1,64
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# [N, K] of Llama-3.1-8B's fused gate/up projection and its down projection
SHAPES = [(28672, 4096), (4096, 14336)]
FORMATS = ("bf16", "int8", "int4", "fp8")


def microseconds(fn, x, n: int = 50) -> float:
    import torch

    for _ in range(5):
        fn(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn(x)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


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
            layers[fmt] = quant.quantize_linear(linear, Quantization(fmt, 64), "cuda")
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            row = {"n": n, "k": k, "rows": rows}
            for fmt, layer in layers.items():
                row[fmt] = round(microseconds(torch.compile(layer), x), 1)
            results.append(row)
            print(f"N={n} K={k} rows={rows}: " +
                  " | ".join(f"{f} {row[f]:.0f} us" for f in FORMATS), flush=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                    "torch": torch.__version__, "results": results},
                                   indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
