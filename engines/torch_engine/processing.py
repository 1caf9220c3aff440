"""The rows' processing (engines/processing.py) applied to a step's logits in one pass over the
batch, on the device.

The penalties read each sequence's token counts, which live here, on the device, one slot per
sequence: filled from the row's history when it is first seen, then counted up from each step's
sampled tokens where they are sampled. So a penalised row needs no history from the host and
runs every step of a pipelined executor. Bias and grammar masks are gathered for the whole
batch and sent over in one copy each, not one per row."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from ..grammar import GrammarState, MaskFiller
from ..runtime.plan import PENDING, ScheduledSeq
from .transfer import Staging, to_device


class MasksAhead:
    """The next step's grammar masks, made on a thread of their own while the host does the
    rest of its step. A pipelined step's grammar rows need the tokens the step before sampled;
    made on the step's thread, their masks (0.8 ms for 64 rows on an H100 host) came after
    those tokens and before the runtime's bookkeeping and the next forward, which the device
    waited for. llguidance's masks release the GIL."""

    def __init__(self, masks: MaskFiller):
        self._masks = masks
        self._worker: ThreadPoolExecutor | None = None
        self._pending: Future | None = None

    def start(self, asked: list[tuple[int, GrammarState, list[int]]],
              tokens: Callable[[], dict[int, int]], vocab: int) -> None:
        """asked: (seq id, state, generated) of a step's grammar rows; tokens(): the step's
        sampled tokens by seq id (it waits for them)."""
        def work() -> dict[int, tuple[list[int], np.ndarray]]:
            got = tokens()
            rows = [(seq_id, state, [*generated, got[seq_id]])
                    for seq_id, state, generated in asked if seq_id in got]
            packed = self._masks.bitmasks([(state, g) for _, state, g in rows], vocab)
            return {seq_id: (g, packed[k]) for k, (seq_id, _, g) in enumerate(rows)}

        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="duet-masks")
        self._pending = self._worker.submit(work)

    def take(self) -> dict[int, tuple[list[int], np.ndarray]]:
        """The masks made ahead: seq id -> (the generated tokens each follows, its packed
        mask). After it, the grammar states are the caller's alone again."""
        pending, self._pending = self._pending, None
        return {} if pending is None else pending.result()


class RowProcessor:
    """Applies the rows' processing; keeps each penalised sequence's token counts."""

    def __init__(self, vocab: int, device: str, masks: MaskFiller | None = None):
        self.vocab, self.device = vocab, device
        self._masks = masks or MaskFiller()
        self._staging = Staging(device)  # the masks' way to the device
        self._ahead = MasksAhead(self._masks)
        # The last apply()'s grammar rows, (seq id, state, generated), for look_ahead().
        self._asked: list[tuple[int, GrammarState, list[int]]] = []
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
        x = logits.float().clone()
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
        ahead = self._ahead.take()  # before any grammar state is touched here
        self._asked = []
        if masked:
            allowed = self._grammar_masks([rows[i] for i in masked], ahead, in_flight, vocab)
            bits = self._staging.to_device(allowed)
            bits = ((bits.unsqueeze(-1) >> torch.arange(8, device=x.device, dtype=torch.uint8))
                    & 1).view(len(masked), -1)[:, :vocab].bool()
            if len(masked) == len(rows):  # every row: no gather and scatter
                x.masked_fill_(~bits, float("-inf"))
            else:
                index = to_device(masked, torch.long, self.device)
                x[index] = x[index].masked_fill(~bits, float("-inf"))
        return x, counted

    def _grammar_masks(self, rows: list[ScheduledSeq], ahead: dict, in_flight,
                       vocab: int) -> np.ndarray:
        """The rows' packed masks: made ahead where they follow what the row has generated
        (with its token in flight), else now."""
        packed: list[np.ndarray | None] = [None] * len(rows)
        asked = []
        for k, row in enumerate(rows):
            made = ahead.get(row.seq_id)
            if made is not None and len(made[0]) == len(row.history[1]) + (
                    row.tokens[0] == PENDING):
                packed[k] = made[1]
                asked.append((row.seq_id, row.sampling.processing.grammar, made[0]))
        now = [k for k in range(len(rows)) if packed[k] is None]
        if now:
            generated = [self._generated(rows[k], in_flight) for k in now]
            states = [rows[k].sampling.processing.grammar for k in now]
            for k, mask in zip(now, self._masks.bitmasks(list(zip(states, generated)), vocab)):
                packed[k] = mask
            asked += [(rows[k].seq_id, state, g) for k, state, g in zip(now, states, generated)]
        self._asked = asked
        return np.stack(packed)

    def look_ahead(self, tokens: Callable[[], dict[int, int]]) -> None:
        """Start the next step's masks of this step's grammar rows, on their own thread, from
        this step's tokens (tokens() waits for them): a pipelined executor calls it once the
        step is queued."""
        if self._asked:
            self._ahead.start(self._asked, tokens, self.vocab)
            self._asked = []

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
        self._counts.index_put_((slots, tokens.index_select(0, index)),
                                torch.ones_like(slots, dtype=torch.int32), accumulate=True)

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
        prompt, generated = row.history
        counts = np.bincount(np.asarray(generated, dtype=np.int64), minlength=self.vocab)
        self._counts[slot] = to_device(counts[: self.vocab], torch.int32, self.device)
        seen = np.zeros(self.vocab, dtype=bool)
        if row.sampling.processing.repetition_penalty != 1.0:
            seen[[t for t in prompt if t < self.vocab]] = True
        self._in_prompt[slot] = to_device(seen, torch.bool, self.device)
        return slot

    def _grow(self) -> None:
        """Twice as many slots (at least 8): a batch's worth is made once, not per request."""
        old = self._counts.shape[0]
        new = max(8, 2 * old)
        self._counts = torch.cat([self._counts, self._counts.new_zeros(new - old, self.vocab)])
        self._in_prompt = torch.cat([self._in_prompt,
                                     self._in_prompt.new_zeros(new - old, self.vocab)])
        self._free.extend(range(new - 1, old - 1, -1))
