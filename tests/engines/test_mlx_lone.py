"""The MLX engine's lone stream (engines/mlx_engine/lone.py): a prompt that finds the generator
idle decodes outside it, and is handed to the generator with its KV when others join. Every
request gets what it gets through the generator alone (float32): tokens, seeded draws,
penalties and logprobs, whether it ran alone, was handed over mid-prefill or mid-decode."""

import pytest

from engines.base import SamplingParams, Step
from engines.runtime.runtime import Runtime, Submission
pytest.importorskip("mlx_lm")

JOBS = [
    (list(range(17, 54)),  # 37 tokens: prefilled 8 a step
     SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)),
    ([5, 70, 80, 90, 33, 44, 55, 66, 120, 7, 200],
     SamplingParams(max_tokens=9, temperature=0.9, top_k=30, seed=4, ignore_eos=True)),
    (list(range(60, 80)),
     SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, presence_penalty=1.5,
                    frequency_penalty=0.5, logprobs=0)),
]


@pytest.fixture(scope="module")
def engine(tiny_dirs):
    from engines.mlx_engine import MLXEngine

    return MLXEngine(tiny_dirs["llama"][0], context_length=96, dtype="float32",
                     max_prefill_tokens=8)


def run(engine, jobs, join_at, *, lone: bool, prefix_cache: bool = False):
    """Each job's steps (token, logprob, top ids) and how many prompts each generator insert
    took, the jobs arriving at the given steps."""
    runtime = Runtime(engine, max_batch=4, threaded_output=False, prefix_cache=prefix_cache)
    executor = runtime.executor
    executor.lone, executor.gather_s, executor.quiet_s = lone, 0.0, 0.0
    inserts = []
    insert = executor._gen.insert
    executor._gen.insert = lambda prompts, **kw: (inserts.append([len(p) for p in prompts]),
                                                  insert(prompts, **kw))[1]
    got = {i: [] for i in range(len(jobs))}
    done = set()

    def emit_for(i):
        def emit(event):
            if isinstance(event, BaseException):
                raise event
            if isinstance(event, Step) and event.finish_reason is None:
                lp = event.logprobs
                got[i].append((event.token_id, None if lp is None else round(lp.logprob, 4),
                               None if lp is None else tuple(t for t, _ in lp.top)))
            elif not isinstance(event, Step):
                done.add(i)
        return emit

    step = 0
    while len(done) < len(jobs):
        for i, (prompt, params) in enumerate(jobs):
            if join_at[i] == step:
                runtime.add(Submission(list(prompt), params, emit_for(i)))
        runtime.step()
        step += 1
        assert step < 500
    runtime.close()
    assert engine.kv_pool.used_blocks == 0
    return [got[i] for i in range(len(jobs))], inserts


def test_a_lone_prompt_never_enters_the_generator_and_decodes_as_there(engine):
    for job in JOBS:
        through_generator, inserts = run(engine, [job], [0], lone=False)
        assert inserts == [[len(job[0])]]
        alone, inserts = run(engine, [job], [0], lone=True)
        assert inserts == []
        assert alone == through_generator


@pytest.mark.parametrize("join_at", [[0, 1, 6], [0, 4, 4], [0, 9, 12]])
def test_a_lone_stream_handed_over_mid_way_keeps_every_requests_tokens(engine, join_at):
    """The first job runs alone (its 37-token prompt is prefilled 8 tokens a step): others join
    while it prefills or decodes, and it goes on in the generator from where it was."""
    expected = [run(engine, [job], [0], lone=False)[0][0] for job in JOBS]
    got, inserts = run(engine, JOBS, join_at, lone=True)
    assert got == expected
    # The lone sequence joined the generator as a prompt of what it had not fed yet: the rest
    # of its prompt, or the one token it had picked.
    first = inserts[0][0]
    assert first < len(JOBS[0][0]) and (first == 1) == (join_at[1] >= 6)


def test_a_lone_stream_gives_its_kv_to_the_prompt_cache(engine):
    """Its KV is kept when it ends, and the next turn's prompt (its prompt, its answer and a
    new question) runs alone too, from that prefix, and decodes what a cold prefill gives."""
    prompt, params = JOBS[0][0], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    runtime = Runtime(engine, max_batch=4, threaded_output=False, prefix_cache=True)
    runtime.executor.quiet_s = 0.0
    first, stats = generate(runtime, prompt, params)
    assert stats.cached_tokens == 0
    second_turn = list(prompt) + first + [11, 12, 13]
    warm, stats = generate(runtime, second_turn, params)
    assert stats.cached_tokens >= len(prompt)  # the first turn's KV, from its lone stream
    runtime.close()
    cold, _ = run(engine, [(second_turn, params)], [0], lone=False)
    assert warm == [t for t, _, _ in cold[0]]


def generate(runtime, prompt, params):
    """One request through the runtime: its tokens and its stats."""
    tokens, done = [], []

    def emit(event):
        if isinstance(event, BaseException):
            raise event
        if isinstance(event, Step):
            if event.finish_reason is None:
                tokens.append(event.token_id)
        else:
            done.append(event)

    runtime.add(Submission(list(prompt), params, emit))
    while not done:
        runtime.step()
    return tokens, done[0]
