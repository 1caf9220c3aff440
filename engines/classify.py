"""Zero-shot classification by likelihood, the same on every engine.

Each label is scored as the assistant's whole reply under the model's chat template: the sum
of the log-probabilities of its tokens, the end-of-turn token included (so "positive" must be
the entire answer, not the start of a longer one). Probabilities are a softmax over the
labels' scores. With calibration on (the default) two biases of small models are removed:
the labels are listed in the prompt in the given order and in reverse and each label's score
is averaged over both (position bias), and the labels are also scored for a content-free
input, an empty text, whose prior is divided out (contextual calibration, Zhao et al. 2021,
"Calibrate Before Use"): small models lean towards some labels whatever the text says.

The engine only supplies score_continuations(); prompt building, label tokenisation,
normalisation and timing live here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from .base import (
    ClassificationResult,
    ClassifyParams,
    InputClassification,
    LabelScore,
    RequestStats,
    StopCheck,
    UnsupportedModel,
    check_context,
)

CONTENT_FREE_INPUT = ""
# Chosen on tests/data/sentiment_dev.jsonl among five label-agnostic wordings with calibration
# on (the default model: 16 of 16 there, 46 of 48 on the held-out sentiment.jsonl); the old
# "Classify the text." gave 10 of 16 and put nearly every text in the same label.
DEFAULT_INSTRUCTION = "Read the text and choose the label that describes it best."


def user_message(instruction: str | None, labels: Sequence[str], text: str) -> str:
    return (
        f"{instruction or DEFAULT_INSTRUCTION}\n"
        f"Answer with exactly one of these labels: {', '.join(labels)}.\n\n"
        f"Text: {text}"
    )


def _prompt(engine, instruction: str | None, labels: Sequence[str], text: str) -> list[int]:
    messages = [{"role": "user", "content": user_message(instruction, labels, text)}]
    return engine.tokenizer.apply_chat_template(messages)


def label_continuations(engine, instruction: str | None, labels: Sequence[str]) -> list[list[int]]:
    """Each label's tokens as the template writes an assistant reply, up to and including the
    end-of-turn token. Rendered with the content-free input; what follows the generation
    prompt does not depend on the text being classified."""
    tok = engine.tokenizer
    user = {"role": "user", "content": user_message(instruction, labels, CONTENT_FREE_INPUT)}
    prompt = tok.apply_chat_template([user])
    out = []
    for label in labels:
        full = tok.apply_chat_template(
            [user, {"role": "assistant", "content": label}], add_generation_prompt=False
        )
        if full[: len(prompt)] != prompt:
            # A template that rewrites earlier turns once a reply follows (rare): score the
            # label's own tokens and the end of sequence.
            end = min(tok.eos_token_ids) if tok.eos_token_ids else None
            out.append(tok.encode(label) + ([end] if end is not None else []))
            continue
        reply = full[len(prompt) :]
        cut = next((i for i, t in enumerate(reply) if t in tok.eos_token_ids), len(reply) - 1)
        out.append(reply[: cut + 1])
    if any(not c for c in out):
        raise UnsupportedModel("the chat template renders an empty reply for a label")
    return out


def shared_prefix_len(prompts: Sequence[Sequence[int]]) -> int:
    """Tokens every prompt starts with, leaving each prompt at least one token of its own
    (its last token's logits score the first continuation token). Engines prefill it once."""
    limit = min(len(p) for p in prompts) - 1
    n = 0
    first = prompts[0]
    while n < limit and all(p[n] == first[n] for p in prompts):
        n += 1
    return n


# Scoring is cut into pieces, with the caller's stop flag asked between two of them, each
# sized from the speed of the pieces before it to take about PIECE_SECONDS: on a 2-core CPU
# the torch engine reads about 600 tokens a second of the default model and MLX's CPU backend
# about 8, so one fixed size could not serve both. A stop is heard within about a piece.
PIECE_SECONDS = 0.3
PIECE_TOKENS_FIRST = 4  # before any speed is known: 0.5 s on MLX's CPU backend
PIECE_TOKENS_MAX = 1024


class Pacer:
    """Sizes pieces of scoring work from the speed measured so far to take `seconds` each:
    `first` tokens before any speed is known, never more than `most` (by default this
    module's figures).

    A piece's time is taken as proportional to its tokens until pieces of sizes at least 2x
    apart show a fixed cost besides (a forward of a model split over ranks of a busy CPU waits
    for its sums whatever its size: there, sized in proportion, pieces shrank to one token and
    a classification of six short prompts took 71 s). With a fixed cost a piece is sized to
    take `seconds`, or, where the fixed cost alone takes half of that or more, to spend as
    long on tokens as on the fixed cost. Two sizes are made to be timed: where a piece of
    one token would already take longer than `seconds` and no second size is known, the
    next piece has twice the tokens of the last; and where the larger of two sizes took no
    longer than the smaller, the cost does not grow with the tokens (as far as the clock can
    tell) and the pieces double. Else one-token pieces of a split model never showed their
    fixed cost: 70 s for one input's classification that takes 2 s whole."""

    def __init__(self, first: int | None = None, most: int | None = None,
                 seconds: float | None = None) -> None:
        self.most = PIECE_TOKENS_MAX if most is None else most
        self.size = min(PIECE_TOKENS_FIRST if first is None else first, self.most)
        self.seconds = PIECE_SECONDS if seconds is None else seconds
        self._timed = 0
        # The smallest and the largest piece timed since the first (which warms up): (tokens,
        # seconds), each the latest of its size.
        self._fewest: tuple[int, float] | None = None
        self._most: tuple[int, float] | None = None

    @contextmanager
    def piece(self, tokens: int):
        """Time one piece of `tokens` tokens and size the next from it."""
        started = time.perf_counter()
        yield
        seconds = time.perf_counter() - started
        self._timed += 1
        if seconds > 0:
            self.size = max(1, min(self.most, self._next_size(tokens, seconds)))

    def _next_size(self, tokens: int, seconds: float) -> int:
        proportional = int(self.seconds * tokens / seconds)
        if self._timed < 2:  # the first piece warms up: its time says little
            return proportional
        if self._fewest is None or tokens <= self._fewest[0]:
            self._fewest = (tokens, seconds)
        if self._most is None or tokens >= self._most[0]:
            self._most = (tokens, seconds)
        (few, few_s), (many, many_s) = self._fewest, self._most
        if many < 2 * few:
            # Not even one token fits in a piece's time: a fixed cost, likely; time twice the
            # tokens to see it.
            return proportional if proportional > 0 else 2 * tokens
        slope = (many_s - few_s) / (many - few)
        if slope <= 0:
            return 2 * many
        if slope >= many_s / many:  # no fixed cost to see: proportional
            return proportional
        fixed = many_s - slope * many
        return int(max(self.seconds - fixed, fixed) / slope)

    def spans(self, n: int, weight: int = 1) -> Iterator[tuple[int, int]]:
        """[0, n) as consecutive (start, end) pieces, each as large as the pacer says when it
        is handed out; a step costs `weight` tokens (rows of a batch)."""
        start = 0
        while start < n:
            end = min(n, start + max(1, self.size // weight))
            yield start, end
            start = end

    def row_groups(self, rows: int, width: int) -> Iterator[tuple[int, int]]:
        """A batch of `rows` continuations `width` tokens wide in groups of whole rows (one
        row when a row is more than a piece: then spans() cuts it along its tokens)."""
        return self.spans(rows, max(width, 1))


def right_pad(tokens: Sequence[int], width: int) -> list[int]:
    return list(tokens) + [0] * (width - len(tokens))


def _softmax(scores: Sequence[float]) -> list[float]:
    top = max(scores)
    exps = [math.exp(s - top) for s in scores]
    total = sum(exps)
    return [e / total for e in exps]


def _label_score(logprobs: Sequence[float], scoring: str) -> float:
    total = float(sum(logprobs))
    return total / len(logprobs) if scoring == "mean" else total


def _prefill_tokens(groups: Sequence[Sequence[Sequence[int]]]) -> int:
    """Tokens prefilled when each group is scored in one call: its shared prefix once, then
    every prompt's own tail."""
    total = 0
    for group in groups:
        shared = shared_prefix_len(group)
        total += shared + sum(len(p) - shared for p in group)
    return total


def _prefix_groups(prompts: list[list[int]], listings: int) -> list[list[list[int]]]:
    """The prompts in one call, or in one call per label listing when that prefills less: the
    prompts of a listing also share the label list, which is most of each prompt when the
    labels are many or long, while short labels would not repay the common part twice."""
    per = len(prompts) // listings
    split = [prompts[k * per : (k + 1) * per] for k in range(listings)]
    return split if _prefill_tokens(split) < _prefill_tokens([prompts]) else [prompts]


def zero_shot(
    engine, params: ClassifyParams, should_stop: StopCheck | None = None
) -> ClassificationResult:
    if not params.labels:
        raise ValueError("zero-shot classification needs labels")
    if not engine.tokenizer.has_chat_template:
        raise UnsupportedModel("this model has no chat template, which zero-shot scoring needs")
    start = time.perf_counter()
    engine.meter.reset()
    labels, n = params.labels, len(params.labels)
    texts = list(params.inputs) + ([CONTENT_FREE_INPUT] if params.calibrate else [])
    # Calibrating also lists the labels in reverse: a small model favours whichever label the
    # prompt names first, and averaging over both listings cancels that.
    listings = [labels, labels[::-1]] if params.calibrate and n > 1 else [labels]
    prompts = [_prompt(engine, params.instruction, order, t) for order in listings for t in texts]
    continuations = label_continuations(engine, params.instruction, labels)
    longest = max(len(c) for c in continuations)
    for p in prompts:
        check_context(len(p), longest, engine.context_length)

    peak = 0

    def between_pieces() -> bool:
        # Beside a running batch, the batch's steps run here and reset the engine's meter:
        # the peak so far is kept first.
        nonlocal peak
        engine.meter.sample()
        peak = max(peak, engine.meter.peak_bytes())
        return should_stop is not None and should_stop()

    per_listing = [
        engine.score_continuations(group, continuations, between_pieces)
        for group in _prefix_groups(prompts, len(listings))
    ]
    engine.meter.sample()
    per_prompt = [
        [_label_score(lp, params.label_scoring) for lp in row]
        for scored in per_listing for row in scored.token_logprobs
    ]
    prefill_s = sum(s.prefill_s for s in per_listing)
    score_s = sum(s.score_s for s in per_listing)
    raw = [
        [sum(per_prompt[k * len(texts) + i][j] for k in range(len(listings))) / len(listings)
         for j in range(n)]
        for i in range(len(texts))
    ]
    prior = raw.pop() if params.calibrate else [0.0] * n
    results = []
    for scores in raw:
        # Dividing the probabilities by the content-free ones is subtracting their log-scores;
        # softmax's own normalisers cancel.
        probs = _softmax([s - p for s, p in zip(scores, prior)])
        best = max(range(n), key=probs.__getitem__)
        results.append(InputClassification(
            label=labels[best],
            scores=tuple(LabelScore(l, pr, s) for l, pr, s in zip(labels, probs, scores)),
        ))
    prompt_tokens = sum(len(p) for p in prompts)
    label_tokens = len(prompts) * sum(len(c) for c in continuations)
    total = time.perf_counter() - start
    stats = RequestStats(
        prompt_tokens=prompt_tokens,
        completion_tokens=label_tokens,
        ttft_s=prefill_s,
        prefill_tokens_per_s=prompt_tokens / prefill_s if prefill_s > 0 else 0.0,
        decode_tokens_per_s=label_tokens / score_s if score_s > 0 else 0.0,
        peak_memory_bytes=max(peak, engine.meter.peak_bytes()),
        kv_cache_bytes=0,  # scoring runs on a scratch cache, not the KV pool
        engine=engine.name,
        device=engine.device,
        finish_reason="stop",
        total_s=total,
    )
    return ClassificationResult(tuple(results), stats)
