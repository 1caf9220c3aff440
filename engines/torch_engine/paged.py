"""The torch engine's KV pool and the index tensors a batched step reads it through.

Storage per layer: K and V of shape [slots, kv_heads, head_dim], where slot = block *
block_size + offset (the runtime's BlockPool decides who holds which block), plus one trash
slot at the end that padding writes to and that stands for "no key" when a row is shorter than
the batch's longest. Allocated with torch.empty: a slot is always written before any query can
attend to it, and only the trash slot, which is zeroed, is ever read unwritten (under the mask,
where a garbage NaN would still poison the softmax's weighted sum)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..runtime.plan import ScheduledSeq


class PagedKV:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, n_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str):
        self.block_size = block_size
        self.trash = num_blocks * block_size
        shape = (self.trash + 1, n_kv_heads, head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for t in self.k + self.v:
            t[self.trash].zero_()

    @staticmethod
    def bytes_per_token(num_layers: int, n_kv_heads: int, head_dim: int, dtype) -> int:
        return 2 * num_layers * n_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass
class PagedBatch:
    """One forward's rows: tokens [B, T] at positions [B, T]; their K/V go to write_slots
    [B*T]; queries attend over read_slots [B, L] (key j of row b is its position j) under mask
    [B, 1, T, L], or, when read_slots is None (every row starts at 0), over the new keys
    alone. last [B]: the index in T of each row's last real token."""

    tokens: torch.Tensor
    positions: torch.Tensor
    write_slots: torch.Tensor
    read_slots: torch.Tensor | None
    mask: torch.Tensor | None
    last: torch.Tensor


def build_batch(rows: Sequence[ScheduledSeq], kv: PagedKV, max_len: int, window: int | None,
                device: str) -> PagedBatch:
    bs = kv.block_size
    t = max(len(r.tokens) for r in rows)
    n = len(rows)
    tokens = torch.zeros(n, t, dtype=torch.long)
    lengths = torch.tensor([len(r.tokens) for r in rows])
    starts = torch.tensor([r.start for r in rows])
    for i, r in enumerate(rows):
        tokens[i, : len(r.tokens)] = torch.tensor(r.tokens)
    offs = torch.arange(t)
    positions = starts[:, None] + offs[None, :]  # [B, T]; past a row's end: padding
    real = offs[None, :] < lengths[:, None]
    width = max(len(r.blocks) for r in rows)
    table = torch.zeros(n, width, dtype=torch.long)
    for i, r in enumerate(rows):
        table[i, : len(r.blocks)] = torch.tensor(r.blocks)
    # Padding positions may run past the context: clamp them (their rows are never read).
    positions = positions.clamp(max=max_len - 1)
    slots = table.gather(1, (positions // bs).clamp(max=width - 1)) * bs + positions % bs
    write = torch.where(real, slots, kv.trash).reshape(-1)
    ends = starts + lengths
    fresh = bool((starts == 0).all())
    if fresh:
        read = None
        k_pos = offs
    else:
        k_pos = torch.arange(int(ends.max()))
        read = table.gather(1, (k_pos // bs)[None, :].expand(n, -1).clamp(max=width - 1)) * bs \
            + k_pos % bs
        read = torch.where(k_pos[None, :] < ends[:, None], read, kv.trash)
    mask = k_pos[None, None, :] <= positions[:, :, None]  # [B, T, L]
    if window is not None:
        mask &= k_pos[None, None, :] > positions[:, :, None] - window
    if fresh and n == 1 and window is None:
        mask = None  # plain causal: SDPA's own causal path
    else:
        mask = mask[:, None]
    return PagedBatch(
        tokens=tokens.to(device), positions=positions.to(device), write_slots=write.to(device),
        read_slots=None if read is None else read.to(device),
        mask=None if mask is None else mask.to(device), last=(lengths - 1).to(device),
    )
