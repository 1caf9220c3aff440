"""A decode step's attention over the paged KV pool as one hand-written Triton kernel: each
row's new query and key rotated (RoPE), its new key and value written into the pool, one query
per row attending over that row's pages (split-K, "flash decoding"), and the slices merged.

Why: in the compiled decode step, attention written as PyTorch ops becomes a cuBLAS batched
matmul, a masked-softmax kernel and a second matmul per layer, about 14 us for 1 MB of K/V on
an H200 and a quarter of a llama-3.2-1b step. Here each program reads one slice of one K/V head
once, for all the query heads that share it (GQA). Pages are looked up in each row's block
table inside the kernel: no gather of the pool. The rotation, the pool writes and the merge of
the slices were four more kernels a layer (with the attention's own, 9.7 us a layer of the 8B
shape over two H100s, 2026-11-26), each a launch and a wait of its own in a batch-1 step: now
each program rotates its query heads itself, the program whose slice holds the row's position
writes the new key and value (and uses them from registers), and the last program of a row's
K/V head to finish merges that head's slices (an atomic count a head, left at zero).

The op is registered with torch.library so torch.compile keeps it in the graph as one opaque
call (and the CUDA graph captures its launches). Positions after a row's `pos` (and, with a
sliding window, those at or before `pos - window`) are masked inside the kernel, so no mask
tensor is built. On a machine without Triton the module imports, and `available()` says False.
"""

from __future__ import annotations

import os

import torch

from ..device import cuda_capability

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch ship without Triton
    triton = None
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # no Triton, or one without programmatic dependent launch
    gdc_wait = None


def available() -> bool:
    return triton is not None


def dependent_launch_wanted() -> bool:
    """The switch for programmatic dependent launch, duet's kernels' and Inductor's alike:
    DUET_PDL=1 (opt-in; dependent_launch says why)."""
    return os.environ.get("DUET_PDL") == "1"


def dependent_launch(device: torch.device) -> bool:
    """Whether duet's kernels on `device` launch as programmatic dependents of the kernel
    before them: when wanted (DUET_PDL=1), on Hopper and later.

    Why: a batch-1 decode step is some 14 kernels a layer, and each waited for the one before
    it to end before its programs were even placed. Launched as a dependent, a kernel's programs
    start while the kernel before finishes and wait (griddepcontrol.wait) only where they read
    its output. The step's Inductor kernels do the same (configure_inductor). Measured on an
    H100 over 32 split 8B layers of Inductor kernels (fixed tilings, CUDA graph): 3,292 -> 3,110
    us a stack; whole layers 5,652 -> 5,439; through the server the 8B split step took 3.31 ms
    with it against 3.39 without on another machine of the kind (docs/benchmarks.md). Opt-in
    until a split model's tokens are checked against one GPU's with it
    (scripts/check_tensor_parallel.py): every kernel waits before it reads, which Inductor's
    kernels after an opaque op do too, but that check has not run yet."""
    return (gdc_wait is not None and device.type == "cuda" and dependent_launch_wanted()
            and cuda_capability(device.index or 0)[0] >= 9)


# Each program covers SPLIT_LEN positions of one row and one K/V head in a single round of
# loads (measured on an H200 for llama-3.2-1b, batch 1: 2.8 us a layer, against 3.6 with 128
# positions a program); the pages they sit in are looked up per position.
SPLIT_LEN = 64

if triton is not None:

    @triton.jit
    def follow(PDL: tl.constexpr):
        """A kernel's first step when launched as a programmatic dependent (PDL): wait until
        the kernel before it has ended and its writes show, then let the kernel after it be
        placed (it waits the same way). A kernel lets its dependents go only after its own
        wait, so every kernel before the one before has ended whenever a kernel starts: a
        kernel that reads only older outputs (Inductor's skip their wait) reads them whole."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def _rotated(X, C, S, dims, partner, sign, mask):
        """RoPE of the rows at X (+ dims) in float32: x * cos + rotate_half(x) * sin, where
        rotate_half(x) is (-x2, x1) of x's halves (model.apply_rope)."""
        x = tl.load(X + dims, mask=mask, other=0.0).to(tl.float32)
        xp = tl.load(X + partner, mask=mask, other=0.0).to(tl.float32)
        return x * C + sign * xp * S

    # Triton compiles a kernel anew for every change in its ints' value class (1, a multiple
    # of 16, other) and its pointers' 16-byte alignment. The rows' positions, write slots and
    # block table come as views of one copied tensor in an eager step (their offsets, strides
    # and the step's length vary with its rows) and as columns of the graphs' input buffer in a
    # captured one: each new combination was a compile of ~0.3-0.8 s in the serving thread on
    # a cold start (a stream paused 0.8 s, H100, 2026-11-27). Not specialized on them, the
    # kernel is compiled once an attention bucket (its N_SPLITS), all of them before serving
    # (cuda_graphs.GraphDecoder.compile_kernels). Nothing here is faster for knowing them: a
    # row's position and slot are single loads, its table a gather, kv_len a bound.
    @triton.jit(do_not_specialize=["stride_tb", "stride_pos", "stride_slot", "kv_len"],
                do_not_specialize_on_alignment=["Table", "Pos", "Slots"])
    def _attention_kernel(
        QKV, Cos, Sin, K, V, Table, Pos, Slots, Acc, M, L, Out, Counters,
        stride_qkv, stride_cos, stride_ks, stride_kh, stride_vs, stride_vh, stride_tb,
        stride_pos, stride_slot, kv_len, window, scale,
        N_HEADS: tl.constexpr, N_KV: tl.constexpr, REP: tl.constexpr, REP_PAD: tl.constexpr,
        D: tl.constexpr, PAGE: tl.constexpr, SPLIT_LEN: tl.constexpr, N_SPLITS: tl.constexpr,
        PRECISION: tl.constexpr, PDL: tl.constexpr,
    ):
        follow(PDL)
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        pos = tl.load(Pos + row * stride_pos)
        rows = tl.arange(0, REP_PAD)
        dims = tl.arange(0, D)
        partner = (dims + D // 2) % D
        sign = tl.where(dims < D // 2, -1.0, 1.0)
        c = tl.load(Cos + row * stride_cos + dims).to(tl.float32)
        s_ = tl.load(Sin + row * stride_cos + dims).to(tl.float32)
        keep = rows < REP
        head = kvh * REP + rows
        qkv = QKV + row * stride_qkv
        # Rounded to the activations' dtype where the unfused step stored them.
        q = _rotated(qkv + head[:, None] * D, c[None, :], s_[None, :], dims[None, :],
                     partner[None, :], sign[None, :], keep[:, None]).to(QKV.dtype.element_ty)
        k_new = _rotated(qkv + (N_HEADS + kvh) * D, c, s_, dims, partner, sign,
                         dims < D).to(K.dtype.element_ty)
        v_new = tl.load(qkv + (N_HEADS + N_KV + kvh) * D + dims).to(V.dtype.element_ty)
        if split == pos // SPLIT_LEN:  # the one program whose slice holds pos keeps the row's K/V
            slot = tl.load(Slots + row * stride_slot)
            tl.store(K + slot * stride_ks + kvh * stride_kh + dims, k_new)
            tl.store(V + slot * stride_vs + kvh * stride_vh + dims, v_new)
        offs = split * SPLIT_LEN + tl.arange(0, SPLIT_LEN)
        # Positions after pos are masked, and masked lanes read no memory: a slice wholly
        # after pos keeps m = -inf and l = 0, and the merge gives it no weight.
        valid = (offs <= pos) & (offs < kv_len)
        if window > 0:
            valid = valid & (offs > pos - window)
        # Each earlier position's slot in the pool: its block from the row's block table; pos
        # itself comes from registers (its write above need not be visible to this program).
        old = valid & (offs != pos)
        page = tl.load(Table + row * stride_tb + offs // PAGE, mask=old, other=0)
        slots = page * PAGE + offs % PAGE
        is_new = (offs == pos)[:, None]
        k = tl.load(K + slots[:, None] * stride_ks + kvh * stride_kh + dims[None, :],
                    mask=old[:, None], other=0.0)
        k = tl.where(is_new, k_new[None, :], k)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_i = tl.max(s, axis=1)
        # A slice with nothing valid has m = -inf: subtract 0 instead (no NaN).
        m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
        p = tl.exp(s - m_safe[:, None])
        l_i = tl.sum(p, axis=1)
        v = tl.load(V + slots[:, None] * stride_vs + kvh * stride_vh + dims[None, :],
                    mask=old[:, None], other=0.0)
        v = tl.where(is_new, v_new[None, :], v)
        acc = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        out = Out + (row * N_HEADS + head[:, None]) * D + dims[None, :]
        if N_SPLITS == 1:  # the slice holds pos, so l > 0
            l_i = tl.where(keep, l_i, 1.0)  # the padding heads': 0
            tl.store(out, (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=keep[:, None])
        else:
            part = (row * N_HEADS + head) * N_SPLITS + split
            tl.store(M + part, m_i, mask=keep)
            tl.store(L + part, l_i, mask=keep)
            tl.store(Acc + part[:, None] * D + dims[None, :], acc, mask=keep[:, None])
            # Every thread's stores before the count (CUTLASS's semaphore: a barrier, then one
            # release at GPU scope); the program that counts last sees every slice's.
            tl.debug_barrier()
            counter = Counters + row * N_KV + kvh
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == N_SPLITS - 1:
                m_run = tl.full([REP_PAD], float("-inf"), tl.float32)
                l_run = tl.zeros([REP_PAD], tl.float32)
                acc_run = tl.zeros([REP_PAD, D], tl.float32)
                first = (row * N_HEADS + head) * N_SPLITS
                for j in range(N_SPLITS):
                    # Past L1 (.cg): the other programs' slices were written on other SMs.
                    m_j = tl.load(M + first + j, mask=keep, other=float("-inf"),
                                  cache_modifier=".cg")
                    l_j = tl.load(L + first + j, mask=keep, other=0.0, cache_modifier=".cg")
                    acc_j = tl.load(Acc + (first + j)[:, None] * D + dims[None, :],
                                    mask=keep[:, None], other=0.0, cache_modifier=".cg")
                    m_new = tl.maximum(m_run, m_j)
                    m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
                    old_w = tl.where(m_run == float("-inf"), 0.0, tl.exp(m_run - m_base))
                    new_w = tl.where(m_j == float("-inf"), 0.0, tl.exp(m_j - m_base))
                    l_run = l_run * old_w + l_j * new_w
                    acc_run = acc_run * old_w[:, None] + acc_j * new_w[:, None]
                    m_run = m_new
                l_run = tl.where(keep, l_run, 1.0)
                tl.store(out, (acc_run / l_run[:, None]).to(Out.dtype.element_ty),
                         mask=keep[:, None])
                tl.store(counter, 0)  # for the next call; kernels on one stream never overlap


def _pad(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


@torch.library.custom_op("duet::paged_decode_attention",
                         mutates_args=("k_pool", "v_pool", "counters"))
def paged_decode_attention(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor,
    v_pool: torch.Tensor, table: torch.Tensor, pos: torch.Tensor, write_slots: torch.Tensor,
    counters: torch.Tensor, kv_len: int, page: int, window: int,
) -> torch.Tensor:
    """One decode token per row: its query attends over the row's pages of the pool, after
    its key and value are written there.

    qkv [B, (H + 2 KV) x D]: the rows' fused projection before RoPE (query heads, key heads,
    value heads); cos, sin [B, D]: the rotary tables at each row's position; k_pool, v_pool
    [slots, KV, D] (slot = page id * page + offset); table [B, pages] (each row's page ids in
    order); pos [B] (each row's position: it attends to 0..pos); write_slots [B] (where pos's
    K/V go); counters: int32 zeros, B x KV of them at least, left at zero. table, pos and
    write_slots may be strided views (the CUDA graphs' input buffer). Positions at or past
    kv_len are not read. Returns [B, H, D] in qkv's dtype."""
    b = qkv.shape[0]
    _, n_kv, d = k_pool.shape
    n_heads = qkv.shape[1] // d - 2 * n_kv
    if qkv.stride(1) != 1 or cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError("qkv, cos and sin must be row-major")
    if counters.numel() < b * n_kv:
        raise ValueError(f"{b} rows need {b * n_kv} counters, not {counters.numel()}")
    rep = n_heads // n_kv
    n_splits = triton.cdiv(kv_len, SPLIT_LEN)
    out = torch.empty(b, n_heads, d, dtype=qkv.dtype, device=qkv.device)
    parts = max(n_splits, 2)  # unused by one slice; never a zero-sized buffer
    acc = torch.empty(b * n_heads, parts, d, dtype=torch.float32, device=qkv.device)
    m = torch.empty(b * n_heads, parts, dtype=torch.float32, device=qkv.device)
    l = torch.empty_like(m)
    pdl = dependent_launch(qkv.device)
    _attention_kernel[(b, n_kv, n_splits)](
        qkv, cos, sin, k_pool, v_pool, table, pos, write_slots, acc, m, l, out, counters,
        qkv.stride(0), cos.stride(0), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0),
        v_pool.stride(1), table.stride(0), pos.stride(0), write_slots.stride(0),
        kv_len, window, d ** -0.5,
        N_HEADS=n_heads, N_KV=n_kv, REP=rep, REP_PAD=_pad(rep), D=d, PAGE=page,
        SPLIT_LEN=SPLIT_LEN, N_SPLITS=n_splits,
        # float32 stays float32 (Triton's default would round it to TF32); half types ignore it.
        PRECISION="ieee" if qkv.dtype == torch.float32 else "tf32", PDL=pdl, launch_pdl=pdl,
    )
    return out


@paged_decode_attention.register_fake
def _(qkv, cos, sin, k_pool, v_pool, table, pos, write_slots, counters, kv_len, page, window):
    _, n_kv, d = k_pool.shape
    return qkv.new_empty(qkv.shape[0], qkv.shape[1] // d - 2 * n_kv, d)
