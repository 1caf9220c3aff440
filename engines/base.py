"""The engine boundary: plain dataclasses in, a stream of steps out.

Nothing here knows about HTTP; the server turns these objects into OpenAI responses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "cancelled"]


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # Benchmarks force a fixed number of tokens, whatever the model would say.
    ignore_eos: bool = False
    # None: none; k >= 0: each token's log-probability and the k most likely alternatives.
    logprobs: int | None = None
    # The same for the prompt's tokens (completions' echo; lm-eval's loglikelihood).
    prompt_logprobs: int | None = None
    # What reshapes the logits before the draw (engines/processing.py says how and in what
    # order); neutral values leave a request on the engines' fast paths.
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    # An llguidance grammar (engines/grammar.py): the completion is text it accepts.
    grammar: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


# Made once per token per request on the HTTP side too (from the engine process's tuples): slots
# without frozen, as Step. Treated as read-only.
@dataclass(slots=True)
class TokenLogprobs:
    """A token's log-probability under the model (log-softmax of its logits after the request's
    bias, penalties and grammar, before temperature, top-k/top-p or min_p) and the k most
    likely tokens', best first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


# One per token per request: slots without frozen, whose __init__ costs a sixth of a frozen
# one's. Treated as read-only.
@dataclass(slots=True)
class Step:
    """One generated token and the text it made visible (may be empty mid-character)."""

    token_id: int
    text: str
    finish_reason: FinishReason | None = None
    logprobs: TokenLogprobs | None = None  # when the request asked for them
    # On a request's first Step, when it asked for its prompt's: one per prompt token, None for
    # the first (nothing comes before it to score it).
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None


@dataclass(frozen=True)
class RequestStats:
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    peak_memory_bytes: int
    kv_cache_bytes: int
    engine: str
    device: str
    finish_reason: FinishReason
    total_s: float = 0.0
    queue_s: float = 0.0  # arrival to first scheduled step
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


GenerationEvent = Step | RequestStats

LabelScoring = Literal["sum", "mean"]


@dataclass(frozen=True)
class ContinuationScores:
    """Log-probabilities of every continuation's tokens after every prompt:
    token_logprobs[prompt][continuation][token]. Times cover the engine's work only."""

    token_logprobs: tuple[tuple[tuple[float, ...], ...], ...]
    prefill_s: float
    score_s: float


@dataclass(frozen=True)
class ClassifyParams:
    """One classification request. Zero-shot (a generation model) needs labels; a
    sequence-classification checkpoint has its own and takes none."""

    inputs: tuple[str, ...]
    labels: tuple[str, ...] = ()
    instruction: str | None = None
    calibrate: bool = True
    label_scoring: LabelScoring = "sum"


@dataclass(frozen=True)
class LabelScore:
    label: str
    probability: float
    logprob: float  # the label's own score before normalising over the labels


@dataclass(frozen=True)
class InputClassification:
    label: str
    scores: tuple[LabelScore, ...]


@dataclass(frozen=True)
class ClassificationResult:
    results: tuple[InputClassification, ...]
    stats: RequestStats


@dataclass(frozen=True)
class EmbedParams:
    """One embedding request: each input a text, or token ids of a text as the model's
    tokenizer writes it without special tokens (the engine adds those, as it does for text)."""

    inputs: tuple[str | tuple[int, ...], ...]


@dataclass(frozen=True)
class EmbeddingResult:
    """vectors: float32 numpy array [inputs, dimension], in the inputs' order; tokens: how
    many tokens each input was embedded from (after truncation, special tokens included);
    normalized: the vectors have length 1 (the model ends in a Normalize module)."""

    vectors: object
    tokens: tuple[int, ...]
    normalized: bool
    stats: RequestStats


@dataclass(frozen=True)
class EngineInfo:
    engine: str
    device: str
    dtype: str
    context_length: int
    backend_version: str
    extra: dict[str, str] = field(default_factory=dict)
    # The weights' format: "none" (as stored), or what engines/quantization.py describes.
    quantization: str = "none"
    # What it holds in memory (the server's memory budget counts these once it is loaded).
    weights_bytes: int = 0
    kv_cache_bytes: int = 0
    # What a request's peak_memory_bytes counts (its MemoryMeter's measures).
    memory_measure: str = ""
    # The devices its weights and KV cache are spread over (tensor parallelism), evenly: the
    # memory budget, one device's, counts a device's share.
    devices: int = 1


class EngineError(Exception):
    """Base for errors an engine reports to its caller with a meaningful message."""


class EngineClosed(EngineError):
    """The engine was closed (unloaded, the server shutting down) or is gone between the
    request's routing and its start; nothing of the request ran, and a retry is routed anew."""


class DeviceOutOfMemory(EngineError):
    """The device ran out of memory running a step: the requests it carried fail, the others
    go on, and a retry may fit (a 503, not a 500: nothing is wrong with the request)."""


class Cancelled(Exception):
    """Work stopped because its caller asked it to (the client left, or its time ran out).
    Not an EngineError: nothing is wrong with the engine or the request."""


StopCheck = Callable[[], bool]


def check_stop(should_stop: StopCheck | None) -> None:
    """Raise Cancelled between two pieces of work when the caller wants them to stop."""
    if should_stop is not None and should_stop():
        raise Cancelled()


class BackendMissing(EngineError):
    def __init__(self, engine: str, module: str, extra: str):
        super().__init__(
            f"the {engine} engine needs the '{module}' package, which is not installed; "
            f"install it with: pip install 'duet[{extra}]' (or run scripts/setup.sh)"
        )
        self.engine = engine
        self.module = module
        self.extra = extra

    def __reduce__(self):  # pickled across the engine process's pipe: rebuilt from its fields
        return type(self), (self.engine, self.module, self.extra)


class UnsupportedModel(EngineError):
    pass


class ContextLengthExceeded(EngineError):
    def __init__(self, prompt_tokens: int, max_tokens: int, context_length: int):
        super().__init__(
            f"this model's context is {context_length} tokens; the prompt has {prompt_tokens} "
            f"tokens and {max_tokens} more were asked for"
        )
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.context_length = context_length

    def __reduce__(self):
        return type(self), (self.prompt_tokens, self.max_tokens, self.context_length)


def check_context(prompt_tokens: int, max_tokens: int, context_length: int) -> None:
    """The context rule, the one place it is written: the prompt's tokens plus the tokens asked
    for must fit the context (exactly filling it is allowed), else ContextLengthExceeded."""
    if prompt_tokens + max_tokens > context_length:
        raise ContextLengthExceeded(prompt_tokens, max_tokens, context_length)


@runtime_checkable
class Engine(Protocol):
    """What every engine provides. Calls are made from one worker thread at a time."""

    name: str
    info: EngineInfo

    def tokenize(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages: Sequence[dict],
                            tools: Sequence[dict] | None = None) -> list[int]: ...

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        should_stop: Callable[[], bool] | None = None,
    ) -> Iterator[GenerationEvent]: ...

    def logits(self, prompt_ids: Sequence[int]) -> object:
        """Next-token logits for every prompt position, as a float32 numpy array [T, vocab]."""
        ...

    def score_continuations(
        self,
        prompts: Sequence[Sequence[int]],
        continuations: Sequence[Sequence[int]],
        should_stop: StopCheck | None = None,
    ) -> ContinuationScores:
        """Every continuation's token log-probabilities after every prompt. The prompts' shared
        prefix is prefilled once, each prompt once, and its continuations run in batches on
        its KV cache. Between two pieces of work (each well under a second) should_stop is
        asked, and Cancelled raised when it says so."""
        ...

    def classify(
        self, params: ClassifyParams, should_stop: StopCheck | None = None
    ) -> ClassificationResult: ...

    def close(self) -> None: ...


@runtime_checkable
class Embedder(Protocol):
    """What an engine of an embed model provides (engines/embed.py). Calls may come from
    several threads; the engine runs one at a time."""

    name: str
    info: EngineInfo
    dimension: int  # of the vectors
    vocab_size: int  # token ids in [0, vocab_size) are valid inputs
    max_tokens: int  # an input is truncated to this many tokens, special tokens included

    def embed(self, params: EmbedParams, should_stop: StopCheck | None = None
              ) -> EmbeddingResult: ...

    def close(self) -> None: ...
