"""Token log-probabilities on both engines: each row that asks gets, for every token, the
log-softmax of the model's logits at that token and its k likeliest alternatives, equal to the
engine's own scores of the same text; inside a mixed batch, beside rows that ask for none and
sampled rows, and without changing any row's tokens."""

import numpy as np
import pytest

from engines.base import SamplingParams
from tests.engines.helpers import PROMPTS, make_engine, run_batch

ASKED = [
    SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3),
    SamplingParams(max_tokens=6, temperature=0.9, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=7, temperature=0.7, seed=11, ignore_eos=True, logprobs=0),
]


def reference_scores(engine, prompt, tokens):
    """log-softmax rows of the engine's own logits for the prompt and each token's prefix."""
    logits = np.asarray(engine.logits(list(prompt) + list(tokens)), dtype=np.float64)
    rows = logits[len(prompt) - 1: len(prompt) - 1 + len(tokens)]
    return rows - np.logaddexp.reduce(rows, axis=-1, keepdims=True)


@pytest.mark.parametrize("kind", ["torch", "torch-graphs", "mlx"])
def test_logprobs_are_the_models_scores_in_a_mixed_batch(tiny_dirs, kind):
    engine = make_engine(kind, tiny_dirs["llama"][0])
    plain = [SamplingParams(**{**p.__dict__, "logprobs": None}) for p in ASKED]
    without = run_batch(engine, plain, join_at=[0, 0, 2])
    got = run_batch(engine, ASKED, join_at=[0, 0, 2])
    for i, params in enumerate(ASKED):
        tokens = [s.token_id for s in got[i]]
        assert tokens == [s.token_id for s in without[i]], i  # asking changes no token
        if params.logprobs is None:
            assert all(s.logprobs is None for s in got[i])
            continue
        scores = reference_scores(engine, PROMPTS[i], tokens)
        for step, row in zip(got[i], scores):
            assert step.logprobs.logprob == pytest.approx(row[step.token_id], abs=1e-4)
            assert len(step.logprobs.top) == params.logprobs
            best = np.argsort(-row)[: params.logprobs]
            assert [t for t, _ in step.logprobs.top] == best.tolist()
            assert [lp for _, lp in step.logprobs.top] == pytest.approx(row[best].tolist(),
                                                                        abs=1e-4)
        if params.greedy:  # a greedy row's token is its likeliest
            assert all(s.logprobs.top[0][0] == s.token_id for s in got[i])
