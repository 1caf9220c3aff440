"""int4 products on CUDA through GemLite's Triton kernels (the `gemlite` package), opt-in with
DUET_INT4_KERNEL=gemlite until measured against tinygemm and duet's own kernel.

Why a library: tinygemm reads 4-bit weights at about half the bandwidth a bf16 product reaches
at one row (docs/benchmarks.md, 2026-11-24), and duet's own kernel was slower still there.
GemLite ships kernels for each regime (a matrix-vector one with the split reversed for one row,
split-K tiles for a few, plain tiles past 64) and tuned tilings per GPU (an H100's among them),
and it is what SGLang and torchao use for 4-bit weights.

Its format is HQQ's, w = q * scale + shift per group ("fma mode"); duet's int4
(w = (q - 8) * scale + zero, quant.py) is the same with shift = zero - 8 * scale.

Imported only on CUDA: the package reads the GPU's name at import to pick its tuned tilings.
"""

from __future__ import annotations

import importlib.util
import os

import torch
from torch import nn

# Its kernels take K in whole groups of at least 32 and both sides of at least 32.
MIN_SIZE = 32


def available() -> bool:
    return importlib.util.find_spec("gemlite") is not None


def wanted() -> bool:
    return os.environ.get("DUET_INT4_KERNEL") == "gemlite" and available()


def fits(n: int, k: int, group: int) -> bool:
    return group % 32 == 0 and k % group == 0 and min(n, k) >= MIN_SIZE


def layer(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
          device: torch.device | str) -> nn.Module:
    """GemLite's bf16 x int4 linear (no bias) of q [N, K] (uint8, 0..15) and duet's float32
    scale and zero [N, K/g]."""
    import gemlite

    n, k = q.shape
    module = gemlite.GemLiteLinear(4, group_size=group, in_features=k, out_features=n,
                                   input_dtype=gemlite.DType.BF16,
                                   output_dtype=gemlite.DType.BF16)
    scale_b = scale.to(torch.bfloat16)
    # fma mode stores -zeros * scales as the shift; pass zeros that give duet's shift, in
    # float32, then keep the shift in bfloat16 as the scales are (the kernels read both in the
    # scales' dtype).
    shift = zero.float() - 8.0 * scale_b.float()
    zeros = -shift / scale_b.float()
    module.pack(q.to(device=device, dtype=torch.uint8), scale_b.to(device), zeros.to(device),
                bias=None, fma_mode=True)
    module.zeros.data = module.zeros.data.to(torch.bfloat16)
    return module
