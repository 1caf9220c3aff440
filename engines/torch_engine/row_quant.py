"""A prefill's activations quantized per row in one Triton kernel (CUDA), for the tensor-core
products of fp8 and int8 layers: the values and scales of quant.quantize_rows in either format
bit for bit. Also int8's product scaled back in one kernel
(scale_products), which the torch expression does in three passes over a float32 copy.

Why: uncompiled, those torch expressions are five or six kernels (fp8) and about ten (int8)
a product, each launched by the host, and an eager prefill of a short prompt is bound by the
launches: on an H100 (2026-11-27, probe_quant_layers.py --eager, 128 rows of the 8B shape)
int8's four products of a layer took the host 921 us against bfloat16's 107 (the compiled
decode step fuses the expressions by itself)."""

from __future__ import annotations

import torch

from .decode_attention import triton

# The largest quantized magnitude, the least scale and the dtype of each format (the kernel's
# and quant.quantize_rows').
FORMATS = {"fp8": (448.0, 1e-12, torch.float8_e4m3fn), "int8": (127.0, 1e-10, torch.int8)}
BLOCK = 1024

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _quantize_rows_kernel(X, XQ, XScale, K, LEVELS: tl.constexpr, SMALLEST: tl.constexpr,
                              ROUND: tl.constexpr, BLOCK: tl.constexpr):
        """One row a program: XScale[row] = max |X[row]| / LEVELS (at least SMALLEST), XQ[row]
        = X[row] / XScale[row] within +-LEVELS, in XQ's dtype (e4m3 rounds to nearest even as
        it is stored; ROUND: to an integer first, half to even, as torch.round)."""
        row = tl.program_id(0)
        top = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, K, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(X + row * K + offs, mask=offs < K, other=0.0).to(tl.float32)
            top = tl.maximum(top, tl.abs(x))
        # div_rn: Triton's `/` is the GPU's approximate division (scales 1 ulp off torch's
        # for random rows, measured on an H100).
        largest = tl.max(top, axis=0)
        scale = tl.maximum(tl.math.div_rn(largest, largest * 0.0 + LEVELS), SMALLEST)
        for start in range(0, K, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(X + row * K + offs, mask=offs < K, other=0.0).to(tl.float32)
            q = tl.math.div_rn(x, scale + tl.zeros_like(x))
            if ROUND:
                # 1.5 * 2**23 added and taken away: a float32 that large keeps no fraction
                # bits, so the sum rounds q half to even (|q| <= LEVELS is far below 2**22).
                q = (q + 12582912.0) - 12582912.0
            q = tl.clamp(q, -LEVELS, LEVELS)
            tl.store(XQ + row * K + offs, q.to(XQ.dtype.element_ty), mask=offs < K)
        tl.store(XScale + row, scale)


    @triton.jit
    def _scale_products_kernel(Acc, XScale, Scale, Out, M, N, BLOCK: tl.constexpr):
        """Out[m, n] = Acc[m, n] * XScale[m] * Scale[n] in float32 (in that order), stored in
        Out's dtype: quant.Int8Linear's expression bit for bit."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < M * N
        acc = tl.load(Acc + offs, mask=ok, other=0).to(tl.float32)
        x_scale = tl.load(XScale + offs // N, mask=ok, other=0.0).to(tl.float32)
        scale = tl.load(Scale + offs % N, mask=ok, other=0.0).to(tl.float32)
        tl.store(Out + offs, (acc * x_scale * scale).to(Out.dtype.element_ty), mask=ok)


def available(x: torch.Tensor) -> bool:
    """Whether x's quantization runs in the kernel: on CUDA, eager (the compiled decode step
    fuses the torch expression itself), with Triton installed."""
    return x.is_cuda and triton is not None and not torch.compiler.is_compiling()


def quantize_rows(x2: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 [M, K] quantized per row in `fmt` (fp8 or int8): the values [M, K] and float32 scales
    [M, 1]."""
    levels, smallest, dtype = FORMATS[fmt]
    m, k = x2.shape
    xq = torch.empty(m, k, dtype=dtype, device=x2.device)
    x_scale = torch.empty(m, 1, dtype=torch.float32, device=x2.device)
    _quantize_rows_kernel[(m,)](x2.contiguous(), xq, x_scale, k, LEVELS=levels,
                                SMALLEST=smallest, ROUND=fmt == "int8", BLOCK=BLOCK)
    return xq, x_scale


def scale_products(acc: torch.Tensor, x_scale: torch.Tensor, scale: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """An int8 product's int32 sums [M, N] times its rows' scales [M, 1] and its columns' [N],
    in `dtype`."""
    m, n = acc.shape
    out = torch.empty(m, n, dtype=dtype, device=acc.device)
    _scale_products_kernel[(triton.cdiv(m * n, BLOCK),)](acc, x_scale.reshape(-1), scale, out,
                                                         m, n, BLOCK=BLOCK)
    return out
