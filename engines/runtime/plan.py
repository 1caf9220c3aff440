"""The contract between the scheduler and an engine's step executor: plain dataclasses.

Each step the scheduler hands the executor a StepPlan: sequences whose prompt (or a chunk of
it) is to be prefilled, sequences that decode one token, and sequences that left since the last
step (their state may be dropped). The executor runs them at once and answers with the token
sampled for every sequence that was due one, and for a row that asked for them, the token's
log-probability and the most likely alternatives."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ..base import SamplingParams, TokenLogprobs
from ..processing import Processing


@dataclass(frozen=True)
class RowSampling:
    """One sequence's sampling settings. `seed` is always set (the runtime draws one when the
    request has none); with `draws` (tokens sampled so far) it fixes the row's next draw,
    whatever else shares the step."""

    temperature: float
    top_k: int
    top_p: float
    seed: int
    # None: no log-probabilities; k >= 0: the sampled token's and the k most likely tokens'.
    logprobs: int | None = None
    min_p: float = 0.0
    # None, or how the row's logits are reshaped from its history before the draw.
    processing: Processing | None = None
    prompt_logprobs: int | None = None  # k: score the prompt's tokens too

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @classmethod
    def of(cls, params: SamplingParams, seed: int,
           processing: Processing | None = None) -> RowSampling:
        return cls(params.temperature, params.top_k, params.top_p, seed, params.logprobs,
                   params.min_p, processing, params.prompt_logprobs)


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
    # A row with processing: its prompt and the tokens sampled so far (the scheduler's own
    # lists, read-only). None for every other row.
    history: tuple[list[int], list[int]] | None = None
    # A prompt chunk to be scored: the token each of its positions predicts (the prompt's next
    # one; the chunk's last position has none at the prompt's end). None for every other row.
    score_next: tuple[int, ...] | None = None

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
    # Only rows whose sampling asked for them: most steps carry none, and build nothing.
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)
    # Scored prompt chunks: seq id -> (the position of the first token scored, the scores).
    prompt_logprobs: dict[int, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # Sequences that joined this step with cached KV (an executor's own prefix cache): seq id ->
    # prompt tokens not prefilled.
    cached_tokens: dict[int, int] = field(default_factory=dict)
    # Tokens of KV the executor's own prefix cache keeps now (None: it keeps none of its own).
    kept_tokens: int | None = None


@dataclass(frozen=True)
class RankStatus:
    """One rank of a tensor-parallel engine (rank 0 is the engine's own process): its process
    and its device memory (allocated now, and the peak since the last request's meter reset),
    as last reported."""

    rank: int
    pid: int
    memory_bytes: int
    peak_memory_bytes: int


@dataclass(frozen=True)
class RuntimeStatus:
    """A runtime as of its last step, the same whether it runs in the server's process or in
    an engine process of its own (which sends one with each batch of events): what /health and
    /metrics show."""

    batch: int = 0  # sequences running
    step_s: float = 0.0  # running mean of a step's wall time
    execute_s: float = 0.0  # running mean of the executor's share of it
    kv_used_blocks: int = 0
    # The runtime's settings and its KV pool's size, which the runtime owns.
    max_batch: int = 0
    kv_blocks: int = 0
    kv_block_size: int = 0
    kv_bytes_per_token: int = 0
    prefix_cache_tokens: int = 0  # tokens of KV kept in the prefix cache (held or evictable)
    prefix_cached_tokens: int = 0  # prompt tokens taken from it instead of prefilled, in all
    ranks: tuple[RankStatus, ...] = ()  # a tensor-parallel engine's ranks, 0 first
    # The engine steps eagerly while its compiled step is made (GenerationEngine.compiled).
    compiling: bool = False
    # Why the compiled step never came, if it failed: the engine steps eagerly on, several
    # times slower, which /health says rather than leave to be guessed from the step time.
    compile_error: str | None = None
    # The garbage collector in the runtime's process since it started (gc_pauses.Pauses): every
    # collection stops the process's Python threads, the step's among them.
    gc_pause_s: float = 0.0  # time spent in collections of every generation
    gc_oldest_collections: int = 0  # collections of the oldest generation, the long ones

    @property
    def kv_tokens(self) -> int:
        return self.kv_blocks * self.kv_block_size

    @property
    def kv_used_tokens(self) -> int:
        return self.kv_used_blocks * self.kv_block_size


@dataclass(frozen=True)
class ExecutorTraits:
    """How an executor runs steps, as far as the runtime must know."""

    # Takes each prompt whole and prefills it on its own terms, answering a sequence's first
    # token a step or more after it joined (mlx-lm's BatchGenerator); it runs its whole batch
    # every step, sequences awaiting a token included. Otherwise prompts come in chunks within
    # the step's budget and every row due a token gets it from that step.
    answers_late: bool = False
    # launch() queues a step on the device and collect() reads it back later, so the runtime
    # plans and launches step N+1 before it handles step N's tokens: the host's work overlaps
    # the device's. Its decode rows may carry PENDING. An executor may turn pipelined once,
    # between two steps (its compiled step arrived); the runtime follows at its next step.
    pipelined: bool = False
    # The runtime delivers the requests' output (text, stop strings, events) on a thread of its
    # own, beside the next step: for an executor whose step is bound by the host and lets go of
    # the GIL while the device works (mlx-cuda).
    output_thread: bool = False
    # Scores a prompt chunk's tokens as it prefills them (rows with score_next); otherwise the
    # runtime scores a prompt that asks with the engine's logits() when it arrives.
    scores_prompts: bool = False
    # Processes a row's logits while its last token is still in flight: it keeps the penalties'
    # token counts itself and takes a grammar's last token from the step that sampled it, so a
    # row with processing need not wait for its last token to be read.
    processes_in_flight: bool = False
    # Its KV lives in the pool's blocks, where the runtime says: a block computed for one
    # sequence serves another whose tokens start the same way (the prefix cache).
    reuses_kv_blocks: bool = False


class StepExecutor(Protocol):
    """Runs steps for one scheduler. An engine makes one per scheduler (the server's loop, a
    one-off generation); they share the engine's weights and KV storage."""

    traits: ExecutorTraits

    def launch(self, plan: StepPlan) -> object:
        """Start the step; its handle goes to collect(). Only a pipelined executor returns
        before the step's tokens exist."""
        ...

    def collect(self, handle: object) -> StepOutput: ...

    def release(self, seq_ids: Sequence[int]) -> None:
        """Drop these sequences' state now (a failed step, or the executor's end)."""
        ...

    def close(self) -> None: ...


def run_step(executor: StepExecutor, plan: StepPlan) -> StepOutput:
    return executor.collect(executor.launch(plan))
