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
    chosen = logprobs[token]
    if k:
        top = mx.argpartition(-logprobs, k - 1)[:k]
        values = logprobs[top]
        order = mx.argsort(-values)
        top, values = top[order], values[order]
        mx.eval(chosen, top, values)
        pairs = tuple(zip(top.tolist(), values.tolist()))
    else:
        pairs = ()
    return TokenLogprobs(chosen.item(), pairs)


def make_processor(processing: Processing, prompt_tokens: int) -> Callable:
    """mlx-lm's per-row logits processor for a row's processing (engines/processing.py): called
    with the row's tokens so far (prompt, then completion) and its logits [1, V]."""

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        history = tokens.tolist() if processing.needs_history else []
        prompt, generated = history[:prompt_tokens], history[prompt_tokens:]
        x = logits.astype(mx.float32)
        seen = processing.repeated(prompt, generated)
        if seen:
            ids = mx.array(seen)
            values = x[:, ids]
            penalty = processing.repetition_penalty
            x[:, ids] = mx.where(values > 0, values / penalty, values * penalty)
        added = processing.additions(generated)
        if added:
            x = x.at[:, mx.array(list(added))].add(mx.array(list(added.values()))[None, :])
        if processing.grammar is not None:
            allowed = mx.array(processing.grammar.allowed(generated, x.shape[-1]))
            x = mx.where(allowed[None, :], x, -mx.inf)
        return x

    return process
