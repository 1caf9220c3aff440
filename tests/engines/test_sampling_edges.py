"""Sampling values the HTTP layer accepts must work on both engines: a top_k at or above the
model's vocabulary (no filtering; what smaller ones keep is tests/engines/test_sampling.py's)
and seeds folded into uint64 (the protocol turns -1 into 2**64 - 1)."""

import os

import pytest

from engines.base import SamplingParams, Step
from server.protocol import ChatCompletionRequest

PROMPT = [5, 70, 80, 90, 33]


def engines(path):
    from engines.torch_engine import TorchEngine

    yield TorchEngine(path, context_length=64, dtype="float32", device="cpu")
    pytest.importorskip("mlx_lm")
    from engines.mlx_engine import MLXEngine

    yield MLXEngine(path, context_length=64, dtype="float32")


def tokens(engine, **kw):
    params = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True, **kw)
    return [e.token_id for e in engine.generate(PROMPT, params)
            if isinstance(e, Step) and e.finish_reason is None]


def test_huge_top_k_and_extreme_seeds(tiny_dirs):
    path, _ = tiny_dirs["llama"]
    folded = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "seed": -1}
    ).to_sampling_params(6).seed
    assert folded == 2**64 - 1
    for engine in engines(path):
        # The model's vocabulary is the logits' width (264 here), which may exceed the
        # tokenizer's (259): a k of 259 would still drop five tokens.
        vocab = engine.logits(PROMPT).shape[-1]
        assert vocab > engine.tokenizer.vocab_size
        unfiltered = tokens(engine, seed=7)
        assert tokens(engine, seed=7, top_k=vocab) == unfiltered, engine.name
        assert tokens(engine, seed=7, top_k=10**6) == unfiltered, engine.name
        assert tokens(engine, seed=folded) == tokens(engine, seed=folded), engine.name


@pytest.mark.parametrize("size", [1, 1023, 1024, 1025, 128256])
def test_argmax_in_chunks_is_torch_argmax(size):
    """The CUDA graph's greedy pick: same index as torch.argmax, the first of equal maxima
    included, for vocabularies shorter than, equal to and not a multiple of a chunk."""
    import torch

    from engines.torch_engine.sampling import argmax_in_chunks

    gen = torch.Generator().manual_seed(size)
    # The CUDA runner compiles it whole into the decode step (no graph break allowed); under
    # mutation testing the function is wrapped in a trampoline the compiler cannot trace.
    compiled = argmax_in_chunks if "MUTANT_UNDER_TEST" in os.environ else torch.compile(
        argmax_in_chunks, fullgraph=True, dynamic=True, backend="aot_eager")
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(size, generator=gen).to(dtype)
        assert argmax_in_chunks(logits).item() == torch.argmax(logits).item()
        assert compiled(logits).item() == torch.argmax(logits).item()
        tied = torch.zeros(size, dtype=dtype)
        tied[size // 2 :] = 1.0  # ties across chunk borders: the first one wins
        assert argmax_in_chunks(tied).item() == torch.argmax(tied).item() == size // 2
        assert argmax_in_chunks(torch.full((size,), -3.0, dtype=dtype)).item() == 0
