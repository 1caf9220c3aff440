"""Scoring continuations on the eager path: the prompts' shared prefix is prefilled once into
the model's own (batch-1) KV cache, each prompt's tail once after it, and then all
continuations run in batches on copies of that prompt's cache. Work is cut into pieces sized
by a Pacer, with the caller's stop flag asked between them.

Continuations are right-padded; under the causal mask a padding token is only ever seen by
later padding, and its log-probabilities are dropped, so padding changes nothing."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ..base import ContinuationScores, StopCheck, check_stop
from ..classify import Pacer, right_pad, shared_prefix_len
from .model import Transformer


@torch.inference_mode()
def score_continuations(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    device: str,
    should_stop: StopCheck | None = None,
) -> ContinuationScores:
    def tensor(rows):
        return torch.tensor(rows, dtype=torch.long, device=device)

    pacer = Pacer()

    def prefill(tokens: Sequence[int], start: int) -> torch.Tensor:
        """Last position's logits, prefilled piece by piece so that a stop is heard soon."""
        for a, b in pacer.spans(len(tokens)):
            check_stop(should_stop)
            with pacer.piece(b - a):
                last = model(tensor([list(tokens[a:b])]), start + a, last_only=True)
        return last[0, -1]

    score_s = 0.0
    started = time.perf_counter()
    shared = shared_prefix_len(prompts)
    if shared:
        prefill(prompts[0][:shared], 0)
    batch = len(continuations)
    width = max(len(c) for c in continuations) - 1
    # Token j + 1 of a continuation is scored from the logits after token j.
    inputs = tensor([right_pad(c[:-1], width) for c in continuations])
    targets = tensor([right_pad(c[1:], width) for c in continuations])
    firsts = tensor([c[0] for c in continuations])
    out: list[tuple[tuple[float, ...], ...]] = []
    for prompt in prompts:
        last = prefill(prompt[shared:], shared)
        scores = torch.log_softmax(last.float(), dim=-1)[firsts][:, None]  # [B, 1]
        t1 = time.perf_counter()
        if width > 0:
            groups = []
            for r0, r1 in pacer.row_groups(batch, width):
                columns = []
                with model.batched_caches(len(prompt), r1 - r0, width):
                    for c0, c1 in pacer.spans(width, r1 - r0):
                        check_stop(should_stop)
                        with pacer.piece((r1 - r0) * (c1 - c0)):
                            logits = model(inputs[r0:r1, c0:c1], len(prompt) + c0)
                        columns.append(torch.log_softmax(logits.float(), dim=-1).gather(
                            -1, targets[r0:r1, c0:c1, None])[..., 0])
                groups.append(torch.cat(columns, dim=1))
            scores = torch.cat([scores, torch.cat(groups)], dim=1)
        values = scores.cpu().tolist()
        out.append(tuple(tuple(v[: len(c)]) for v, c in zip(values, continuations)))
        t2 = time.perf_counter()
        score_s += t2 - t1
    prefill_s = time.perf_counter() - started - score_s  # the shared prefix counts too
    return ContinuationScores(tuple(out), prefill_s, score_s)
