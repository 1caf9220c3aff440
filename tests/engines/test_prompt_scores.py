"""A prompt's own tokens scored (completions' echo, lm-eval's loglikelihood): on the torch engine
as prefill rows of the batch, chunk by chunk; on MLX apart from the batch, a piece of the prompt
a step, before the request joins. Either way the scores equal the engine's own log-softmax, beside rows that ask for
nothing, and a request with max_tokens 0 gives its scores and no token."""

import numpy as np
import pytest

from engines.base import Cancelled, RequestStats, SamplingParams, Step
from engines.generation import GenerationEngine
from engines.runtime.runtime import Runtime, Submission
from tests.engines.helpers import PROMPTS, make_engine


def run(engine, jobs, max_prefill_tokens):
    runtime = Runtime(engine, max_batch=4, max_prefill_tokens=max_prefill_tokens,
                      threaded_output=False)
    events = {i: [] for i in range(len(jobs))}
    for i, (prompt, params) in enumerate(jobs):
        runtime.add(Submission(list(prompt), params, events[i].append))
    for _ in range(200):
        if all(e and isinstance(e[-1], (RequestStats, BaseException)) for e in events.values()):
            break
        runtime.step()
    return [events[i] for i in range(len(jobs))]


@pytest.mark.parametrize("kind", ["torch", "mlx"])
def test_prompt_scores_are_the_models_across_chunks_and_beside_other_rows(tiny_dirs, kind):
    engine = make_engine(kind, tiny_dirs["llama"][0])
    if kind == "mlx":
        engine.score_piece_tokens = 5  # MLX scores a prompt apart, piece by piece: several
    prompt = PROMPTS[0] + PROMPTS[2] + PROMPTS[0]  # 27 tokens: several chunks of 8
    jobs = [(prompt, SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=2)),
            (PROMPTS[1], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)),
            (prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                                    logprobs=0, prompt_logprobs=0))]
    got = run(engine, jobs, max_prefill_tokens=8)
    logits = np.asarray(engine.logits(prompt), dtype=np.float64)[:-1]
    reference = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    for i in (0, 2):
        steps = [e for e in got[i] if isinstance(e, Step)]
        scores = steps[0].prompt_logprobs
        assert scores[0] is None and len(scores) == len(prompt)
        assert all(s.prompt_logprobs is None for s in steps[1:])  # once, on the first Step
        for position, (score, row) in enumerate(zip(scores[1:], reference), 1):
            assert score.logprob == pytest.approx(row[prompt[position]], abs=1e-4)
            k = jobs[i][1].prompt_logprobs
            assert [t for t, _ in score.top] == np.argsort(-row)[:k].tolist()
    only = got[0]
    assert only[-1].completion_tokens == 0 and only[-1].finish_reason == "length"
    assert [e.text for e in only if isinstance(e, Step)] == [""]
    assert got[2][-1].completion_tokens == 3
    assert len([e for e in got[1] if isinstance(e, Step) and e.finish_reason is None]) == 5



def test_an_mlx_prompt_is_scored_a_piece_a_step_while_the_batch_goes_on(tiny_dirs):
    """MLX scores a prompt apart from its batch, a piece of it a step: a running stream gets a
    token between two pieces instead of waiting for the whole prompt, and the scores are those
    of the prompt scored whole. A request stopped while its prompt is scored ends cancelled."""
    engine = make_engine("mlx", tiny_dirs["llama"][0])
    engine.score_piece_tokens = 4
    prompt = PROMPTS[0] + PROMPTS[2] + PROMPTS[0]  # 27 tokens: 7 pieces of 4
    whole = _run_generator(GenerationEngine.score_prompt(engine, prompt, 1))  # in one piece
    runtime = Runtime(engine, max_batch=4, max_prefill_tokens=64, threaded_output=False)
    stream, scored, stopped = [], [], []
    runtime.add(Submission(list(PROMPTS[1]), SamplingParams(
        max_tokens=30, temperature=0.0, ignore_eos=True), stream.append))
    for _ in range(3):  # the stream is decoding
        runtime.step()
    before = len(stream)
    runtime.add(Submission(list(prompt), SamplingParams(
        max_tokens=0, temperature=0.0, prompt_logprobs=1), scored.append))
    stop = {"now": False}
    runtime.add(Submission(list(prompt), SamplingParams(
        max_tokens=0, temperature=0.0, prompt_logprobs=1), stopped.append,
        should_stop=lambda: stop["now"]))
    while not scored:
        runtime.step()
    # The stream took a step for each piece of the first prompt, not one for all of it.
    assert len([e for e in stream[before:] if isinstance(e, Step)]) >= 6
    stop["now"] = True
    for _ in range(100):
        if not runtime.has_work:
            break
        runtime.step()
    assert not runtime.has_work  # the stopped one's scoring went no further
    assert len(stopped) == 1 and isinstance(stopped[0], Cancelled)
    scores = [e for e in scored if isinstance(e, Step)][0].prompt_logprobs
    for position in range(1, len(prompt)):
        assert scores[position].logprob == pytest.approx(whole[position].logprob, abs=1e-4)
        assert scores[position].top[0][0] == whole[position].top[0][0]


def _run_generator(gen):
    """A generator's return value, run to its end."""
    while True:
        try:
            next(gen)
        except StopIteration as done:
            return done.value
