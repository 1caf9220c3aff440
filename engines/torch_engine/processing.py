"""The rows' processing (engines/processing.py) applied to a step's logits in one pass over the
batch, on the device.

The penalties read each sequence's token counts, which live here, on the device, one slot per
sequence: filled from the row's history when it is first seen, then counted up from each step's
sampled tokens where they are sampled. So a penalised row needs no history from the host and
runs every step of a pipelined executor. Bias and grammar masks are gathered for the whole
batch and sent over in one copy each, not one per row."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..grammar import MaskFiller
from ..runtime.plan import PENDING, ScheduledSeq
from .transfer import Staging, to_device


class RowProcessor:
    """Applies the rows' processing; keeps each penalised sequence's token counts."""

    def __init__(self, vocab: int, device: str, masks: MaskFiller | None = None):
        self.vocab, self.device = vocab, device
        self._masks = masks or MaskFiller()
        self._staging = Staging(device)  # the masks' way to the device
        self._slots: dict[int, int] = {}  # seq id -> its row of the count tables
        self._free: list[int] = []
        self._counts = torch.zeros(0, vocab, dtype=torch.int32, device=device)  # completion
        self._in_prompt = torch.zeros(0, vocab, dtype=torch.bool, device=device)

    def release(self, seq_ids: Sequence[int]) -> None:
        for seq_id in seq_ids:
            slot = self._slots.pop(seq_id, None)
            if slot is not None:
                self._free.append(slot)

    def apply(self, logits: torch.Tensor, rows: Sequence[ScheduledSeq],
              in_flight: Callable[[int], int] | None = None):
        """The logits [B, V] with each row's processing applied (a float32 copy when any row
        has some, else the logits themselves), and the penalised rows' (row index, slot) for
        count() once their tokens are sampled. in_flight(seq_id): the last token of a row fed
        PENDING (a pipelined step), which its history does not hold yet."""
        todo = [i for i, r in enumerate(rows) if r.sampling.processing is not None]
        if not todo:
            return logits, None
        x = logits.to(torch.float32, copy=True)  # one copy, whatever the logits' type
        vocab = x.shape[-1]
        penalised = [i for i in todo if rows[i].sampling.processing.penalised]
        counted = None
        if penalised:
            slots = [self._slot(rows[i]) for i in penalised]
            counted = (to_device(penalised, torch.long, self.device),
                       to_device(slots, torch.long, self.device))
            self._penalise(x, rows, penalised, *counted)
        biased = [(i * vocab + token, bias) for i in todo
                  for token, bias in rows[i].sampling.processing.logit_bias if token < vocab]
        if biased:
            where, values = zip(*biased)
            x.view(-1).index_add_(0, to_device(where, torch.long, self.device),
                                  to_device(values, torch.float32, self.device))
        masked = [i for i in todo if rows[i].sampling.processing.grammar is not None]
        if masked:
            allowed = self._masks.bitmasks(
                [(rows[i].sampling.processing.grammar, self._generated(rows[i], in_flight))
                 for i in masked], vocab)
            bits = self._staging.to_device(allowed)
            bits = ((bits.unsqueeze(-1) >> torch.arange(8, device=x.device, dtype=torch.uint8))
                    & 1).view(len(masked), -1)[:, :vocab].bool()
            if len(masked) == len(rows):  # every row: no gather and scatter
                x.masked_fill_(~bits, float("-inf"))
            else:
                index = to_device(masked, torch.long, self.device)
                x[index] = x[index].masked_fill(~bits, float("-inf"))
        return x, counted

    @staticmethod
    def _generated(row: ScheduledSeq, in_flight) -> list[int]:
        generated = row.history[1]
        if row.tokens[0] == PENDING:
            generated = [*generated, in_flight(row.seq_id)]
        return generated

    def count(self, counted, tokens: torch.Tensor) -> None:
        """Add the penalised rows' sampled tokens to their counts, on the device."""
        if counted is None:
            return
        index, slots = counted
        # Rows hold distinct slots, so no two additions meet: index_add_ on the flat table,
        # not an accumulating index_put_ (which sorts its indices first).
        where = slots * self.vocab + tokens.index_select(0, index)
        self._counts.view(-1).index_add_(0, where, torch.ones_like(where, dtype=torch.int32))

    def _penalise(self, x: torch.Tensor, rows, penalised: list[int], index: torch.Tensor,
                  slots: torch.Tensor) -> None:
        """The repetition penalty on the raw logits, then the presence and frequency
        penalties subtracted (engines/processing.py's order)."""
        settings = [rows[i].sampling.processing for i in penalised]
        counts = self._counts.index_select(0, slots)
        part = x.index_select(0, index)
        if any(s.repetition_penalty != 1.0 for s in settings):
            penalty = to_device([[s.repetition_penalty] for s in settings], torch.float32,
                                self.device)
            seen = (counts > 0) | self._in_prompt.index_select(0, slots)
            part = torch.where(seen, torch.where(part > 0, part / penalty, part * penalty), part)
        coefficients = to_device([[s.presence_penalty, s.frequency_penalty] for s in settings],
                                 torch.float32, self.device)
        part = (part - coefficients[:, :1] * (counts > 0)
                - coefficients[:, 1:] * counts.float())
        x.index_copy_(0, index, part)

    def _slot(self, row: ScheduledSeq) -> int:
        """The sequence's slot, made from its history the first time it is seen."""
        slot = self._slots.get(row.seq_id)
        if slot is not None:
            return slot
        if not self._free:
            self._grow()
        slot = self._slots[row.seq_id] = self._free.pop()
        # Filled on the device from the token ids: a new request has generated nothing, and
        # two vocabulary-wide rows copied over for each (a pinned allocation each) were a
        # tenth of the engine's host time at 64 penalised streams (py-spy, H200).
        prompt, generated = row.history
        counts, seen = self._counts[slot], self._in_prompt[slot]
        counts.zero_()
        seen.zero_()
        ids = [t for t in generated if t < self.vocab]
        if ids:
            where = to_device(ids, torch.long, self.device)
            counts.index_add_(0, where, torch.ones_like(where, dtype=torch.int32))
        ids = [t for t in prompt if t < self.vocab]
        if ids and row.sampling.processing.repetition_penalty != 1.0:
            seen[to_device(ids, torch.long, self.device)] = True
        return slot

    def _grow(self) -> None:
        """Twice as many slots (at least 8): a batch's worth is made once, not per request."""
        old = self._counts.shape[0]
        new = max(8, 2 * old)
        self._counts = torch.cat([self._counts, self._counts.new_zeros(new - old, self.vocab)])
        self._in_prompt = torch.cat([self._in_prompt,
                                     self._in_prompt.new_zeros(new - old, self.vocab)])
        self._free.extend(range(new - 1, old - 1, -1))
