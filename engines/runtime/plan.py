"""The contract between the scheduler and an engine's step executor: plain dataclasses.

Each step the scheduler hands the executor a StepPlan: sequences whose prompt (or a chunk of
it) is to be prefilled, sequences that decode one token, and sequences that left since the last
step (their state may be dropped). The executor runs them at once and answers with the token
sampled for every sequence that was due one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..base import SamplingParams


@dataclass(frozen=True)
class RowSampling:
    """One sequence's sampling settings. `seed` is always set (the runtime draws one when the
    request has none); with `draws` (tokens sampled so far) it fixes the row's next draw,
    whatever else shares the step."""

    temperature: float
    top_k: int
    top_p: float
    seed: int

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @classmethod
    def of(cls, params: SamplingParams, seed: int) -> RowSampling:
        return cls(params.temperature, params.top_k, params.top_p, seed)


# A decode row's token when the step that sampled it has not been read back yet (a pipelined
# executor): the executor feeds the token it sampled for this sequence last step.
PENDING = -1


# Built for every row of every step: slots without frozen, whose __init__ costs a sixth of a
# frozen one's (1 us a row in Python 3.11). Executors treat rows as read-only.
@dataclass(slots=True)
class ScheduledSeq:
    seq_id: int
    tokens: tuple[int, ...]  # the tokens this step feeds: a prompt chunk, or the last sampled
    start: int  # the position of tokens[0]
    blocks: tuple[int, ...]  # the sequence's KV blocks in order, covering start + len(tokens)
    sample: bool  # whether a token is due after these (the prompt's last chunk, a decode)
    sampling: RowSampling
    draws: int  # tokens sampled for this sequence so far

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass(frozen=True)
class StepPlan:
    prefill: tuple[ScheduledSeq, ...] = ()
    decode: tuple[ScheduledSeq, ...] = ()
    released: tuple[int, ...] = ()  # sequences gone since the last step

    @property
    def rows(self) -> tuple[ScheduledSeq, ...]:
        return self.prefill + self.decode

    def __bool__(self) -> bool:
        return bool(self.prefill or self.decode or self.released)


@dataclass(frozen=True)
class StepOutput:
    tokens: dict[int, int]  # seq id -> the token sampled for it this step


class StepExecutor(Protocol):
    """Runs steps for one scheduler. An engine makes one per scheduler (the server's loop, a
    one-off generation); they share the engine's weights and KV storage."""

    # Whether a prompt may be fed in several steps. An executor that prefills on its own terms
    # (mlx-lm's BatchGenerator) takes each prompt whole and may answer a few steps later.
    chunked_prefill: bool

    def step(self, plan: StepPlan) -> StepOutput: ...

    # A pipelined executor launches a step and reads it back later (launch(), collect()), so
    # the runtime plans and launches step N+1 before it handles step N's tokens: the host's
    # work overlaps the device's. Its decode rows may carry PENDING.
    pipelined: bool

    # Whether the runtime delivers the requests' output (text, stop strings, events) on a
    # thread of its own, beside the next step (optional; False when absent).
    threaded_output: bool

    def release(self, seq_ids: Sequence[int]) -> None:
        """Drop these sequences' state now (a failed step, or the executor's end)."""
        ...
