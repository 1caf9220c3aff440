"""Group-wise int4 weights times bfloat16 activations in Triton kernels of duet's own, for
CUDA. By default they take the products of more than 6 rows (a batched decode step, a
prefill) of weights kept in tinygemm's layout, which tinygemm (torch._weight_int4pack_mm)
multiplies fast only at a few rows (int4_mm_tiny; on an H100, 2026-11-26, these tiles on
their own layout were 1.5-1.8x slower than tinygemm at one row and up to 5x faster at 64,
docs/benchmarks.md). With
DUET_INT4_KERNEL=triton a layer keeps its weight in the kernels' own layout instead (below)
and takes them at every row count.

Why: measured on an H100 (docs/benchmarks.md, 2026-11-24), tinygemm read its 4-bit weights at
about half the bandwidth bf16's products reach (the 8B shape decoded 1.81x bf16 at batch 1,
not the 2.5x a quarter of the bytes allows), and a 64-row product of the 8B MLP took 521 us
against bf16's 150: 64 clients ran at 0.15x bf16.

How (the layout of GPTQ's Triton kernels): the weight [N, K] is stored K-major as int32
[K/8, N], eight 4-bit values of consecutive inputs a word, so a program's threads read
consecutive output columns; scales and zeros [K/group, N]. A program takes a tile of rows, of
output columns and of the inputs (split-K when the rows are few, so that a matrix-vector
product of a narrow layer still fills the GPU), unpacks and dequantizes its weight tile to
bfloat16 ((q - 8) * scale + zero, quant.py's arithmetic) and multiplies it on the tensor
cores; the split-K parts are added in float32, in order, by a second small kernel. A
prefill's hundreds of rows dequantize the weight once instead and multiply it densely. (A
one-row matrix-vector form that dequantized no weight was tried and dropped: on an H100 it
was 1.6-2.2x slower than tinygemm and than these tiles at one row, 2026-11-26.)"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..device import cuda_multiprocessors
from .decode_attention import triton

PACK = 8  # 4-bit values an int32 holds
TINY_K = 128  # inputs of one of tinygemm's k-chunks: 8 tiles of 16, 32 words of a column's 8
# Past this many rows a product dequantizes the weight to bfloat16 once and multiplies densely
# (the dequantized weight's writes and reads cost less than the tiles' dequantizing it anew for
# every 64 rows: on an H100 an 8B layer's four products at 256 rows took 428 us so against the
# tiles' 719 on tinygemm's words, 2026-11-27; at 128, 402 against 367; tinygemm's 3,779 and
# 1,905).
DEQUANT_ROWS = 256
TINY_DEQUANT_ROWS = 128
SUM_BLOCK = 1024

if triton is not None:
    import triton.language as tl

    _TINY_K = tl.constexpr(TINY_K)

    @triton.jit
    def _spread(v, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
        """[BLOCK_K / GROUP, BLOCK_N] -> [BLOCK_K, BLOCK_N], each row repeated GROUP times."""
        return tl.reshape(tl.broadcast_to(v[:, None, :], (BLOCK_K // GROUP, GROUP, BLOCK_N)),
                          (BLOCK_K, BLOCK_N))

    @triton.jit
    def _weight_tile(QW, Scales, Zeros, start, cols, col_ok, N, GROUP: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
        """Inputs start..start+BLOCK_K of the weight's columns `cols`, dequantized (float32
        [BLOCK_K, BLOCK_N]). Each word and each group's scale and zero is read once and spread
        over its 8 inputs, or its GROUP inputs, in registers."""
        words = tl.load(QW + (start // 8 + tl.arange(0, BLOCK_K // 8))[:, None] * N
                        + cols[None, :], mask=col_ok[None, :], other=0)
        q = (words[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF
        q = tl.reshape(q, (BLOCK_K, BLOCK_N))
        g = (start // GROUP + tl.arange(0, BLOCK_K // GROUP))[:, None] * N + cols[None, :]
        scale = tl.load(Scales + g, mask=col_ok[None, :], other=0.0).to(tl.float32)
        zero = tl.load(Zeros + g, mask=col_ok[None, :], other=0.0).to(tl.float32)
        # q - 8 as a float through its bits: q | 0x4B000000 is the float 2**23 + q exactly
        # (an int-to-float conversion runs at a quarter of the rate or less on the GPU).
        centred = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        return (centred * _spread(scale, GROUP, BLOCK_K, BLOCK_N)
                + _spread(zero, GROUP, BLOCK_K, BLOCK_N))

    @triton.jit
    def _by_word(v, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
        """A tile's groups' values [BLOCK_N, BLOCK_K / GROUP] -> each word's [BLOCK_N,
        BLOCK_K / 8] (word r = (chunk, b, w) lies in group (128 chunk + 32 w) / GROUP)."""
        if GROUP <= _TINY_K:  # WG groups a chunk, each over 4 / WG of its w
            WG: tl.constexpr = _TINY_K // GROUP
            v = tl.reshape(v, (BLOCK_N, BLOCK_K // _TINY_K, 1, WG, 1))
            v = tl.broadcast_to(v, (BLOCK_N, BLOCK_K // _TINY_K, 4, WG, 4 // WG))
        else:  # a group over GROUP / 128 chunks
            v = tl.reshape(v, (BLOCK_N, BLOCK_K // GROUP, 1))
            v = tl.broadcast_to(v, (BLOCK_N, BLOCK_K // GROUP, GROUP // 8))
        return tl.reshape(v, (BLOCK_N, BLOCK_K // 8))

    @triton.jit
    def _tiny_tile(QW, SZ, start, cols, col_ok, N, K, GROUP: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
        """Inputs start..start+BLOCK_K (whole chunks of TINY_K) of the columns `cols` of a
        weight in tinygemm's layout (tiny_pack), dequantized: float32 [BLOCK_N, BLOCK_K]. Each
        word is read once, its column's 16 of a chunk side by side, and its 8 values taken
        from it in registers; the tile's scales and zeros are read once, pairs side by side;
        the values are then put in ascending order of their inputs in registers (on an H100
        12-15% faster than gathering the activations into the words' order instead)."""
        r = tl.arange(0, BLOCK_K // 8)  # a column's words: (chunk, b, w), w fastest
        chunk = start // _TINY_K + r // 16
        b = (r // 4) % 4
        w = r % 4
        lane = 4 * (cols % 8)  # t = 4a + b, a = the column within its 8
        words = tl.load(QW + ((cols // 8)[:, None] * (K // _TINY_K) + chunk[None, :]) * 128
                        + (lane[:, None] + b[None, :]) * 4 + w[None, :],
                        mask=col_ok[:, None], other=0)
        j = tl.arange(0, 8)  # nibble j = 4h + i
        q = (words[:, :, None] >> (4 * j)[None, None, :]) & 0xF
        g = start // GROUP + tl.arange(0, BLOCK_K // GROUP)
        pairs = tl.load(SZ + (g[None, :, None] * N + cols[:, None, None]) * 2
                        + tl.arange(0, 2)[None, None, :], mask=col_ok[:, None, None], other=0.0)
        scale, zero = tl.split(pairs.to(tl.float32))
        scale = _by_word(scale, GROUP, BLOCK_K, BLOCK_N)
        zero = _by_word(zero, GROUP, BLOCK_K, BLOCK_N)
        centred = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # as _weight_tile
        weights = centred * scale[:, :, None] + zero[:, :, None]
        # (chunk, b, w, h, i) -> (chunk, w, i, b, h): input 32 w + 8 i + 2 b + h of a chunk
        weights = tl.reshape(weights, (BLOCK_N, BLOCK_K // _TINY_K, 4, 4, 2, 4))
        return tl.reshape(tl.permute(weights, (0, 1, 3, 5, 2, 4)), (BLOCK_N, BLOCK_K))

    @triton.jit
    def tile(M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr):
        """A tiled product's program (rows, columns, split): its rows and columns, which of
        them exist, and the inputs it sums (first to last)."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        per_split = K // SPLIT_K
        first = tl.program_id(2) * per_split
        return rows, cols, rows < M, cols < N, first, first + per_split

    @triton.jit
    def _int4_mm_kernel(X, QW, Scales, Zeros, Out, M, N, K,
                        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, BF16_DOT: tl.constexpr):
        """Out[pid_k, M, N] = X[M, K] @ dequant(QW)[K, N] over this program's share of K (in
        float32 when split, for _sum_splits_kernel; else in the activations' dtype)."""
        rows, cols, row_ok, col_ok, first, last = tile(M, N, K, BLOCK_M, BLOCK_N, SPLIT_K)
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(first, last, BLOCK_K):
            x = tl.load(X + rows[:, None] * K + (start + ks)[None, :], mask=row_ok[:, None],
                        other=0.0)
            w = _weight_tile(QW, Scales, Zeros, start, cols, col_ok, N, GROUP, BLOCK_K, BLOCK_N)
            if BF16_DOT:
                acc += tl.dot(x.to(tl.bfloat16), w.to(tl.bfloat16))
            else:  # Triton's interpreter multiplies bfloat16 as raw bits: its tests' path
                acc += tl.dot(x.to(tl.float32), w.to(tl.bfloat16).to(tl.float32),
                              input_precision="ieee")
        out = Out + tl.program_id(2) * M * N + rows[:, None] * N + cols[None, :]
        tl.store(out, acc.to(Out.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    # Not specialized on M (Triton compiles anew for ints equal to 1, multiples of 16 and the
    # rest): a prefill's rows come in every count, and each compile is ~0.5 s on a GPU host.
    @triton.jit(do_not_specialize=["M"])
    def _int4_mm_tiny_kernel(X, QW, SZ, Out, M, N, K, GROUP: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                             BF16_DOT: tl.constexpr):
        """_int4_mm_kernel of a weight in tinygemm's layout (QW its words, SZ its [K/group, N,
        2] scales and zeros)."""
        rows, cols, row_ok, col_ok, first, last = tile(M, N, K, BLOCK_M, BLOCK_N, SPLIT_K)
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(first, last, BLOCK_K):
            w = tl.trans(_tiny_tile(QW, SZ, start, cols, col_ok, N, K, GROUP, BLOCK_K, BLOCK_N))
            x = tl.load(X + rows[:, None] * K + (start + ks)[None, :], mask=row_ok[:, None],
                        other=0.0)
            if BF16_DOT:
                acc += tl.dot(x.to(tl.bfloat16), w.to(tl.bfloat16))
            else:  # the interpreter's path, as _int4_mm_kernel's
                acc += tl.dot(x.to(tl.float32), w.to(tl.bfloat16).to(tl.float32),
                              input_precision="ieee")
        out = Out + tl.program_id(2) * M * N + rows[:, None] * N + cols[None, :]
        tl.store(out, acc.to(Out.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _dequant_kernel(QW, Scales, Zeros, W, N, K, GROUP: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, TINY: tl.constexpr):
        """W[K, N] (bfloat16) = the int4 weight dequantized, a [BLOCK_K, BLOCK_N] tile a
        program (TINY: as _int4_mm_kernel's)."""
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        start = tl.program_id(0) * BLOCK_K
        if TINY:
            w = tl.trans(_tiny_tile(QW, Scales, start, cols, col_ok, N, K, GROUP, BLOCK_K,
                                    BLOCK_N))
        else:
            w = _weight_tile(QW, Scales, Zeros, start, cols, col_ok, N, GROUP, BLOCK_K,
                             BLOCK_N)
        ks = start + tl.arange(0, BLOCK_K)
        tl.store(W + ks[:, None] * N + cols[None, :], w.to(W.dtype.element_ty),
                 mask=col_ok[None, :])

    @triton.jit
    def _sum_splits_kernel(Parts, Out, size, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
        """Out[i] = Parts[0, i] + ... + Parts[SPLIT_K - 1, i], in that order, in Out's dtype."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < size
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for split in tl.static_range(SPLIT_K):
            total += tl.load(Parts + split * size + offs, mask=ok, other=0.0)
        tl.store(Out + offs, total.to(Out.dtype.element_ty), mask=ok)


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


def plan(m: int, n: int, k: int, group: int, sms: int = 132, tiny: bool = False) -> Plan:
    """Few rows (decode): tiles of 16 rows (the tensor cores' least) by 128 columns, 128
    inputs a step. More rows, up to DEQUANT_ROWS: 64 x 128 tiles, 64 inputs a step. Either way
    the inputs are split (up to 8 ways) until there are about four programs an SM: a product of
    4,096 columns has only 32 tiles of them, and a matrix-vector product is bound by the bytes
    in flight.

    Tuned on an H100 at one row (probe_quant_layers.py --int4-plans, 2026-11-26): over 48
    tilings of each 8B layer the fastest were 128 columns, 4 warps, split 4-8 ways, tiles of
    16 rows (a one-row form then, which dequantized each weight, was 1.3-1.7x slower); the
    64-row tiles' split is not measured. tiny: the weight in tinygemm's layout, read in whole
    chunks of TINY_K inputs."""
    block_m, block_k = (16, max(128, group)) if m <= 16 else (64, max(64, group))
    if tiny:
        block_k = max(block_k, TINY_K)
    # Counted in columns only, so a layer's plan is the same for 17 rows as for 256: a row's
    # bits change with its batch only where the tiles do (16 rows and over).
    split, tiles = 1, -(-n // 128)
    while split < 8 and tiles * split <= 4 * sms and k % (block_k * split * 2) == 0:
        split *= 2
    return Plan(block_m, 128, block_k, split, 4, 3)


def fits(n: int, k: int, group: int) -> bool:
    """Whether a [N, K] weight of this group size takes the kernel: K in whole steps of
    either plan's BLOCK_K, each step whole groups."""
    block_k = max(plan(1, n, k, group).block_k, plan(DEQUANT_ROWS, n, k, group).block_k)
    return k % block_k == 0 and block_k % group == 0 and k % PACK == 0


def pack(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] in 0..15 -> int32 [K/8, N]: word (i, n) holds q[n, 8i..8i+7], the first
    in its lowest bits."""
    n, k = q.shape
    parts = q.to(torch.int32).t().reshape(k // PACK, PACK, n)
    words = torch.zeros(k // PACK, n, dtype=torch.int32, device=q.device)
    for j in range(PACK):
        words |= parts[:, j, :] << (4 * j)
    return words


def tiny_pack(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] in 0..15 -> int32 [N/8, K/128, 32, 4]: what ATen's CUDA
    torch._convert_weight_to_int4pack(pairs, 8) makes of its byte pairs (q[:, 2i] << 4 |
    q[:, 2i+1]), here in torch ops, so that the kernels reading it run on the CPU too (the GPU
    check compares the two). Word [c, kc, t, w] holds column 8c + t // 4 and, in nibble
    4h + i, input 128 kc + 32 w + 8 i + 2 (t % 4) + h: the m16n8k16 tensor-core fragments of
    its lane t, two k-tiles a word."""
    n, k = q.shape
    v = q.to(torch.int64).reshape(n // 8, 8, k // TINY_K, 4, 4, 4, 2)  # c a kc w i b h
    v = v.permute(0, 2, 1, 5, 3, 6, 4).reshape(n // 8, k // TINY_K, 32, 4, 8)
    words = (v << (4 * torch.arange(8, device=q.device))).sum(-1)  # distinct bits: an or
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def available() -> bool:
    return triton is not None


def wanted() -> bool:
    return os.environ.get("DUET_INT4_KERNEL") == "triton" and triton is not None


@torch.library.custom_op("duet::int4_mm", mutates_args=())
def int4_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
            group: int) -> torch.Tensor:
    """x [M, K] (bfloat16) times the int4 weight (pack()'s qweight [K/8, N], scales and zeros
    [K/group, N]) -> [M, N] in x's dtype."""
    m, k = x.shape
    if m > DEQUANT_ROWS:
        return x @ dequantize(qweight, scales, zeros, group).to(x.dtype)
    p = plan(m, qweight.shape[1], k, group, cuda_multiprocessors(x.device.index)
             if x.device.type == "cuda" else 132)
    return launch(x, qweight, scales, zeros, group, p)


@int4_mm.register_fake
def _(x, qweight, scales, zeros, group):
    return x.new_empty(x.shape[0], qweight.shape[1])


@torch.library.custom_op("duet::int4_mm_tiny", mutates_args=())
def int4_mm_tiny(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor,
                 group: int) -> torch.Tensor:
    """x [M, K] (bfloat16) times an int4 weight as tinygemm keeps it (packed [N/8, K/128, 32,
    4] int32, scales_zeros [K/group, N, 2]) -> [M, N], for the rows tinygemm is slow at: its
    time grows with the rows (an H100, 2026-11-27, the 8B gate/up product: 36 us at one row,
    136 at 16, 501 at 64, where this kernel took 66 and 91, as the same tiles on the kernels'
    own layout)."""
    m, k = x.shape
    if m > TINY_DEQUANT_ROWS:
        return x @ dequantize_tiny(packed, scales_zeros, group).to(x.dtype)
    p = plan(m, packed.shape[0] * 8, k, group, cuda_multiprocessors(x.device.index)
             if x.device.type == "cuda" else 132, tiny=True)
    return launch_tiny(x, packed, scales_zeros, group, p)


@int4_mm_tiny.register_fake
def _(x, packed, scales_zeros, group):
    return x.new_empty(x.shape[0], packed.shape[0] * 8)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               group: int) -> torch.Tensor:
    """The weight [K, N] in bfloat16, for a product of many rows (a prefill's): one pass over
    the int4 weight, then the dense product's tensor cores, where tiles of the fused kernel
    would dequantize each weight once per 64 rows."""
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
    block_k = max(64, group)
    w = torch.empty(k, n, dtype=torch.bfloat16, device=qweight.device)
    _dequant_kernel[(k // block_k, triton.cdiv(n, 64))](qweight, scales, zeros, w, n, k,
                                                        GROUP=group, BLOCK_K=block_k,
                                                        BLOCK_N=64, TINY=False)
    return w


def dequantize_tiny(packed: torch.Tensor, scales_zeros: torch.Tensor,
                    group: int) -> torch.Tensor:
    """dequantize() of a weight in tinygemm's layout."""
    n, k = packed.shape[0] * 8, packed.shape[1] * TINY_K
    block_k = max(TINY_K, group)
    w = torch.empty(k, n, dtype=torch.bfloat16, device=packed.device)
    _dequant_kernel[(k // block_k, triton.cdiv(n, 64))](packed, scales_zeros, scales_zeros, w,
                                                        n, k, GROUP=group, BLOCK_K=block_k,
                                                        BLOCK_N=64, TINY=True)
    return w


def launch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
           group: int, p: Plan) -> torch.Tensor:
    """int4_mm with the tiles of p (scripts/probe_quant_layers.py --int4-plans tries others)."""
    m, k = x.shape
    n = qweight.shape[1]
    # Each split's part apart, added in split order after (one small kernel, which also
    # rounds): a row's result is the same bits every time, as atomic adds in whatever order
    # the programs end would not give.
    out, parts = outputs(m, n, p.split_k, x.dtype, x.device)
    grid = (triton.cdiv(m, p.block_m), triton.cdiv(n, p.block_n), p.split_k)
    _int4_mm_kernel[grid](x.contiguous(), qweight, scales, zeros, parts, m, n, k, GROUP=group,
                          BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k,
                          SPLIT_K=p.split_k, BF16_DOT=x.device.type == "cuda",
                          num_warps=p.warps, num_stages=p.stages)
    return add_splits(parts, out, p.split_k)


def launch_tiny(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, group: int,
                p: Plan) -> torch.Tensor:
    """int4_mm_tiny's product with the tiles of p, its splits added as launch()'s."""
    m, k = x.shape
    n = packed.shape[0] * 8
    out, parts = outputs(m, n, p.split_k, x.dtype, x.device)
    grid = (triton.cdiv(m, p.block_m), triton.cdiv(n, p.block_n), p.split_k)
    _int4_mm_tiny_kernel[grid](x.contiguous(), packed, scales_zeros, parts, m, n, k, GROUP=group,
                               BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k,
                               SPLIT_K=p.split_k, BF16_DOT=x.device.type == "cuda",
                               num_warps=p.warps, num_stages=p.stages)
    return add_splits(parts, out, p.split_k)


def outputs(m: int, n: int, split_k: int, dtype: torch.dtype,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A product's result [M, N] and where its programs write: the result itself, or when the
    inputs are split, float32 parts [SPLIT_K, M, N] for add_splits."""
    out = torch.empty(m, n, dtype=dtype, device=device)
    if split_k == 1:
        return out, out
    return out, torch.empty(split_k, m, n, dtype=torch.float32, device=device)


def add_splits(parts: torch.Tensor, out: torch.Tensor, split_k: int) -> torch.Tensor:
    """out = the parts' sum in split order (nothing to do when not split)."""
    if split_k > 1:
        size = out.numel()
        _sum_splits_kernel[(triton.cdiv(size, SUM_BLOCK),)](parts, out, size, SPLIT_K=split_k,
                                                            BLOCK=SUM_BLOCK)
    return out
