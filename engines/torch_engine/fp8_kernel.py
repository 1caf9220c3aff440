"""fp8 (e4m3) weights times fp8 activations on the tensor cores, in a Triton kernel of duet's
own, for CUDA, for the 2 to 64 rows of a batched decode step (by default on Hopper GPUs; see
wanted()).

Why: measured on an H100 (probe_quant_layers.py, 2026-11-26), torch._scaled_mm at 64 rows took
47 us for the 8B down projection [4096 x 14336], as long as bf16's, reading its weight at 1.25
TB/s: its tiles are sized for many rows, and 4,096 columns make only 32 of them for 132 SMs.
A first form of this kernel that widened the weight to bf16 for a bf16 product did no better
(the widening, not the bytes, bound it) and lost to the compiled weight read at one row.

How: the weight stays as quant.py stores it, [N, K] e4m3 with one float32 scale an output
column, read K-contiguous (the layout the fp8 tensor-core product takes its second operand in);
the activations come quantized per row as for torch._scaled_mm (quant.quantize_rows). A program
takes a tile of rows and of columns and all the inputs (the kernel can also split the inputs,
the parts added in float32, in split order, by int4_kernel's small summing kernel, so a row's
result does not depend on which program ends first; at 64 rows no split was faster), multiplies
fp8 by fp8 into float32, and scales the tile by its rows' and columns' scales."""

from __future__ import annotations

import os

import torch

from . import int4_kernel
from .decode_attention import triton
from .int4_kernel import Plan

# Up to this many rows the kernel runs; more take torch._scaled_mm (on an H100 the two were
# even at 128 rows, the kernel slower on the widest layer; a prefill's many rows are bound by
# arithmetic, not bytes).
MAX_ROWS = 64
# fp8 products summed in the tensor cores' own precision at most this many inputs at a time
# (DeepSeek-V3's training promotes every 128 as well).
PRECISE_EVERY = 128

if triton is not None:
    import triton.language as tl

    from .int4_kernel import tile

    @triton.jit
    def _fp8_mm_kernel(X, XScale, W, Scale, Out, M, N, K, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                       PRECISE_EVERY: tl.constexpr):
        """Out[pid_k, M, N] = (X[M, K] @ W[N, K]^T) * XScale[M, None] * Scale[None, N] over
        this program's share of K (float32 parts when split, for _sum_splits_kernel; else in
        Out's dtype). X and W are e4m3."""
        rows, cols, row_ok, col_ok, first, last = tile(M, N, K, BLOCK_M, BLOCK_N, SPLIT_K)
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(first, last, BLOCK_K):
            x = tl.load(X + rows[:, None] * K + (start + ks)[None, :], mask=row_ok[:, None],
                        other=0.0)
            w = tl.load(W + cols[None, :] * K + (start + ks)[:, None], mask=col_ok[None, :],
                        other=0.0)
            # Hopper's fp8 products sum in fewer bits than float32 (about 14) unless promoted:
            # every PRECISE_EVERY inputs into the float32 sum, as torch._scaled_mm does by
            # default (Triton's default on sm_90 never promotes; the GPU check failed so).
            if PRECISE_EVERY > 0:
                acc = tl.dot(x, w, acc, max_num_imprecise_acc=PRECISE_EVERY)
            else:  # the tensor cores' sums all along (a probe's comparison only)
                acc = tl.dot(x, w, acc)
        x_scale = tl.load(XScale + rows, mask=row_ok, other=0.0)
        scale = tl.load(Scale + cols, mask=col_ok, other=0.0)
        out = Out + tl.program_id(2) * M * N + rows[:, None] * N + cols[None, :]
        tl.store(out, (acc * x_scale[:, None] * scale[None, :]).to(Out.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


def plan(m: int, n: int, k: int) -> Plan:
    """Tiles of 64 rows, not split, 4 warps. Measured on an H100 at 16 and 64 rows over 54
    tilings of each 8B layer, sums promoted every 128 inputs (probe_quant_layers.py
    --fp8-plans, 2026-11-27): narrow tiles of 32 columns and 128 inputs a step were the
    fastest for the layers of 4,096 to 6,144 columns (twice the programs of 64-column tiles
    for the GPU's 132 SMs; with 6 stages where the inputs are many: the down projection 29.7
    us at 64 rows against 35.9 in the tiles used before, the output projection 8.7 against
    11.8), 64 x 256 in 3 stages for the wide gate/up (46.2 against 47.6). Splits were no
    faster, their float32 parts costing more than the SMs they fill. One tile for every row
    count, so a row's bits do not depend on its batch."""
    if n >= 16384:
        return Plan(64, 64, 256 if k % 256 == 0 else 128, 1, 4, 3)
    return Plan(64, 32, 128, 1, 4, 6 if k >= 8192 else 4)


def wanted(device: str) -> bool:
    """Whether fp8 layers take the kernel: by default on Hopper (compute capability 9.x), where
    it was measured (an H100, its sums promoted to float32: each 8B layer 5-35% faster than
    torch._scaled_mm at 16 and 64 rows, even at 128, probe_quant_layers.py, 2026-11-26).
    DUET_FP8_KERNEL=aten keeps torch._scaled_mm there; =triton asks for the kernel on another
    GPU with fp8 tensor cores (Ada, Blackwell: not measured)."""
    choice = os.environ.get("DUET_FP8_KERNEL")
    if triton is None or choice == "aten":
        return False
    return choice == "triton" or torch.cuda.get_device_capability(device)[0] == 9


def fits(n: int, k: int) -> bool:
    """Whether a [N, K] weight takes the kernel: K in whole steps of 128 inputs (plan() takes
    256 where K allows)."""
    return k % 128 == 0


@torch.library.custom_op("duet::fp8_mm", mutates_args=())
def fp8_mm(x8: torch.Tensor, x_scale: torch.Tensor, weight8: torch.Tensor,
           scale: torch.Tensor) -> torch.Tensor:
    """x8 [M, K] e4m3 (M <= MAX_ROWS) with its float32 row scales [M], times the fp8 weight
    [N, K] with its float32 column scales [N] -> [M, N] in bfloat16."""
    m, k = x8.shape
    return launch(x8, x_scale, weight8, scale, plan(m, weight8.shape[0], k))


@fp8_mm.register_fake
def _(x8, x_scale, weight8, scale):
    return x8.new_empty(x8.shape[0], weight8.shape[0], dtype=torch.bfloat16)


def launch(x8: torch.Tensor, x_scale: torch.Tensor, weight8: torch.Tensor, scale: torch.Tensor,
           p: Plan, precise_every: int = PRECISE_EVERY) -> torch.Tensor:
    """fp8_mm with the tiles of p (scripts/probe_quant_layers.py --fp8-plans tries others, and
    other precise_every: how many inputs the tensor cores sum before the float32 sum takes
    them, 0 never)."""
    m, k = x8.shape
    n = weight8.shape[0]
    out, parts = int4_kernel.outputs(m, n, p.split_k, torch.bfloat16, x8.device)
    grid = (triton.cdiv(m, p.block_m), triton.cdiv(n, p.block_n), p.split_k)
    _fp8_mm_kernel[grid](x8.contiguous(), x_scale.reshape(-1), weight8,
                         scale, parts, m, n, k, BLOCK_M=p.block_m, BLOCK_N=p.block_n,
                         BLOCK_K=p.block_k, SPLIT_K=p.split_k,
                         PRECISE_EVERY=min(p.block_k, precise_every), num_warps=p.warps,
                         num_stages=p.stages)
    return int4_kernel.add_splits(parts, out, p.split_k)
