"""Token sampling on MLX by the torch engine's rule, so one request means the same on both:
temperature first, then top_k, then top_p over what top_k kept.

min_p (after temperature, before top_k) drops what is less likely than min_p times the likeliest.
mlx-lm's make_sampler filters top_p before top_k and on the untempered distribution, which is
a different distribution whenever temperature is not 1 or both filters are set; its filter
functions are reused here in duet's order.

Each sequence's n-th draw uses a key made from its seed and n alone, so a seeded request draws
the same tokens whatever shares its batch (mlx-lm's samplers draw from MLX's global state)."""

from __future__ import annotations

import math
from collections.abc import Callable

import mlx.core as mx

from ..base import TokenLogprobs
from ..processing import Processing
from ..runtime.plan import RowSampling

_M64 = (1 << 64) - 1


def draw_key(seed: int, draw: int) -> mx.array:
    # Distinct (seed, draw) pairs give distinct key seeds; MLX's key derivation mixes them.
    return mx.random.key(((seed & _M64) * 0x9E3779B97F4A7C15 + draw) & _M64)


def make_sampler(sampling: RowSampling, draws: int = 0) -> Callable[[mx.array], mx.array]:
    """Map log-probabilities [..., V] to token ids [...], one row's draws numbered from
    `draws`. A k at or above V keeps every token, as on the torch engine."""
    from mlx_lm.sample_utils import apply_top_k, apply_top_p

    if sampling.greedy:
        return lambda logprobs: mx.argmax(logprobs, axis=-1)
    scale = 1.0 / sampling.temperature
    top_k = sampling.top_k
    top_p = sampling.top_p if sampling.top_p < 1.0 else 0.0
    floor = math.log(sampling.min_p) if sampling.min_p > 0.0 else None
    counter = [draws]

    def sample(logprobs: mx.array) -> mx.array:
        logits = logprobs * scale
        if floor is not None:
            least = mx.max(logits, axis=-1, keepdims=True) + floor
            logits = mx.where(logits < least, -mx.inf, logits)
        if 0 < top_k < logits.shape[-1]:
            logits = apply_top_k(logits, top_k)
        if top_p:
            # apply_top_p weighs by the mass left, so what top_k dropped needs no renormalising.
            logits = apply_top_p(logits, top_p)
        key = draw_key(sampling.seed, counter[0])
        counter[0] += 1
        return mx.random.categorical(logits, key=key)

    return sample


def token_logprobs(logprobs: mx.array, token: int, k: int) -> TokenLogprobs:
    """The generator's log-softmax row [V] (the model's distribution, before the sampler's
    temperature and filters) at the sampled token, and its k most likely tokens."""
    return top_logprobs(logprobs[None], [token], k)[0]


def rows_logprobs(rows: list[tuple[mx.array, int, int]]) -> list[TokenLogprobs]:
    """token_logprobs of many rows at once, (log-softmax row [V], sampled token, k) each: one
    top-k over the stacked rows and one read-back for all, where a row at a time waited for
    the device once a row (64 rows of a step on an H100: 64 round trips)."""
    if not rows:
        return []
    scored = top_logprobs(mx.stack([row for row, _, _ in rows]), [t for _, t, _ in rows],
                          max(k for _, _, k in rows))
    return [TokenLogprobs(s.logprob, s.top[:k]) for s, (_, _, k) in zip(scored, rows)]


def top_logprobs(lp: mx.array, tokens: list[int], k: int) -> list[TokenLogprobs]:
    """Rows of log-probabilities [n, V]: each row's value at its token and its k likeliest
    tokens, best first, read back once."""
    chosen = mx.take_along_axis(lp, mx.array([[t] for t in tokens]), axis=-1)[:, 0]
    if not k:
        return [TokenLogprobs(c, ()) for c in chosen.tolist()]
    top = mx.argpartition(-lp, k - 1, axis=-1)[:, :k]
    values = mx.take_along_axis(lp, top, axis=-1)
    order = mx.argsort(-values, axis=-1)
    top, values = mx.take_along_axis(top, order, axis=-1), mx.take_along_axis(values, order, axis=-1)
    mx.eval(chosen, top, values)
    return [TokenLogprobs(c, tuple(zip(t, v)))
            for c, t, v in zip(chosen.tolist(), top.tolist(), values.tolist())]


def make_processor(processing: Processing, prompt_tokens: int) -> Callable:
    """mlx-lm's per-row logits processor for a row's processing (engines/processing.py): called
    with the row's tokens so far (prompt, then completion; one more each step) and its logits
    [1, V]. Its state follows the row on the device: which tokens the repetition penalty
    touches and how often each completion token came, updated with each step's new tokens
    only, and the bias as one vector. Nothing is read back to the host for the penalties (a
    grammar reads the new tokens), so a step's cost does not grow with the row's length and
    the generator's next step is queued before this one's tokens are known."""
    return _RowProcessor(processing, prompt_tokens)


class _RowProcessor:
    def __init__(self, processing: Processing, prompt_tokens: int):
        self.processing = processing
        self.prompt_tokens = prompt_tokens
        self.consumed = 0  # tokens of the row's context already counted
        self.generated: list[int] = []  # the completion so far, for a grammar only
        self.seen: mx.array | None = None  # [V] 1 where the repetition penalty applies
        self.counts: mx.array | None = None  # [V] how often each completion token came
        self.bias: mx.array | None = None  # [V] logit_bias
        self.ready = False  # the vectors are made on the first call, which knows V

    def _vectors(self, vocab: int) -> None:
        p = self.processing
        if p.repetition_penalty != 1.0:
            self.seen = mx.zeros((vocab,), dtype=mx.uint8)
        if p.presence_penalty or p.frequency_penalty:
            self.counts = mx.zeros((vocab,), dtype=mx.int32)
        if p.logit_bias:
            bias = [0.0] * vocab
            for token, value in p.logit_bias:
                if 0 <= token < vocab:
                    bias[token] += value
            self.bias = mx.array(bias, dtype=mx.float32)

    def _take(self, tokens: mx.array) -> None:
        """Count the tokens the context gained since the last call."""
        end = tokens.shape[-1]
        if end <= self.consumed:
            return
        new = tokens.reshape(-1)[self.consumed:end]
        first_generated = max(0, self.prompt_tokens - self.consumed)
        if self.seen is not None:
            self.seen = self.seen.at[new].maximum(mx.array(1, dtype=mx.uint8))
        if first_generated < new.size:
            completion = new[first_generated:]
            if self.counts is not None:
                self.counts = self.counts.at[completion].add(1)
            if self.processing.grammar is not None:
                self.generated.extend(completion.tolist())
        self.consumed = end

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        p = self.processing
        x = logits.astype(mx.float32)
        vocab = x.shape[-1]
        if not self.ready:
            self._vectors(vocab)
            self.ready = True
        if p.needs_history:
            self._take(tokens)
        if self.seen is not None:
            penalty = p.repetition_penalty
            x = mx.where(self.seen > 0, mx.where(x > 0, x / penalty, x * penalty), x)
        if self.bias is not None:
            x = x + self.bias
        if self.counts is not None:
            counts = self.counts.astype(mx.float32)
            x = x - (p.presence_penalty * (counts > 0) + p.frequency_penalty * counts)
        if p.grammar is not None:
            allowed = mx.array(p.grammar.allowed(self.generated, vocab))
            x = mx.where(allowed[None, :], x, -mx.inf)
        return x
