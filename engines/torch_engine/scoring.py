"""Scoring continuations on the eager path: the prompts' shared prefix is prefilled once into
the model's own (batch-1) KV cache, each prompt's tail once after it, and then all
continuations run as one batch on copies of that prompt's cache.

Continuations are right-padded; under the causal mask a padding token is only ever seen by
later padding, and its log-probabilities are dropped, so padding changes nothing."""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import contextmanager

import torch
from torch import nn

from ..base import ContinuationScores
from ..classify import right_pad, shared_prefix_len
from .model import Transformer


class BatchedPrefixCache(nn.Module):
    """A layer's cache for B continuations that share one prompt: the prompt's K/V copied into
    every row, with room for `extra` more positions."""

    def __init__(self, k_prefix: torch.Tensor, v_prefix: torch.Tensor, batch: int, extra: int):
        super().__init__()
        _, heads, n, dim = k_prefix.shape
        self.k = k_prefix.new_empty((batch, heads, n + extra, dim))
        self.v = v_prefix.new_empty((batch, heads, n + extra, dim))
        self.k[:, :, :n] = k_prefix
        self.v[:, :, :n] = v_prefix

    def write_prefix(self, start: int, k: torch.Tensor, v: torch.Tensor):
        end = start + k.shape[2]
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


@contextmanager
def batched_caches(model: Transformer, prompt_len: int, batch: int, extra: int):
    """Swap every layer's cache for a batched copy of its first prompt_len positions."""
    attns = [layer.self_attn for layer in model.model.layers]
    saved = [a.kv_cache for a in attns]
    try:
        for a, c in zip(attns, saved):
            a.kv_cache = BatchedPrefixCache(
                c.k[:, :, :prompt_len], c.v[:, :, :prompt_len], batch, extra
            )
        yield
    finally:
        for a, c in zip(attns, saved):
            a.kv_cache = c


@torch.inference_mode()
def score_continuations(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    device: str,
) -> ContinuationScores:
    def tensor(rows):
        return torch.tensor(rows, dtype=torch.long, device=device)

    score_s = 0.0
    started = time.perf_counter()
    shared = shared_prefix_len(prompts)
    if shared:
        model(tensor([list(prompts[0][:shared])]), 0, last_only=True)
    batch = len(continuations)
    width = max(len(c) for c in continuations) - 1
    # Token j + 1 of a continuation is scored from the logits after token j.
    inputs = tensor([right_pad(c[:-1], width) for c in continuations])
    targets = tensor([right_pad(c[1:], width) for c in continuations])
    firsts = tensor([c[0] for c in continuations])
    out: list[tuple[tuple[float, ...], ...]] = []
    for prompt in prompts:
        last = model(tensor([list(prompt[shared:])]), shared, last_only=True)[0, -1]
        scores = torch.log_softmax(last.float(), dim=-1)[firsts][:, None]  # [B, 1]
        t1 = time.perf_counter()
        if width > 0:
            with batched_caches(model, len(prompt), batch, width):
                logits = model(inputs, len(prompt))
            rest = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None])
            scores = torch.cat([scores, rest[..., 0]], dim=1)
        values = scores.cpu().tolist()
        out.append(tuple(tuple(v[: len(c)]) for v, c in zip(values, continuations)))
        t2 = time.perf_counter()
        score_s += t2 - t1
    prefill_s = time.perf_counter() - started - score_s  # the shared prefix counts too
    return ContinuationScores(tuple(out), prefill_s, score_s)

