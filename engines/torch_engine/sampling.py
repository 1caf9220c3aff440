"""Token sampling that stays on the device: no host round trip to pick a token."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..base import SamplingParams

ARGMAX_CHUNK = 1024


def argmax_in_chunks(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax of a vector [V] (the first of equal maxima), in two stages: the maximum of
    each chunk in parallel, then the best chunk. Compiled, this is two small kernels; ATen's
    one-row argmax runs in a single thread block (29 us for a 128k vocabulary on an H200, 3%
    of a llama-3.2-1b step)."""
    v = logits.shape[-1]
    chunks = -(-v // ARGMAX_CHUNK)
    padded = torch.nn.functional.pad(logits, (0, chunks * ARGMAX_CHUNK - v), value=float("-inf"))
    best, where = padded.view(chunks, ARGMAX_CHUNK).max(dim=-1)
    # gather, not where[chunk]: indexing by a tensor's value would stop the compiler's trace.
    index = where + torch.arange(chunks, device=logits.device) * ARGMAX_CHUNK
    return index.gather(0, torch.argmax(best).view(1))


def make_sampler(params: SamplingParams, device: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """Build the sampler once per request; it maps logits [..., V] to token ids [..., 1], each
    row on its own: temperature first, then top_k, then top_p over what top_k kept."""
    if params.greedy:
        return lambda logits: torch.argmax(logits, dim=-1, keepdim=True)

    generator = torch.Generator(device=device)
    if params.seed is not None:
        generator.manual_seed(params.seed)
    else:
        generator.seed()
    temperature, top_k, top_p = params.temperature, params.top_k, params.top_p

    def sample(logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float() / temperature
        if 0 < top_k < logits.shape[-1]:
            kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if top_p < 1.0:
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
            # Keep a token while the tokens ranked above it hold less than top_p: the fewest
            # tokens whose mass reaches top_p (the most likely one always stays).
            drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        # Exponential race (Gumbel-max in disguise): a sample without torch.multinomial's sync.
        noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
        return torch.argmax(probs / noise, dim=-1, keepdim=True)

    return sample
