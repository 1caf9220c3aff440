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

import numpy as np
import torch

from ..runtime.plan import ScheduledSeq
from .transfer import to_device


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

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int, dtype: torch.dtype,
                  device: str) -> PagedKV:
        """The pool for the KV heads model holds (a tensor-parallel rank's share of them)."""
        attn = model.model.layers[0].self_attn
        return cls(model.args.num_layers, num_blocks, block_size, attn.n_kv, attn.head_dim,
                   dtype, device)

    @classmethod
    def model_bytes_per_token(cls, model, dtype: torch.dtype) -> int:
        attn = model.model.layers[0].self_attn
        return cls.bytes_per_token(model.args.num_layers, attn.n_kv, attn.head_dim, dtype)


@dataclass
class PagedBatch:
    """One forward's rows: tokens [B, T] at positions [B, T] (a row's padding continues its
    positions); their K/V go to write_slots [B*T]; last [B] is the index in T of each row's
    last real token. Queries attend to the keys at positions below kv_len that they may see:
    each row's pages are table [B, pages], or, when table is None (every row a prompt from
    position 0), the new keys alone.

    The read slots and the mask are derived on the device (attend()), so a CUDA graph can
    capture them; the CUDA kernel reads the table itself and needs neither."""

    tokens: torch.Tensor
    positions: torch.Tensor
    write_slots: torch.Tensor
    last: torch.Tensor
    table: torch.Tensor | None
    kv_len: int
    page: int
    trash: int
    window: int | None
    # The decode kernel's merge counters for these rows, where the step brings its own: the
    # graphs captured while eager steps run (cuda_graphs.GraphDecoder.warm_up_beside) must not
    # share the layers' with them. None: the layers'.
    counters: torch.Tensor | None = None

    def attend(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(read_slots [B, kv_len] or None, mask [B, 1, T, kv_len] or None for plain causal)."""
        b = self.tokens.shape[0]
        device = self.tokens.device
        k_pos = torch.arange(self.kv_len, device=device)
        mask = k_pos[None, None, :] <= self.positions[:, :, None]
        if self.window is not None:
            mask &= k_pos[None, None, :] > self.positions[:, :, None] - self.window
        if self.table is None:
            return None, (None if b == 1 and self.window is None else mask[:, None])
        read = self.table.gather(1, (k_pos // self.page)[None, :].expand(b, -1)) * self.page \
            + k_pos % self.page
        # Past a row's last position nothing was written: read the zeroed trash slot there (a
        # masked key still multiplies its value by zero, and garbage may be NaN).
        ends = self.positions.gather(1, self.last[:, None]) + 1
        read = torch.where(k_pos[None, :] < ends, read, self.trash)
        return read, mask[:, None]


def padded(lists: Sequence[Sequence[int]], width: int) -> torch.Tensor:
    """Rows of ints right-padded with zeros to width, int64 [rows, width]: filled in numpy (a
    tensor made per row cost a 64-row step 0.6 ms of host time on a CPU)."""
    out = np.zeros((len(lists), width), dtype=np.int64)
    for i, values in enumerate(lists):
        out[i, : len(values)] = values
    return torch.from_numpy(out)


def block_table(rows: Sequence[ScheduledSeq], width: int | None = None) -> torch.Tensor:
    return padded([r.blocks for r in rows], width or max(len(r.blocks) for r in rows))


def build_batch(rows: Sequence[ScheduledSeq], kv: PagedKV, max_len: int, window: int | None,
                device: str) -> PagedBatch:
    bs = kv.block_size
    t = max(len(r.tokens) for r in rows)
    tokens = padded([r.tokens for r in rows], t)
    lengths = torch.tensor([len(r.tokens) for r in rows])
    starts = torch.tensor([r.start for r in rows])
    offs = torch.arange(t)
    # Padding positions may run past the context: clamp them (their rows are never read).
    positions = (starts[:, None] + offs[None, :]).clamp(max=max_len - 1)
    real = offs[None, :] < lengths[:, None]
    table = block_table(rows)
    slots = table.gather(1, (positions // bs).clamp(max=table.shape[1] - 1)) * bs + positions % bs
    write = torch.where(real, slots, kv.trash).reshape(-1)
    fresh = bool((starts == 0).all())

    # One copy to the device for all of them (each copy from pinned memory allocates its own:
    # four or five a prefill chunk), not waiting for the steps queued before.
    parts = [tokens, positions, write, lengths - 1] + ([] if fresh else [table])
    flat = to_device(torch.cat([x.reshape(-1) for x in parts]), torch.long, device)
    moved = [m.view(x.shape) for m, x in zip(flat.split([x.numel() for x in parts]), parts)]
    return PagedBatch(
        tokens=moved[0], positions=moved[1], write_slots=moved[2], last=moved[3],
        table=None if fresh else moved[4],
        kv_len=t if fresh else int((starts + lengths).max()), page=bs, trash=kv.trash,
        window=window,
    )
