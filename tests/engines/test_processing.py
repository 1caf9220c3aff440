"""Logits processing on both engines (logit_bias, repetition, presence and frequency penalties)
and min_p: each row's greedy token and reported log-probabilities are what a plain reference
of the rule computes from the engine's own logits, inside a batch beside rows without any,
which keep their own tokens."""

import numpy as np
import pytest

from engines.base import SamplingParams
from tests.engines.helpers import PROMPTS, make_engine, processing_rule, run_batch


def greedy(**extra):
    return SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0, **extra)


def reference(engine, prompt, generated, params):
    """log-softmax of the processed logits that produced each generated token, by the rule
    written out plainly: repetition penalty on the raw logits, then bias and penalties added."""
    logits = np.asarray(engine.logits(list(prompt) + list(generated)), dtype=np.float64)
    rows = []
    for i in range(len(generated)):
        x = processing_rule(logits[len(prompt) - 1 + i].copy(), params, prompt, generated[:i])
        rows.append(x - np.logaddexp.reduce(x))
    return rows


CASES = {
    "repetition": greedy(repetition_penalty=1.8),
    "presence": greedy(presence_penalty=1.5),
    "frequency": greedy(frequency_penalty=0.7),
    "all": greedy(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.9,
                  logit_bias=((3, 2.5), (40, -1.0))),
}


@pytest.mark.parametrize("kind", ["torch", "mlx"])
def test_processed_rows_follow_the_rule_beside_plain_rows(tiny_dirs, kind):
    engine = make_engine(kind, tiny_dirs["llama"][0])
    unprocessed = [[s.token_id for s in row]
                   for row in run_batch(engine, [greedy()] * 3, join_at=[0, 1, 2])]
    for name, params in CASES.items():
        got = run_batch(engine, [params, greedy(), greedy()], join_at=[0, 1, 2])
        # The rows beside keep their own tokens.
        assert [[s.token_id for s in row] for row in got[1:]] == unprocessed[1:], name
        assert [s.token_id for s in got[0]] != unprocessed[0], name  # the rule changed it
        tokens = [s.token_id for s in got[0]]
        rows = reference(engine, PROMPTS[0], tokens, params)
        for step, row in zip(got[0], rows):
            assert step.token_id == int(np.argmax(row)), name
            assert step.logprobs.logprob == pytest.approx(row[step.token_id], abs=1e-4), name


@pytest.mark.parametrize("kind", ["torch", "mlx"])
def test_a_large_bias_forces_a_token_and_a_ban_removes_one(tiny_dirs, kind):
    engine = make_engine(kind, tiny_dirs["llama"][0])
    forced = run_batch(engine, [greedy(logit_bias=((17, 100.0),))], join_at=[0])[0]
    assert [s.token_id for s in forced] == [17] * 10
    free = [s.token_id for s in run_batch(engine, [greedy()], join_at=[0])[0]]
    banned = run_batch(engine, [greedy(logit_bias=((free[0], -100.0),))], join_at=[0])[0]
    assert free[0] not in [s.token_id for s in banned]


@pytest.mark.parametrize("kind", ["torch", "mlx"])
def test_min_p_of_one_keeps_only_the_likeliest_token(tiny_dirs, kind):
    engine = make_engine(kind, tiny_dirs["llama"][0])
    sampled = SamplingParams(max_tokens=10, temperature=1.5, seed=3, ignore_eos=True, min_p=1.0)
    hot = SamplingParams(max_tokens=10, temperature=1.5, seed=3, ignore_eos=True)
    got = run_batch(engine, [sampled, hot, greedy()], join_at=[0, 0, 0])
    likeliest = [s.token_id for s in run_batch(engine, [greedy()], join_at=[0])[0]]
    assert [s.token_id for s in got[0]] == likeliest
    assert [s.token_id for s in got[1]] != likeliest  # without it, this seed strays


def test_mlx_batch_processing_keeps_the_rule_as_rows_grow_join_and_leave():
    """The MLX batch keeps its rows' penalty state on the device, counting each step's sampled
    tokens only: over 120 steps of rows with different processing (one resumed with a
    completion so far), a row joining midway and another leaving, each row's processed logits
    are what the rule computes from that row's whole history."""
    mx = pytest.importorskip("mlx.core")
    from engines.mlx_engine.sampling import BatchRows, Row
    from engines.processing import Processing
    from engines.runtime.plan import RowSampling

    rng = np.random.default_rng(0)
    vocab = 50

    def row(seq_id, params, prompt_len, done=0):
        prompt = [int(t) for t in rng.integers(0, vocab, prompt_len)]
        generated = [int(t) for t in rng.integers(0, vocab, done)]
        processing = Processing.of(params)
        sampling = RowSampling.of(params, 0, processing)
        history = (prompt, generated) if processing is not None else None
        return Row.of(seq_id, sampling, 0, history), params, prompt, generated

    live = [row(0, CASES["all"], 12, done=3), row(1, greedy(), 5),
            row(2, CASES["presence"], 7)]
    batch = BatchRows(vocab, [r for r, *_ in live])
    for step in range(120):
        if step == 40:
            joining = row(3, CASES["repetition"], 9, done=2)
            batch.extend(BatchRows(vocab, [joining[0]]))
            live.append(joining)
        if step == 70:
            batch.filter([0, 2, 3])
            del live[1]
        logits = rng.normal(0, 3, (len(live), vocab)).astype(np.float32)
        got = np.array(batch.process(mx.array(logits)))
        for i, (_, params, prompt, generated) in enumerate(live):
            want = processing_rule(logits[i].astype(np.float64), params, prompt, generated)
            np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-4,
                                       err_msg=f"step {step}, row {i}")
        # Repeats matter to the frequency penalty: draw from a few tokens now and then.
        tokens = [int(rng.integers(0, 5 if step % 3 else vocab)) for _ in live]
        batch.took(mx.array(tokens, dtype=mx.uint32))
        for (_, _, _, generated), token in zip(live, tokens):
            generated.append(token)
