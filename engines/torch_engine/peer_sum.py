"""A tensor-parallel decode step's sums over the GPUs of one host, in one kernel each.

Why: a decode step of a model split over ranks sums two partial hidden states a layer (64 sums
for the 8B shape), each a few kilobytes. NCCL's all-reduce of 8 KB costs 11 us inside a CUDA
graph on two H100s and PyTorch's symmetric-memory one-shot 9 us (scripts/bench_all_reduce.py):
close to a millisecond a step, a quarter of what the split step's matrix products take.

How (Lamport's scheme, as TensorRT-LLM's one-shot all-reduce uses it): every rank holds a
receive buffer with one slot per rank, which every other rank can write over NVLink (PyTorch's
symmetric memory maps them). A rank writes its partial into its slot of every rank's buffer,
then reads its own buffer until every element has arrived, adds the slots up in rank order
(so every rank gets the same bits) and sets them back to "empty". "Empty" is negative zero,
which no rank ever sends (a negative zero is sent as a zero): each element shows its own
arrival, so there is no barrier, no flag and no fence, only the write's latency.

A buffer can be written again only once its owner has read it: each rank has two, and
consecutive sums alternate between them (a layer's attention sums through phase 0, its MLP
through phase 1, so every forward does). A rank cannot run two sums ahead of another, since
each sum waits for every rank's part; so the buffer a sum writes was read and emptied by its
owner one sum before, in a kernel that ended before the owner sent that sum's part.

Only 16-bit floats (negative zero is 0x8000 in both) and sums of up to `capacity` elements go
this way; the rest, and the CPU, go through the process group's all-reduce (tensor_parallel.Sums).

A gather to rank 0 (a decode step's logits, each rank's share of the vocabulary) works the same
way into rank 0's buffer alone; the other ranks send and go on. A share from rank 0 (a
pipelined step's sampled tokens, which the other ranks' next step takes its inputs from) is the
gather turned round: rank 0 writes the token ids into every other rank's buffer and goes on;
each of them waits for its own (ids are never negative, and an empty pair of int16 reads as a
negative int32)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..device import cuda_multiprocessors
from .decode_attention import dependent_launch, triton

log = logging.getLogger("duet.engines.torch")

EMPTY = -32768  # 0x8000 as int16: negative zero in bfloat16 and float16
EMPTY32 = -2147450880  # 0x80008000: two EMPTY int16, as one int32 (a share's empty token)
SHARE_BLOCK = 256
PHASES = 2
# Rows up to which peer_sum_norm is one kernel, a program a row. Past them one program a row
# sums too slowly (two H100s, 8B shape: a 64-row step 3.72 ms against 3.41 unfused), and the
# sum goes through _peer_sum_kernel's layout, then a kernel adds and norms the rows.
FUSED_ROWS = 8
BLOCK, MAX_BLOCK = 1024, 4096  # elements a program moves at once: the least, the most
# Programs a sum may have: two an SM at most (each of 8 warps or fewer, so two fit), every
# program resident at once, and one waits only for its peers' namesakes.
MAX_PROGRAMS = 256


def max_programs(device: torch.device) -> int:
    return (min(MAX_PROGRAMS, 2 * cuda_multiprocessors(device.index)) if device.type == "cuda"
            else MAX_PROGRAMS)


def layout(n: int, programs: int = MAX_PROGRAMS) -> tuple[int, int, int]:
    """(programs, block, warps) of a sum or gather of n elements, with up to `programs`
    programs. A decode step's few kilobytes are bound by latency: as many programs as blocks
    of BLOCK. Past that each program's block grows (up to MAX_BLOCK, with its warps) as long as
    every program still takes two blocks or more: measured on two H100s (bench_all_reduce.py
    --layouts), a program that sends its one block and at once waits for its peers' made a
    2 MB sum four times as slow, and blocks of BLOCK a 16 MB sum (a prefill's 2,048 tokens)
    1.7 times as slow."""
    rounds = 2 * programs
    block = min(max(1 << ((n // rounds).bit_length() - 1) if n >= rounds else 1, BLOCK),
                MAX_BLOCK)
    return min(-(-n // block), programs), block, max(4, block // 512)


if triton is not None:
    import triton.language as tl

    from .decode_attention import follow

    _EMPTY = tl.constexpr(EMPTY)
    _EMPTY32 = tl.constexpr(EMPTY32)

    @triton.jit
    def _send(X, Ptrs, offs, ok, rank, slot_stride, phase_offset, WORLD: tl.constexpr):
        """This rank's elements X[offs] into its slot of every rank's buffer."""
        bits = tl.load(X + offs, mask=ok, other=0)
        bits = tl.where(bits == _EMPTY, 0, bits)  # a negative zero goes as a zero
        for r in tl.static_range(WORLD):
            dst = tl.load(Ptrs + r).to(tl.pointer_type(tl.int16))
            tl.store(dst + phase_offset + rank * slot_stride + offs, bits, mask=ok)

    @triton.jit
    def _arrived(src, ok):
        """The elements at src once every one has arrived; their places emptied."""
        bits = tl.load(src, mask=ok, other=0, volatile=True)
        while tl.max((bits == _EMPTY).to(tl.int32), axis=0) > 0:
            bits = tl.load(src, mask=ok, other=0, volatile=True)
        tl.store(src, tl.full(bits.shape, _EMPTY, tl.int16), mask=ok)
        return bits

    @triton.jit
    def _received_sum(own, offs, ok, slot_stride, phase_offset, WORLD: tl.constexpr,
                      BF16: tl.constexpr):
        """Every rank's elements at offs of this rank's buffer, added up in rank order in
        float32 as they arrive."""
        acc = tl.zeros(offs.shape, dtype=tl.float32)
        for r in tl.static_range(WORLD):
            bits = _arrived(own + phase_offset + r * slot_stride + offs, ok)
            if BF16:
                acc += bits.to(tl.bfloat16, bitcast=True).to(tl.float32)
            else:
                acc += bits.to(tl.float16, bitcast=True).to(tl.float32)
        return acc

    @triton.jit
    def _peer_sum_kernel(X, Out, Ptrs, rank, n, slot_stride, phase_offset,
                         WORLD: tl.constexpr, BF16: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
        follow(PDL)
        pid, programs = tl.program_id(0), tl.num_programs(0)
        chunks = tl.cdiv(n, BLOCK)
        for chunk in range(pid, chunks, programs):  # every chunk sent before any is awaited
            offs = chunk * BLOCK + tl.arange(0, BLOCK)
            _send(X, Ptrs, offs, offs < n, rank, slot_stride, phase_offset, WORLD)
        own = tl.load(Ptrs + rank).to(tl.pointer_type(tl.int16))
        for chunk in range(pid, chunks, programs):
            offs = chunk * BLOCK + tl.arange(0, BLOCK)
            ok = offs < n
            acc = _received_sum(own, offs, ok, slot_stride, phase_offset, WORLD, BF16)
            tl.store(Out + offs, acc.to(Out.dtype.element_ty), mask=ok)

    @triton.jit
    def _add_norm_row(acc, Res, W, NewRes, Normed, row, cols, ok, hidden, eps):
        """Row `row`'s sum acc (float32, rounded as the residual stream is: where the unfused
        step rounds) added to the residual stream (NewRes) and RMS-normed (Normed)."""
        offs = row * hidden + cols
        res = tl.load(Res + offs, mask=ok, other=0.0).to(tl.float32)
        new = (res + acc).to(Res.dtype.element_ty)
        tl.store(NewRes + offs, new, mask=ok)
        x = new.to(tl.float32)
        scale = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(Normed + offs, (x * scale * w).to(Res.dtype.element_ty), mask=ok)

    @triton.jit
    def _peer_sum_norm_kernel(X, Res, W, NewRes, Normed, Ptrs, rank, rows, hidden, eps,
                              slot_stride, phase_offset, WORLD: tl.constexpr,
                              BF16: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
        """The peer sum of rows of `hidden`, one program a row, then what the layer does next
        with it: added to the residual stream (NewRes) and RMS-normed (Normed)."""
        follow(PDL)
        pid, programs = tl.program_id(0), tl.num_programs(0)
        cols = tl.arange(0, BLOCK_H)
        ok = cols < hidden
        for row in range(pid, rows, programs):
            _send(X, Ptrs, row * hidden + cols, ok, rank, slot_stride, phase_offset, WORLD)
        own = tl.load(Ptrs + rank).to(tl.pointer_type(tl.int16))
        for row in range(pid, rows, programs):
            acc = _received_sum(own, row * hidden + cols, ok, slot_stride, phase_offset, WORLD,
                                BF16)
            _add_norm_row(acc.to(Res.dtype.element_ty).to(tl.float32), Res, W, NewRes, Normed,
                          row, cols, ok, hidden, eps)

    @triton.jit
    def _add_norm_kernel(Sum, Res, W, NewRes, Normed, rows, hidden, eps,
                         BLOCK_H: tl.constexpr, PDL: tl.constexpr):
        """_peer_sum_norm_kernel's add and norm of sums already made, one program a row."""
        follow(PDL)
        pid, programs = tl.program_id(0), tl.num_programs(0)
        cols = tl.arange(0, BLOCK_H)
        ok = cols < hidden
        for row in range(pid, rows, programs):
            acc = tl.load(Sum + row * hidden + cols, mask=ok, other=0.0).to(tl.float32)
            _add_norm_row(acc, Res, W, NewRes, Normed, row, cols, ok, hidden, eps)

    @triton.jit
    def _peer_gather_kernel(X, Out, Ptrs, rank, n, part, slot_stride,
                            WORLD: tl.constexpr, BLOCK: tl.constexpr):
        pid, programs = tl.program_id(0), tl.num_programs(0)
        chunks = tl.cdiv(n, BLOCK)
        first = tl.load(Ptrs).to(tl.pointer_type(tl.int16))  # rank 0's buffer
        if rank != 0:  # send this rank's columns to rank 0 (the first of a world of one)
            for chunk in range(pid, chunks, programs):
                offs = chunk * BLOCK + tl.arange(0, BLOCK)
                _send(X, Ptrs, offs, offs < n, rank, slot_stride, 0, 1)
        else:  # lay rank 0's own columns and each other rank's, as they arrive, side by side
            for chunk in range(pid, chunks, programs):
                offs = chunk * BLOCK + tl.arange(0, BLOCK)
                ok = offs < n
                out = Out + (offs // part) * (WORLD * part) + offs % part
                tl.store(out, tl.load(X + offs, mask=ok, other=0), mask=ok)
                for r in tl.static_range(1, WORLD):
                    tl.store(out + r * part, _arrived(first + r * slot_stride + offs, ok),
                             mask=ok)


    @triton.jit
    def _peer_share_kernel(X, Out, Ptrs, rank, n, phase_offset, WORLD: tl.constexpr,
                           BLOCK: tl.constexpr):
        """Rank 0: X's ids (int64) as int32 into every other rank's buffer. Another rank: its
        buffer's ids into Out once every one has arrived, their places emptied."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        if rank == 0:
            ids = tl.load(X + offs, mask=ok, other=0).to(tl.int32)
            for r in tl.static_range(1, WORLD):
                dst = tl.load(Ptrs + r).to(tl.pointer_type(tl.int32))
                tl.store(dst + phase_offset + offs, ids, mask=ok)
        else:
            own = tl.load(Ptrs + rank).to(tl.pointer_type(tl.int32)) + phase_offset
            ids = tl.load(own + offs, mask=ok, other=0, volatile=True)
            while tl.min(ids, axis=0) < 0:
                ids = tl.load(own + offs, mask=ok, other=0, volatile=True)
            tl.store(own + offs, tl.full(ids.shape, _EMPTY32, tl.int32), mask=ok)
            tl.store(Out + offs, ids.to(tl.int64), mask=ok)


def share(ids: torch.Tensor, ptrs: torch.Tensor, rank: int, capacity: int,
          phase: int) -> torch.Tensor:
    """Rank 0: ids [n] (int64, never negative) sent to every other rank, and ids back. Another
    rank: the n ids rank 0 sent (ids gives n and the device; its values are not read). Every
    rank calls it at the same point, alternating phases (0, 1, 0, ...): rank 0 may write a
    phase again only after every rank read it, which holds since each step's forward sums over
    the ranks between two shares. Called eagerly, outside the captured steps."""
    n, world = ids.numel(), ptrs.numel()
    _fits(n, capacity)
    out = ids if rank == 0 else torch.empty(n, dtype=torch.int64, device=ids.device)
    _peer_share_kernel[(triton.cdiv(n, SHARE_BLOCK),)](ids.contiguous(), out, ptrs, rank, n,
                                                       phase * capacity, WORLD=world,
                                                       BLOCK=SHARE_BLOCK)
    return out


def _fits(n: int, capacity: int) -> None:
    if n > capacity:  # it would write past a rank's slot, into the next rank's
        raise ValueError(f"a peer sum of {n} elements is past its buffers' {capacity}")


@torch.library.custom_op("duet::peer_sum", mutates_args=())
def peer_sum(x: torch.Tensor, ptrs: torch.Tensor, rank: int, capacity: int,
             phase: int) -> torch.Tensor:
    """x summed over the ranks whose receive buffers ptrs addresses (int64 device addresses,
    one per rank, each of PHASES x ranks x capacity int16 elements); every rank calls it with
    its own x and rank at the same point. Opaque to torch.compile: its writes to the buffers
    are nothing Inductor may move."""
    return _peer_sum(x, ptrs, rank, capacity, phase)


def _peer_sum(x: torch.Tensor, ptrs: torch.Tensor, rank: int, capacity: int,
              phase: int) -> torch.Tensor:
    """peer_sum itself, which an eager forward (a prefill's, 64 sums for the 8B shape) calls
    without the op's dispatch."""
    flat = x.contiguous().view(-1)
    out = torch.empty_like(flat)
    n, world = flat.numel(), ptrs.numel()
    _fits(n, capacity)
    programs, block, warps = layout(n, max_programs(x.device))
    pdl = dependent_launch(x.device)
    _peer_sum_kernel[(programs,)](flat.view(torch.int16), out, ptrs, rank, n, capacity,
                                  phase * world * capacity, WORLD=world,
                                  BF16=x.dtype == torch.bfloat16, BLOCK=block, PDL=pdl,
                                  num_warps=warps, launch_pdl=pdl)
    return out.view(x.shape)


@peer_sum.register_fake
def _(x, ptrs, rank, capacity, phase):
    return torch.empty_like(x)


@torch.library.custom_op("duet::peer_sum_norm", mutates_args=())
def peer_sum_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                  ptrs: torch.Tensor, rank: int, capacity: int,
                  phase: int) -> tuple[torch.Tensor, torch.Tensor]:
    """peer_sum's x [..., H] summed over the ranks, added to residual, and RMS-normed with
    weight: (residual + sum, its norm), in one kernel (the sum, the add and the norm were three
    kernels of a decode step, or two once compiled; each a launch and a wait in the graph)."""
    hidden = x.shape[-1]
    flat = x.contiguous().view(-1, hidden)
    res = residual.contiguous().view(-1, hidden)
    new, normed = torch.empty_like(res), torch.empty_like(res)
    rows, world = flat.shape[0], ptrs.numel()
    _fits(flat.numel(), capacity)
    programs, block_h = min(rows, max_programs(x.device)), triton.next_power_of_2(hidden)
    pdl = dependent_launch(x.device)
    if rows <= FUSED_ROWS:
        _peer_sum_norm_kernel[(programs,)](
            flat.view(torch.int16), res, weight, new, normed, ptrs, rank, rows, hidden, eps,
            capacity, phase * world * capacity, WORLD=world, BF16=x.dtype == torch.bfloat16,
            BLOCK_H=block_h, PDL=pdl, num_warps=8, launch_pdl=pdl)
    else:  # the sum spread over the SMs first (see FUSED_ROWS), then the rows' add and norm
        summed = _peer_sum(flat, ptrs, rank, capacity, phase)
        _add_norm_kernel[(programs,)](summed, res, weight, new, normed, rows, hidden, eps,
                                      BLOCK_H=block_h, PDL=pdl, num_warps=8, launch_pdl=pdl)
    return new.view(residual.shape), normed.view(residual.shape)


@peer_sum_norm.register_fake
def _(x, residual, weight, eps, ptrs, rank, capacity, phase):
    return torch.empty_like(residual), torch.empty_like(residual)


@torch.library.custom_op("duet::peer_gather", mutates_args=())
def peer_gather(x: torch.Tensor, ptrs: torch.Tensor, rank: int, capacity: int) -> torch.Tensor:
    """Rank 0: the ranks' x [rows, part] side by side, [rows, ranks x part], rank 0's first.
    Another rank: its x sent to rank 0, and an empty [rows, 0] back (to be returned by its
    caller, so the compiler keeps the call). Every rank calls it at the same point; rank 0's
    buffer (ranks x capacity int16 elements) holds one gather at a time, which holds since
    every forward sums over the ranks (waiting for rank 0) before it gathers again."""
    x = x.contiguous()
    rows, part = x.shape
    world = ptrs.numel()
    out = torch.empty(rows, world * part if rank == 0 else 0, dtype=x.dtype, device=x.device)
    n = x.numel()
    _fits(n, capacity)
    programs, block, warps = layout(n, max_programs(x.device))
    _peer_gather_kernel[(programs,)](x.view(torch.int16), out.view(torch.int16), ptrs, rank, n,
                                     part, capacity, WORLD=world, BLOCK=block, num_warps=warps)
    return out


@peer_gather.register_fake
def _(x, ptrs, rank, capacity):
    return x.new_empty(x.shape[0], x.shape[1] * ptrs.numel() if rank == 0 else 0)


@dataclass(frozen=True)
class PeerBuffers:
    """One rank's view of the ranks' buffers (symmetric memory)."""

    ptrs: torch.Tensor  # int64 [world]: each rank's buffer, as this rank addresses it
    # This rank's buffer and its mapping: held while the ranks may write to it.
    buffer: torch.Tensor
    handle: object


@dataclass(frozen=True)
class PeerSum:
    """One rank's handle on the ranks' receive buffers."""

    buffers: PeerBuffers
    rank: int
    capacity: int  # elements a sum may have
    dtype: torch.dtype

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.numel() <= self.capacity

    def __call__(self, x: torch.Tensor, phase: int) -> torch.Tensor:
        op = torch.ops.duet.peer_sum if torch.compiler.is_compiling() else _peer_sum
        return op(x, self.buffers.ptrs, self.rank, self.capacity, phase)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, phase: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.duet.peer_sum_norm(x, residual, weight, eps, self.buffers.ptrs,
                                            self.rank, self.capacity, phase)


@dataclass(frozen=True)
class PeerGather:
    """One rank's handle on rank 0's gather buffer."""

    buffers: PeerBuffers
    rank: int
    capacity: int  # elements a rank's part may have

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.duet.peer_gather(x, self.buffers.ptrs, self.rank, self.capacity)


class PeerShare:
    """One rank's handle on the ranks' share buffers: send() on rank 0, receive() on the
    others, each call taking the next phase."""

    def __init__(self, buffers: PeerBuffers, rank: int, capacity: int):
        self.buffers, self.rank, self.capacity = buffers, rank, capacity
        self._phase = 0

    def _next(self) -> int:
        phase, self._phase = self._phase, self._phase ^ 1
        return phase

    def send(self, ids: torch.Tensor) -> None:
        share(ids, self.buffers.ptrs, self.rank, self.capacity, self._next())

    def receive(self, n: int) -> torch.Tensor:
        template = torch.empty(n, dtype=torch.int64, device=self.buffers.ptrs.device)
        return share(template, self.buffers.ptrs, self.rank, self.capacity, self._next())


def buffer_elements(world: int, capacity: int) -> int:
    return PHASES * world * capacity


def _mapped(group, device: str, elements: int, dtype: torch.dtype) -> PeerBuffers | None:
    """Collective: every rank's buffer of `elements` int16, emptied, where every rank can map
    one, else None on every rank."""
    buffer = None
    wanted = (triton is not None and device.startswith("cuda")
              and dtype in (torch.bfloat16, torch.float16)
              and os.environ.get("DUET_TP_ALL_REDUCE", "peer") != "nccl")
    if wanted:
        try:
            import torch.distributed._symmetric_memory as symm_mem

            buffer = symm_mem.empty(elements, dtype=torch.int16, device=device)
        except Exception as exc:  # no symmetric memory in this build or on this machine
            log.warning("tensor parallelism: no symmetric memory here (%s)", exc)
    if not _everyone(buffer is not None, device, group):
        return None
    handle = symm_mem.rendezvous(buffer, group.group_name)
    buffer.fill_(EMPTY)
    torch.cuda.synchronize(device)
    dist.barrier(group)  # every buffer empty before any rank writes
    ptrs = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
    return PeerBuffers(ptrs, buffer, handle)


def create(group, device: str, capacity: int, dtype: torch.dtype) -> PeerSum | None:
    """Every rank of group calls it at the same point (it is collective): the ranks' buffers
    for sums of up to `capacity` elements, checked on a known sum; None on every rank where
    any rank cannot (no Triton, no symmetric memory, not a 16-bit float, DUET_TP_ALL_REDUCE
    set to nccl), and the process group's all-reduce serves instead."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    buffers = _mapped(group, device, buffer_elements(world, capacity), dtype)
    if buffers is None:
        return None
    peer = PeerSum(buffers, rank, capacity, dtype)
    # Rank r adds r + 1 everywhere, and a negative zero stays a zero; the phases alternate
    # and end on the last, as a forward's do.
    right = True
    for phase, rows, value in ((0, 1, rank + 1.0), (1, 3, rank + 1.0), (0, 2, -0.0),
                               (1, 5, rank + 1.0)):
        got = peer(torch.full((rows, 7), value, dtype=dtype, device=device), phase)
        right &= bool((got == (0 if value == 0 else world * (world + 1) / 2)).all())
    if not _everyone(right, device, group):
        log.warning("tensor parallelism: the peer sums' check failed: NCCL's all-reduce instead")
        return None
    return peer


def create_gather(group, device: str, rows: int, part: int,
                  dtype: torch.dtype) -> PeerGather | None:
    """Collective, as create: rank 0's buffer for gathering [rows, part] from every rank,
    checked on a known gather; None on every rank where any rank cannot."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    buffers = _mapped(group, device, world * rows * part, dtype)
    if buffers is None:
        return None
    gather = PeerGather(buffers, rank, rows * part)
    # Rank r's part is r + 1 (a negative zero's for rank 1: sent as a zero, not waited for).
    value = -0.0 if rank == 1 else rank + 1.0
    got = gather(torch.full((2, 3), value, dtype=dtype, device=device))
    right = True
    if rank == 0:
        want = torch.tensor([0.0 if r == 1 else r + 1.0 for r in range(world)], dtype=dtype,
                            device=device).repeat_interleave(3).expand(2, -1)
        right = bool(torch.equal(got, want))
    if not _everyone(right, device, group):  # also: no rank gathers again before rank 0 read
        log.warning("tensor parallelism: the peer gather's check failed: the vocabulary "
                    "projection stays whole on rank 0")
        return None
    return gather


def known_shares(rows: int, device: str = "cpu") -> list[torch.Tensor]:
    """create_share's check: a few ids, then `rows` of them (one phase each), ids past 2**16
    among them (an id's int16 halves may read as empty alone)."""
    return [torch.arange(n, dtype=torch.int64, device=device) * 40_503 + n
            for n in (min(3, rows), rows)]


def shares_known(peer: PeerShare, rows: int, device: str) -> bool:
    """create_share's check on one rank: rank 0 sends known_shares, another rank receives them
    and says whether they came, its buffer emptied as it read them."""
    right = True
    for want in known_shares(rows, device):
        if peer.rank == 0:
            peer.send(want)
        else:
            right &= bool(torch.equal(peer.receive(len(want)), want))
    return right and bool((peer.buffers.buffer == EMPTY).all())


def create_share(group, device: str, rows: int, dtype: torch.dtype) -> PeerShare | None:
    """Collective, as create: every rank's buffer for shares of up to `rows` token ids from
    rank 0, checked on two known shares (both phases); None on every rank where any rank
    cannot."""
    rank = dist.get_rank(group)
    buffers = _mapped(group, device, PHASES * 2 * rows, dtype)  # int16 pairs: int32 ids
    if buffers is None:
        return None
    peer = PeerShare(buffers, rank, rows)
    if not _everyone(shares_known(peer, rows, device), device, group):
        log.warning("tensor parallelism: the peer share's check failed: a pipelined step's "
                    "tokens go through the group's broadcast")
        return None
    return peer


def _everyone(ok: bool, device: str, group) -> bool:
    """Whether ok holds on every rank (each rank gets the same answer)."""
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
