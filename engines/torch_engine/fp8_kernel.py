"""fp8 (e4m3) weights times bfloat16 activations in a Triton kernel of duet's own, for CUDA,
for a few rows to a few hundred (decode steps of 1 to 256 sequences).

Why: measured on an H100 (probe_quant_layers.py, 2026-11-26), the two paths quant.py had for
fp8 read the weights far below the GPU's bandwidth where a decode step's rows are few:
`linear(x, w.to(bf16)) * scale`, compiled, took 211 us for the 8B gate/up product at one row
(bf16: 86), and torch._scaled_mm at 64 rows 46 us for the down projection, as long as bf16's 47
(its tiles are sized for many rows), so 64 clients ran at 1.06x bf16 where half the bytes
allow nearly 2x.

How: the weight stays as quant.py stores it, [N, K] e4m3 with one float32 scale an output
column, read K-contiguous (the layout the tensor cores' fp8 and bf16 products take their second
operand in). A program takes a tile of rows, of columns and of the inputs (split-K where the
columns are too few to fill the GPU), widens each weight tile to bfloat16 in registers and
multiplies it on the tensor cores in float32; the column's scale multiplies the tile's sum. The
split parts are added in float32, in split order, by int4_kernel's small summing kernel, so a
row's result does not depend on which program ends first."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..device import cuda_multiprocessors
from . import int4_kernel
from .decode_attention import triton

# Up to this many rows the kernel runs; more (a prefill's) take the activations to fp8 too and
# the tensor cores' fp8 product (torch._scaled_mm), bound by arithmetic there, not bytes.
MAX_ROWS = 256

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _fp8_mm_kernel(X, W, Scale, Out, M, N, K, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                       BF16_DOT: tl.constexpr):
        """Out[pid_k, M, N] = (X[M, K] @ W[N, K]^T) * Scale[N] over this program's share of K
        (float32 parts when split, for _sum_splits_kernel; else in Out's dtype)."""
        pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < M, cols < N
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        per_split = K // SPLIT_K
        for start in range(pid_k * per_split, (pid_k + 1) * per_split, BLOCK_K):
            x = tl.load(X + rows[:, None] * K + (start + ks)[None, :], mask=row_ok[:, None],
                        other=0.0)
            w = tl.load(W + cols[None, :] * K + (start + ks)[:, None], mask=col_ok[None, :],
                        other=0.0)
            if BF16_DOT:
                acc += tl.dot(x.to(tl.bfloat16), w.to(tl.bfloat16))
            else:  # Triton's interpreter multiplies bfloat16 as raw bits: its tests' path
                acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        scale = tl.load(Scale + cols, mask=col_ok, other=0.0)
        out = Out + pid_k * M * N + rows[:, None] * N + cols[None, :]
        tl.store(out, (acc * scale[None, :]).to(Out.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


@dataclass(frozen=True)
class Plan:
    """A product's tiles: BLOCK_M rows, BLOCK_N columns, BLOCK_K inputs a step, the inputs split
    SPLIT_K ways."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    warps: int
    stages: int


def plan(m: int, n: int, k: int, sms: int = 132) -> Plan:
    """Tiles of 16 rows (the tensor cores' least) up to 16 rows, else 64; 128 columns, 128
    inputs a step. Few rows are bound by the bytes in flight: their inputs are split (up to 8
    ways) until there are about four programs an SM (the 8B model's 4,096 outputs are only 32
    tiles of columns). A 64-row tile's split parts cost float32 traffic of their own (64 rows
    of 28,672 columns, 7 MB a part), so those split only until every SM has a program.
    Counted in columns only, so a layer's plan (and a row's bits) is the same for every row
    count of a tile size."""
    block_m = 16 if m <= 16 else 64
    target = 4 * sms if block_m == 16 else sms
    split, tiles = 1, -(-n // 128)
    while split < 8 and tiles * split < target and k % (128 * split * 2) == 0:
        split *= 2
    return Plan(block_m, 128, 128, split, 4, 4)


def wanted() -> bool:
    return os.environ.get("DUET_FP8_KERNEL") == "triton" and triton is not None


def fits(n: int, k: int) -> bool:
    """Whether a [N, K] weight takes the kernel: K in whole steps of 128 inputs."""
    return k % 128 == 0


@torch.library.custom_op("duet::fp8_mm", mutates_args=())
def fp8_mm(x: torch.Tensor, weight8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bfloat16, M <= MAX_ROWS) times the fp8 weight [N, K] with its float32 scale
    [N] -> [M, N] in x's dtype."""
    m, k = x.shape
    sms = cuda_multiprocessors(x.device.index) if x.device.type == "cuda" else 132
    return launch(x, weight8, scale, plan(m, weight8.shape[0], k, sms))


@fp8_mm.register_fake
def _(x, weight8, scale):
    return x.new_empty(x.shape[0], weight8.shape[0])


def launch(x: torch.Tensor, weight8: torch.Tensor, scale: torch.Tensor, p: Plan) -> torch.Tensor:
    """fp8_mm with the tiles of p (scripts/probe_quant_layers.py --fp8-plans tries others)."""
    m, k = x.shape
    n = weight8.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    parts = torch.empty(p.split_k, m, n, dtype=torch.float32, device=x.device) \
        if p.split_k > 1 else out
    grid = (triton.cdiv(m, p.block_m), triton.cdiv(n, p.block_n), p.split_k)
    _fp8_mm_kernel[grid](x.contiguous(), weight8, scale, parts, m, n, k, BLOCK_M=p.block_m,
                         BLOCK_N=p.block_n, BLOCK_K=p.block_k, SPLIT_K=p.split_k,
                         BF16_DOT=x.device.type == "cuda", num_warps=p.warps,
                         num_stages=p.stages)
    if p.split_k > 1:
        int4_kernel._sum_splits_kernel[(triton.cdiv(m * n, int4_kernel.SUM_BLOCK),)](
            parts, out, m * n, SPLIT_K=p.split_k, BLOCK=int4_kernel.SUM_BLOCK)
    return out
