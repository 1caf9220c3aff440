"""Scoring continuations with mlx-lm's model and KV cache, the way the torch engine does: the
prompts' shared prefix once, each prompt's tail once (trimming the cache back to the prefix
after it), then the continuations in batches on a broadcast copy of that prompt's cache, in pieces sized
by a Pacer with the caller's stop flag asked between them.
Right padding needs no mask: under the causal mask only later padding sees it."""

from __future__ import annotations

import time
from collections.abc import Sequence

import mlx.core as mx

from ..base import ContinuationScores, StopCheck, UnsupportedModel, check_stop
from ..classify import Pacer, right_pad, shared_prefix_len


def _log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _batched(cache: list, prompt_len: int, batch: int) -> list:
    from mlx_lm.models.cache import KVCache

    out = []
    for c in cache:
        copy = KVCache()
        k, v = c.keys[..., :prompt_len, :], c.values[..., :prompt_len, :]
        copy.keys = mx.broadcast_to(k, (batch, *k.shape[1:]))
        copy.values = mx.broadcast_to(v, (batch, *v.shape[1:]))
        copy.offset = prompt_len
        out.append(copy)
    return out


def score_continuations(
    model,
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    should_stop: StopCheck | None = None,
) -> ContinuationScores:
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    cache = make_prompt_cache(model)
    if not all(type(c) is KVCache for c in cache):
        raise UnsupportedModel("scoring needs a plain KV cache; this model uses another kind")

    pacer = Pacer()

    def fill(tokens: Sequence[int]) -> None:
        # MLX computes only what is evaluated: the cache, not this forward's logits.
        model(mx.array([list(tokens)]), cache=cache)
        mx.eval([c.state for c in cache])

    def prefill(tokens: Sequence[int]) -> mx.array:
        """Last position's logits, prefilled piece by piece so that a stop is heard soon. The
        last token goes alone: a forward's logits are every position's, and slicing the last
        row out still projects them all onto the vocabulary (as the torch engine's last_only
        does not), most of a long prompt's work on MLX's CPU backend."""
        for a, b in pacer.spans(len(tokens)):
            check_stop(should_stop)
            with pacer.piece(b - a):
                if b < len(tokens):
                    fill(tokens[a:b])
                    continue
                if b - a > 1:
                    fill(tokens[a:b - 1])
                last = model(mx.array([[tokens[b - 1]]]), cache=cache)[0, -1]
                mx.eval(last)
        return last

    score_s = 0.0
    started = time.perf_counter()
    shared = shared_prefix_len(prompts)
    if shared:
        prefill(prompts[0][:shared])
    batch = len(continuations)
    width = max(len(c) for c in continuations) - 1
    inputs = mx.array([right_pad(c[:-1], width) for c in continuations])
    targets = mx.array([right_pad(c[1:], width) for c in continuations])
    firsts = mx.array([c[0] for c in continuations])
    out = []
    for prompt in prompts:
        last = prefill(prompt[shared:])
        scores = _log_softmax(last)[firsts][:, None]
        mx.eval(scores)
        t1 = time.perf_counter()
        if width > 0:
            groups = []
            for r0, r1 in pacer.row_groups(batch, width):
                columns = []
                batched = _batched(cache, len(prompt), r1 - r0)
                for c0, c1 in pacer.spans(width, r1 - r0):
                    check_stop(should_stop)
                    with pacer.piece((r1 - r0) * (c1 - c0)):
                        logits = model(inputs[r0:r1, c0:c1], cache=batched)
                        columns.append(mx.take_along_axis(
                            _log_softmax(logits), targets[r0:r1, c0:c1, None], axis=-1)[..., 0])
                        mx.eval(columns[-1])
                groups.append(mx.concatenate(columns, axis=1))
            scores = mx.concatenate([scores, mx.concatenate(groups)], axis=1)
        values = scores.tolist()
        out.append(tuple(tuple(v[: len(c)]) for v, c in zip(values, continuations)))
        for c in cache:
            c.trim(c.offset - shared)
        score_s += time.perf_counter() - t1
    prefill_s = time.perf_counter() - started - score_s
    return ContinuationScores(tuple(out), prefill_s, score_s)
