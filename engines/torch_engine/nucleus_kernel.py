"""Each row's nucleus border (the least probability its top_k and top_p keep) as a Triton
kernel that searches the row instead of sorting it, for the CUDA sampler's graphs.

Why: sampling.nucleus sorts every row whole to find its border; for 64 rows of a 49k
vocabulary that sort was 0.5 of the 0.62 ms a top_p draw took on an H100, a third of a
llama-3.2-1b step. The border needs no order, only sums: a row's top_p border is the largest
probability L whose tokens at or above it hold top_p of the mass (of what top_k kept), and its
top_k border the largest whose tokens at or above it number k. Non-negative floats order as
their bit patterns do, so one program per row bisects the bits, each pass a read of the row
(from L2) that sums the mass (or counts the tokens) at or above the middle, and snaps the range's
ends to the nearest probabilities present on either side: the search ends on a value the row
holds, exactly the border the sorted ranks give (sampling._borders), ties kept alike. Both sum
the mass in float32, in other orders: where the mass at a border lies within rounding of top_p
they may fall one token apart (on an H200, either was off exact float64 sums in 1 to 7 rows of
64 with a 128k vocabulary; summed in float64 here, the search took 40% longer).

Measured alone on an H200 (top_p 0.95, 4096 probabilities a pass over 16 warps): 49k
vocabulary 58 us for 1 row, 82 us for 64 (the sort: 48 and 284); 128k 233 and 268 us (55 and
609). One program a row reads the row some 20 times, so a lone row is slower than a sort that
spreads it over the GPU, which the sort's own ops around it (a cumulative sum, gathers) make up
for within the sampler's graph at 49k.

On a machine without Triton the module imports, and `available()` says False.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch ship without Triton
    triton = None


def available() -> bool:
    return triton is not None


BLOCK, WARPS = 4096, 16  # probabilities a program reads at once, and its warps

if triton is not None:

    @triton.jit
    def _ends(row, V, BLOCK: tl.constexpr):
        """The row's whole mass, and the least and greatest bits of its probabilities."""
        mass = tl.zeros([BLOCK], tl.float32)
        least = tl.full([BLOCK], 0x7FFFFFFF, tl.int32)
        most = tl.full([BLOCK], -1, tl.int32)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inside = offs < V
            p = tl.load(row + offs, mask=inside, other=0.0)
            bits = p.to(tl.int32, bitcast=True)
            mass += p
            least = tl.minimum(least, tl.where(inside, bits, 0x7FFFFFFF))
            most = tl.maximum(most, bits)
        return tl.sum(mass), tl.min(least), tl.max(most)

    @triton.jit
    def _split(row, V, cut, floor, BLOCK: tl.constexpr, MASS: tl.constexpr):
        """Over the row's probabilities whose bits are at least floor: the mass (MASS) or the
        number of those at or above bits cut, the least bits at or above it, and the greatest
        below it. Each lane keeps its own; they are added up once, at the end."""
        total = tl.zeros([BLOCK], tl.float32 if MASS else tl.int32)
        above = tl.full([BLOCK], 0x7FFFFFFF, tl.int32)
        below = tl.full([BLOCK], -1, tl.int32)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            # Past the row: -1.0, whose bits are negative, below every floor.
            p = tl.load(row + offs, mask=offs < V, other=-1.0)
            bits = p.to(tl.int32, bitcast=True)
            hit = bits >= cut
            if MASS:
                total += tl.where(hit, p, 0.0)
            else:
                total += hit.to(tl.int32)
            above = tl.minimum(above, tl.where(hit, bits, 0x7FFFFFFF))
            below = tl.maximum(below, tl.where((bits >= floor) & ~hit, bits, -1))
        return tl.sum(total), tl.min(above), tl.max(below)

    @triton.jit
    def _search(row, V, lo, hi, floor, goal, BLOCK: tl.constexpr, MASS: tl.constexpr):
        """The largest bits in [lo, hi] where the probabilities at or above them (and at least
        floor) sum to goal or more (MASS), or number goal or more. The range's ends are always
        bits the row holds; its middle splits it, then the end that moves snaps to the nearest
        bits present on its side."""
        while lo < hi:
            # In 64 bits: from bits 0 (a zero) to a NaN's 0x7FFFFFFF, int32's hi - lo + 1
            # wrapped to a cut below lo, and a top_k row of NaNs and zeros searched for ever.
            cut = ((lo.to(tl.int64) + hi.to(tl.int64) + 1) // 2).to(tl.int32)
            total, above, below = _split(row, V, cut, floor, BLOCK, MASS)
            if total >= goal:
                lo = above
            else:
                hi = below
        return lo

    @triton.jit
    def _borders_kernel(Probs, stride, Floats, Ints, Out, V, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        probs = Probs + row * stride
        top_p = tl.load(Floats + row * 3 + 2)
        k = tl.load(Ints + row * 3 + 2).to(tl.int32)  # V where the row has no top_k
        kept, least, most = _ends(probs, V, BLOCK)
        floor = least
        border = 0
        if k < V:  # top_k: the largest bits whose tokens at or above number at least k
            floor = _search(probs, V, least, most, least, k, BLOCK, False)
            border = floor
            kept, _above, _below = _split(probs, V, floor, least, BLOCK, True)
        # top_p: the largest bits whose tokens at or above (and within top_k) hold at least
        # top_p of the mass top_k kept; the likeliest token always stays.
        if top_p < 1.0:
            border = _search(probs, V, floor, most, floor, top_p * kept, BLOCK, True)
        tl.store(Out + row, border.to(tl.float32, bitcast=True))


def borders(probs: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor) -> torch.Tensor:
    """Each row's least kept probability [B, 1] under its top_k and top_p (0 where it has
    neither): probs [B, V] float32 (non-negative), floats and ints as sampling.nucleus has
    them. One launch, no host reads: a CUDA graph captures it."""
    b, v = probs.shape
    out = torch.empty(b, 1, dtype=torch.float32, device=probs.device)
    _borders_kernel[(b,)](probs, probs.stride(0), floats.contiguous(), ints.contiguous(), out,
                          v, BLOCK=BLOCK, num_warps=WARPS)
    return out
