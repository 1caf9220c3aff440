"""Token sampling on MLX by the torch engine's rule, so one request means the same on both:
temperature first, then top_k, then top_p over what top_k kept.

mlx-lm's make_sampler filters top_p before top_k and on the untempered distribution, which is
a different distribution whenever temperature is not 1 or both filters are set; its filter
functions are reused here in duet's order."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from ..base import SamplingParams


def make_sampler(params: SamplingParams) -> Callable[[mx.array], mx.array]:
    """Map log-probabilities [..., V] to token ids [...]. A k at or above V keeps every
    token, as on the torch engine."""
    from mlx_lm.sample_utils import apply_top_k, apply_top_p

    if params.greedy:
        return lambda logprobs: mx.argmax(logprobs, axis=-1)
    scale = 1.0 / params.temperature
    top_k = params.top_k
    top_p = params.top_p if params.top_p < 1.0 else 0.0

    def sample(logprobs: mx.array) -> mx.array:
        logits = logprobs * scale
        if 0 < top_k < logits.shape[-1]:
            logits = apply_top_k(logits, top_k)
        if top_p:
            # apply_top_p weighs by the mass left, so what top_k dropped needs no renormalising.
            logits = apply_top_p(logits, top_p)
        return mx.random.categorical(logits)

    return sample
