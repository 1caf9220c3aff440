"""The MLX engine's batch (engines/mlx_engine/batch.py): a row alone keeps plain KV caches,
which merge into batch caches when others join and go back to plain ones when it is alone
again. Every request gets what it gets alone (float32): tokens, seeded draws, penalties and
logprobs, whether others joined while it prefilled or decoded."""

import pytest

from engines.base import SamplingParams, Step
from engines.runtime.runtime import Runtime, Submission
from tests.engines.helpers import run_together
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


def run(engine, jobs, join_at, *, prefix_cache: bool = False, watch=None):
    """Each job's steps (token, logprob, top ids), the jobs arriving at the given steps;
    watch(executor) is called after every step."""
    runtime = Runtime(engine, max_batch=4, threaded_output=False, prefix_cache=prefix_cache)
    executor = runtime.executor
    executor.gather_s, executor.quiet_s = 0.0, 0.0

    def record(step):
        lp = step.logprobs
        return (step.token_id, None if lp is None else round(lp.logprob, 4),
                None if lp is None else tuple(t for t, _ in lp.top))

    got, _ = run_together(runtime, jobs, join_at, record,
                          None if watch is None else lambda: watch(executor))
    runtime.close()
    assert engine.kv_pool.used_blocks == 0
    return got


def plain_caches(executor) -> bool | None:
    """Whether the decoding rows' caches are mlx-lm's plain ones (None: no row decodes)."""
    from mlx_lm.models.cache import KVCache

    caches = executor._batch.caches
    return None if caches is None else type(caches[0]) is KVCache


@pytest.mark.parametrize("join_at", [[0, 1, 6], [0, 4, 4], [0, 9, 12]])
def test_rows_joining_and_leaving_keep_every_requests_tokens(engine, join_at):
    """The first job starts alone (its 37-token prompt is prefilled 8 tokens a step): others
    join while it prefills or decodes, and each request gets what it gets alone; a row alone
    decodes on plain caches, several on batch caches."""
    expected = [run(engine, [job], [0])[0] for job in JOBS]
    kinds = []
    got = run(engine, JOBS, join_at,
              watch=lambda executor: kinds.append((len(executor._batch.rows),
                                                   plain_caches(executor))))
    assert got == expected
    assert {plain for rows, plain in kinds if rows == 1} == {True}
    assert {plain for rows, plain in kinds if rows > 1} == {False}
    assert kinds[-1][0] <= 1  # the batch went back to one row (or none) as the jobs ended


def test_a_row_alone_gives_its_kv_to_the_prompt_cache(engine):
    """A row alone gives its KV to the prompt cache when it ends, and the next turn's prompt
    (its prompt, its answer and a new question) starts from that prefix and decodes what a
    cold prefill gives."""
    prompt, params = JOBS[0][0], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    runtime = Runtime(engine, max_batch=4, threaded_output=False, prefix_cache=True)
    runtime.executor.quiet_s = 0.0
    first, stats = generate(runtime, prompt, params)
    assert stats.cached_tokens == 0
    second_turn = list(prompt) + first + [11, 12, 13]
    warm, stats = generate(runtime, second_turn, params)
    assert stats.cached_tokens >= len(prompt)  # the first turn's KV
    runtime.close()
    cold = run(engine, [(second_turn, params)], [0])
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
