"""Token sampling on MLX by the torch engine's rule, so one request means the same on both:
temperature first, then top_k, then top_p over what top_k kept.

mlx-lm's make_sampler filters top_p before top_k and on the untempered distribution, which is
a different distribution whenever temperature is not 1 or both filters are set; its filter
functions are reused here in duet's order.

Each sequence's n-th draw uses a key made from its seed and n alone, so a seeded request draws
the same tokens whatever shares its batch (mlx-lm's samplers draw from MLX's global state)."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

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
    counter = [draws]

    def sample(logprobs: mx.array) -> mx.array:
        logits = logprobs * scale
        if 0 < top_k < logits.shape[-1]:
            logits = apply_top_k(logits, top_k)
        if top_p:
            # apply_top_p weighs by the mass left, so what top_k dropped needs no renormalising.
            logits = apply_top_p(logits, top_p)
        key = draw_key(sampling.seed, counter[0])
        counter[0] += 1
        return mx.random.categorical(logits, key=key)

    return sample
