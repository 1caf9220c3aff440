"""The rows' processing (engines/processing.py) applied to a step's logits in one pass over the
batch, on the device.

The penalties read each sequence's token counts, which live here, on the device, one slot per
sequence: filled from the row's history when it is first seen, then counted up from each step's
sampled tokens where they are sampled. So a penalised row needs no history from the host and
runs every step of a pipelined executor. Bias and grammar masks are gathered for the whole
batch and sent over in one copy each, not one per row."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..grammar import GilFree, Job, MaskFiller, mask_words
from ..runtime.plan import PENDING, ScheduledSeq
from .transfer import Staging, to_device


@dataclass
class StepProcessing:
    """A step's processing under way (RowProcessor.begin): the processed logits, the
    penalised rows for count(), the grammar rows and, computing their masks, the worker's
    job."""

    x: torch.Tensor
    counted: tuple[torch.Tensor, torch.Tensor] | None
    masked: list[int] = field(default_factory=list)
    masked_index: torch.Tensor | None = None  # masked on the device, when not every row
    masks: Job | None = None


@dataclass
class BatchInputs:
    """A batch's processing inputs on the device (RowProcessor._inputs), for its rows (key:
    their sequence ids in order): the penalised rows (row index, slot) and their settings, the
    bias as (flat index, value), the grammar rows."""

    key: tuple[int, ...]
    masked: list[int]
    masked_index: torch.Tensor | None = None
    counted: tuple[torch.Tensor, torch.Tensor] | None = None
    repetition: torch.Tensor | None = None
    coefficients: torch.Tensor | None = None
    bias: tuple[torch.Tensor, torch.Tensor] | None = None


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
        self._worker = GilFree()  # where begin(overlap=True) computes the masks
        self._kept: BatchInputs | None = None  # the last batch's inputs
        self._bits: torch.Tensor | None = None  # 1 << i for i < 32: a mask word's bits

    def release(self, seq_ids: Sequence[int]) -> None:
        if seq_ids:
            self._kept = None  # a slot it named may be another sequence's from now on
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
        return self.finish(self.begin(logits, rows, in_flight))

    def begin(self, logits: torch.Tensor, rows: Sequence[ScheduledSeq],
              in_flight: Callable[[int], int] | None = None, overlap: bool = False):
        """apply() up to the grammar masks: penalties and bias queued on the device, the
        grammar rows' tokens taken in; with overlap, their masks then computed on the worker
        while the caller goes on (finish() waits for them), else at once."""
        if all(r.sampling.processing is None for r in rows):
            return StepProcessing(logits, None)
        x = logits.to(torch.float32, copy=True)  # one copy, whatever the logits' type
        kept = self._inputs(rows, x.shape[-1])
        if kept.counted is not None:
            self._penalise(x, kept)
        if kept.bias is not None:
            x.view(-1).index_add_(0, *kept.bias)
        masked = kept.masked
        step = StepProcessing(x, kept.counted, masked, kept.masked_index)
        if masked:
            # Written by llguidance straight into the pinned buffer that goes to the device.
            tokens = rows[masked[0]].sampling.processing.grammar.vocab_size
            words = self._staging.borrow((len(masked), mask_words(tokens)), np.int32)
            left = self._masks.take(
                [(rows[i].sampling.processing.grammar, rows[i].history[1],
                  in_flight(rows[i].seq_id) if rows[i].tokens[0] == PENDING else None)
                 for i in masked], words)
            if overlap and left:
                step.masks = self._worker.start(lambda: self._masks.compute(left, words))
            else:
                self._masks.compute(left, words)
        return step

    def finish(self, step: StepProcessing):
        """begin()'s logits with the grammar masks applied, and the penalised rows for
        count()."""
        if not step.masked:
            return step.x, step.counted
        if step.masks is not None:
            step.masks.wait()
        x, masked = step.x, step.masked
        words = self._staging.send()  # int32 [rows, words], token t at bit t % 32
        if self._bits is None:
            self._bits = torch.ones(32, dtype=torch.int32, device=x.device) << torch.arange(
                32, dtype=torch.int32, device=x.device)
        vocab = x.shape[-1]
        refused = torch.bitwise_and(words.unsqueeze(-1), self._bits).view(len(masked), -1)
        refused = refused[:, :vocab] == 0
        if refused.shape[1] < vocab:  # an embedding padded past the tokenizer
            refused = torch.cat([refused, refused.new_ones(len(masked),
                                                           vocab - refused.shape[1])], dim=1)
        if step.masked_index is None:  # every row: no gather and scatter
            x.masked_fill_(refused, float("-inf"))
        else:
            index = step.masked_index
            x[index] = x[index].masked_fill(refused, float("-inf"))
        return x, step.counted

    def close(self) -> None:
        self._worker.close()

    def count(self, counted, tokens: torch.Tensor) -> None:
        """Add the penalised rows' sampled tokens to their counts, on the device."""
        if counted is None:
            return
        index, slots = counted
        # Rows hold distinct slots, so no two additions meet: index_add_ on the flat table,
        # not an accumulating index_put_ (which sorts its indices first).
        where = slots * self.vocab + tokens.index_select(0, index)
        self._counts.view(-1).index_add_(0, where, torch.ones_like(where, dtype=torch.int32))

    def _penalise(self, x: torch.Tensor, kept: BatchInputs) -> None:
        """The repetition penalty on the raw logits, then the presence and frequency
        penalties subtracted (engines/processing.py's order)."""
        index, slots = kept.counted
        counts = self._counts.index_select(0, slots)
        part = x.index_select(0, index)
        if kept.repetition is not None:
            seen = (counts > 0) | self._in_prompt.index_select(0, slots)
            part = torch.where(seen, torch.where(part > 0, part / kept.repetition,
                                                 part * kept.repetition), part)
        coefficients = kept.coefficients
        part = (part - coefficients[:, :1] * (counts > 0)
                - coefficients[:, 1:] * counts.float())
        x.index_copy_(0, index, part)

    def _inputs(self, rows: Sequence[ScheduledSeq], vocab: int) -> BatchInputs:
        """The batch's processing inputs on the device: made when its rows change, and kept
        while the same rows decode (building them from the rows' settings took 0.3-0.5 ms a
        step for 64 rows with logit_bias or penalties, on an H200's host)."""
        key = tuple(r.seq_id for r in rows)
        if self._kept is not None and self._kept.key == key:
            return self._kept
        todo = [i for i, r in enumerate(rows) if r.sampling.processing is not None]
        kept = BatchInputs(key, [i for i in todo
                                 if rows[i].sampling.processing.grammar is not None])
        penalised = [i for i in todo if rows[i].sampling.processing.penalised]
        if penalised:
            slots = [self._slot(rows[i]) for i in penalised]
            kept.counted = (to_device(penalised, torch.long, self.device),
                            to_device(slots, torch.long, self.device))
            settings = [rows[i].sampling.processing for i in penalised]
            if any(s.repetition_penalty != 1.0 for s in settings):
                kept.repetition = to_device([[s.repetition_penalty] for s in settings],
                                            torch.float32, self.device)
            kept.coefficients = to_device([[s.presence_penalty, s.frequency_penalty]
                                           for s in settings], torch.float32, self.device)
        biased = [(i * vocab + token, bias) for i in todo
                  for token, bias in rows[i].sampling.processing.logit_bias if token < vocab]
        if biased:
            where, values = zip(*biased)
            kept.bias = (to_device(where, torch.long, self.device),
                         to_device(values, torch.float32, self.device))
        if kept.masked and len(kept.masked) < len(rows):
            kept.masked_index = to_device(kept.masked, torch.long, self.device)
        self._kept = kept
        return kept

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
