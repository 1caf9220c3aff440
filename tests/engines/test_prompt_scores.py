"""A prompt's own tokens scored (completions' echo, lm-eval's loglikelihood) on both engines as
prefill rows of the batch, chunk by chunk: the scores equal the engine's own log-softmax, beside
rows that ask for nothing, and a request with max_tokens 0 gives its scores and no token."""

import numpy as np
import pytest

from engines.base import RequestStats, SamplingParams, Step
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
def test_prompt_scores_are_the_models_across_chunks_and_beside_other_rows(tiny_dirs, kind,
                                                                          monkeypatch):
    engine = make_engine(kind, tiny_dirs["llama"][0])
    if kind == "mlx":  # MLX scores a chunk's positions in padded pieces: several, one short
        from engines.mlx_engine import batch

        monkeypatch.setattr(batch, "SCORE_PIECE", 5)
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



def test_an_mlx_prompt_is_scored_in_the_batchs_steps_while_a_stream_goes_on(tiny_dirs):
    """MLX scores a prompt as it prefills it, a chunk a step inside the batch's steps: a running
    stream gets a token at every step meanwhile, and the scores are those of the prompt scored
    whole. A request stopped while its prompt is scored ends cancelled, and the scored one
    then gets the whole budget."""
    from engines.mlx_engine import MLXEngine

    engine = MLXEngine(tiny_dirs["llama"][0], context_length=96, dtype="float32",
                       max_prefill_tokens=8)
    prompt = PROMPTS[0] + PROMPTS[2] + PROMPTS[0]  # 27 tokens: 7 chunks of 4 (8 for 2 rows)
    whole = _run_generator(GenerationEngine.score_prompt(engine, prompt, 1))  # in one piece
    runtime = Runtime(engine, max_batch=4, max_prefill_tokens=4, threaded_output=False)
    runtime.executor.min_chunk = 4
    runtime.executor.gather_s = runtime.executor.quiet_s = 0.0  # each arrival joins at once
    stream, scored, stopped = [], [], []
    runtime.add(Submission(list(PROMPTS[1]), SamplingParams(
        max_tokens=40, temperature=0.0, ignore_eos=True), stream.append))
    for _ in range(6):  # the stream is decoding
        runtime.step()
    runtime.add(Submission(list(prompt), SamplingParams(
        max_tokens=0, temperature=0.0, prompt_logprobs=1), scored.append))
    stop = {"now": False}
    runtime.add(Submission(list(prompt), SamplingParams(
        max_tokens=0, temperature=0.0, prompt_logprobs=1), stopped.append,
        should_stop=lambda: stop["now"]))
    steps = 0
    while not scored:
        before = len(stream)
        runtime.step()
        steps += 1
        assert len(stream) == before + 1  # the stream's token, every step
        stop["now"] = steps >= 2  # the other one leaves mid-prompt
    assert steps >= 7  # the prompt took a step a chunk
    for _ in range(100):
        if not runtime.has_work:
            break
        runtime.step()
    assert not runtime.has_work
    assert stopped[-1].finish_reason == "cancelled" and stopped[-1].completion_tokens == 0
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
