"""Sampling checked by distribution: each engine's sampler, fed the same logits many times,
picks tokens with the probabilities plain numpy gives those logits under duet's rule
(temperature, then top_k, then top_p over what top_k kept); greedy is the argmax; a seed
fixes the draws.

The draws are seeded, so each check is deterministic; the tolerance is 5 standard errors per
token, and a token the rule removes must never be drawn at all."""

from dataclasses import replace

import numpy as np
import pytest

from engines.base import SamplingParams
from engines.runtime.plan import RowSampling, ScheduledSeq

V = 24
N = 20_000
LOGITS = np.random.default_rng(7).normal(0.0, 1.6, V).astype(np.float32)

CASES = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0),
    (0.5, 0, 1.0),
    (1.7, 0, 1.0),
    (1.0, 1, 1.0),
    (1.0, 5, 1.0),
    (1.0, V - 1, 1.0),
    (1.0, V, 1.0),  # a k at the vocabulary keeps every token
    (1.0, 0, 0.3),
    (1.0, 0, 0.62),
    (1.0, 0, 0.93),
    (0.7, 8, 0.8),
    (1.3, 3, 0.5),
    (2.0, 12, 0.45),
]


def reference(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    z = logits.astype(np.float64) / temperature
    if 0 < top_k < z.size:
        z = np.where(z < np.sort(z)[-top_k], -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p)
        above = np.cumsum(p[order]) - p[order]
        # The rule must not hinge on rounding: no token sits on the top_p border.
        assert np.all(np.abs(above - top_p) > 1e-3), "pick another top_p for this test"
        keep = np.zeros_like(p, dtype=bool)
        keep[order[above < top_p]] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


def check_distribution(draws: np.ndarray, expected: np.ndarray, n: int = N) -> None:
    assert draws.shape == (n,) and draws.min() >= 0 and draws.max() < V
    freq = np.bincount(draws, minlength=V) / n
    removed = expected == 0
    assert not freq[removed].any(), f"drew removed tokens {np.flatnonzero(freq * removed)}"
    tolerance = 5 * np.sqrt(expected * (1 - expected) / n) + 1e-3
    worst = np.argmax(np.abs(freq - expected) - tolerance)
    assert np.all(np.abs(freq - expected) <= tolerance), (
        f"token {worst}: drawn {freq[worst]:.4f}, expected {expected[worst]:.4f}")


def rows_of(params: SamplingParams, n: int, vary: str = "draws") -> list:
    """n rows due a token: one sequence's first n draws, or the first draw of n seeds."""
    sampling = RowSampling.of(params, params.seed if params.seed is not None else 0)
    return [ScheduledSeq(i, (0,), 0, (), True,
                         sampling if vary == "draws" else replace(sampling, seed=sampling.seed + i),
                         i if vary == "draws" else 0)
            for i in range(n)]


def torch_draws(params: SamplingParams, vary: str = "draws") -> np.ndarray:
    vary = "draws" if vary == "rows" else vary
    import torch

    from engines.torch_engine.sampling import sample_rows

    logits = torch.from_numpy(LOGITS).expand(N, V)
    picked = sample_rows(logits, rows_of(params, N, vary))
    assert picked.shape == (N,) and picked.dtype == torch.long  # one id per row
    return picked.numpy()


def mlx_sample(logits: np.ndarray, rows: list) -> np.ndarray:
    """The MLX engine's batch sampler over logits [B, V], a row each (ScheduledSeq)."""
    mx = pytest.importorskip("mlx.core")
    from engines.mlx_engine.sampling import BatchRows, Row

    batch = BatchRows(logits.shape[-1], [Row(r.seq_id, r.sampling, r.draws) for r in rows])
    return np.array(batch.sample(mx.array(logits))).astype(np.int64)


def mlx_draws(params: SamplingParams, vary: str = "draws") -> np.ndarray:
    """As torch_draws: the whole batch in one call, as the engine samples its rows."""
    vary = "draws" if vary == "rows" else vary
    return mlx_sample(np.broadcast_to(LOGITS, (N, V)), rows_of(params, N, vary))


DRAWS = {"torch": torch_draws, "mlx": mlx_draws}


@pytest.mark.parametrize("engine", DRAWS)
@pytest.mark.parametrize("temperature, top_k, top_p", CASES)
def test_draws_follow_the_reference_distribution(engine, temperature, top_k, top_p):
    """Torch: one sequence's successive draws; MLX: many rows at once (see mlx_draws)."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=1234)
    check_distribution(DRAWS[engine](params), reference(LOGITS, temperature, top_k, top_p))


@pytest.mark.parametrize("engine", DRAWS)
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 8, 0.8)])
@pytest.mark.parametrize("vary", ["draws", "seeds"])
def test_successive_draws_and_many_seeds_follow_the_reference_distribution(
        engine, temperature, top_k, top_p, vary):
    """The engines' real use: a sequence's draws one after another, and the first draw of
    many seeds (requests)."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=99)
    draws = DRAWS[engine](params, vary)
    check_distribution(draws, reference(LOGITS, temperature, top_k, top_p), draws.size)


def test_the_reference_is_not_trivial():
    """The cases tell the rule's variants apart: filtering before the temperature, or top_p
    before top_k, or keeping the wrong side of the cumulative sum, each gives another
    distribution than the reference for some case."""
    def far(a, b):
        return np.abs(a - b).max() > 0.05

    def top_p_first(t, k, p):
        kept = reference(LOGITS, 1.0, 0, p) > 0
        masked = np.where(kept, LOGITS, -np.inf)
        return reference(masked, t, k, 1.0)

    def temperature_last(t, k, p):
        kept = reference(LOGITS, 1.0, k, p) > 0
        return reference(np.where(kept, LOGITS, -np.inf), t, 0, 1.0)

    def wrong_side(t, k, p):
        kept = reference(LOGITS, t, k, 1.0)
        order = np.argsort(-kept)
        tail = np.cumsum(kept[order]) - kept[order] >= p
        q = np.zeros_like(kept)
        q[order[tail]] = kept[order[tail]]
        return q / q.sum() if q.sum() else kept

    for variant in (top_p_first, temperature_last, wrong_side):
        assert any(far(variant(*c), reference(LOGITS, *c)) for c in CASES), variant.__name__


@pytest.mark.parametrize("engine", DRAWS)
def test_greedy_is_the_argmax(engine):
    params = SamplingParams(temperature=0.0)
    if engine == "torch":
        import torch

        from engines.torch_engine.sampling import sample_rows

        rows = torch.randn(50, 1000, generator=torch.Generator().manual_seed(0))
        assert torch.equal(sample_rows(rows, rows_of(params, 50)), rows.argmax(-1))
    else:
        rows = np.random.default_rng(0).normal(size=(50, 1000)).astype(np.float32)
        assert np.array_equal(mlx_sample(rows, rows_of(params, 50)), rows.argmax(-1))


def test_a_batch_mixing_greedy_and_sampled_rows_gives_each_its_own():
    """Each row by its own settings: a greedy row is the argmax, a sampled row draws what it
    draws alone, whatever else is in the batch."""
    import torch

    from engines.torch_engine.sampling import sample_rows

    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    settings = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3),
                SamplingParams(temperature=0.8, top_k=5, seed=4),
                SamplingParams(temperature=1.2, top_p=0.7, seed=5),
                SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=6)]
    rows = [replace(rows_of(p, 1)[0], seq_id=i, draws=i) for i, p in enumerate(settings)]
    together = sample_rows(logits, rows)
    alone = [sample_rows(logits[i : i + 1], [r]).item() for i, r in enumerate(rows)]
    assert together.tolist() == alone
    assert alone[0] == logits[0].argmax() and alone[4] == logits[4].argmax()
    assert alone[2] in torch.topk(logits[2], 5).indices.tolist()


@pytest.mark.parametrize("engine", DRAWS)
def test_a_seed_fixes_the_draws_and_another_seed_changes_them(engine):
    def draws(seed):
        return DRAWS[engine](SamplingParams(temperature=1.0, top_p=0.9, seed=seed))

    first = draws(5)
    assert np.array_equal(first, draws(5))
    assert not np.array_equal(first, draws(6))


def test_the_engines_draw_the_same_tokens_from_the_same_logits():
    """One rule and one noise on both engines (the counter-based uniforms are the same numbers
    bit for bit): a batch mixing greedy rows, temperatures, min_p, top_k and top_p draws the
    same tokens on MLX as on torch, each row from its own (seed, draws)."""
    import torch

    mx = pytest.importorskip("mlx.core")
    from engines.mlx_engine.sampling import row_uniforms as mlx_uniforms
    from engines.torch_engine.sampling import row_uniforms, sample_rows

    seeds, draws = [0, 7, 2**63 + 5, 2**64 - 1], [0, 3, 1, 2**31 + 9]
    signed = [s - (1 << 64) if s >= 1 << 63 else s for s in seeds]
    assert np.array_equal(
        np.array(mlx_uniforms(seeds, draws, 500)),
        row_uniforms(torch.tensor(signed), torch.tensor(draws), 500).numpy())
    settings = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3),
                SamplingParams(temperature=0.8, top_k=5, seed=4),
                SamplingParams(temperature=1.2, top_p=0.7, seed=5),
                SamplingParams(temperature=0.9, min_p=0.05, seed=6),
                SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=2**64 - 3)]
    rows = [replace(rows_of(p, 1)[0], seq_id=i, draws=d)
            for d in range(20) for i, p in enumerate(settings)]
    logits = np.random.default_rng(5).normal(0.0, 2.0, (len(rows), 300)).astype(np.float32)
    assert mlx_sample(logits, rows).tolist() == sample_rows(torch.from_numpy(logits),
                                                            rows).tolist()


def test_the_compiled_sampler_draws_what_the_eager_one_does():
    """The parts of the sampler the CUDA engine compiles trace whole (Dynamo's eager backend
    stands in for Inductor here) and draw the same tokens."""
    import torch

    from engines.torch_engine.sampling import Sampler, sample_rows

    torch._dynamo.reset()
    compiled = Sampler(backend="eager")
    settings = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3),
                SamplingParams(temperature=0.8, top_k=5, seed=4),
                SamplingParams(temperature=1.2, top_p=0.7, seed=5),
                SamplingParams(temperature=0.9, min_p=0.05, seed=6)]
    rows = [replace(rows_of(p, 1)[0], seq_id=i, draws=d)
            for d in range(4) for i, p in enumerate(settings)]
    logits = torch.randn(len(rows), 300, generator=torch.Generator().manual_seed(2))
    assert sample_rows(logits, rows, compiled).tolist() == sample_rows(logits, rows).tolist()
    plain = rows[1:2] * 2  # neither top_k nor top_p: nothing ranked
    assert sample_rows(logits[:2], plain, compiled).tolist() == \
        sample_rows(logits[:2], plain).tolist()


def test_the_eager_nucleus_ranks_few_tokens_and_sorts_a_flat_row_whole():
    """nucleus_eager (the CPU's and MPS's) keeps what the whole-row sort keeps: peaked rows
    from their CANDIDATES likeliest, flat rows (whose top_p border lies beyond those) sorted
    whole, in one batch with top_k rows; and race_among, which makes noise for the kept tokens
    alone, draws what race() draws."""
    import torch

    from engines.torch_engine import sampling

    v = 3 * sampling.CANDIDATES
    gen = torch.Generator().manual_seed(4)
    scales = [8.0, 0.05, 4.0, 0.01, 6.0, 1.0]  # peaked and flat rows
    logits = torch.randn(len(scales), v, generator=gen) * torch.tensor(scales)[:, None]
    floats = torch.tensor([[1.0, -float("inf"), p] for p in (0.9, 0.9, 0.99, 0.5, 1.0, 0.8)])
    ints = torch.tensor([[7 * i, i, k] for i, k in enumerate((v, v, 50, v, 20, v))])
    probs = sampling.probabilities(logits, floats)
    sorted_whole = sampling.nucleus(probs, floats, ints, v)
    eager = sampling.nucleus_eager(probs, floats, ints, v)
    kept = (sorted_whole > 0).sum(-1)
    assert kept[1] > sampling.CANDIDATES and kept[3] > sampling.CANDIDATES  # sorted whole
    assert kept[0] < sampling.CANDIDATES  # from the candidates
    assert torch.equal(eager, sorted_whole)
    for draws in range(5):
        ints[:, 1] = draws
        assert torch.equal(sampling.race_among(eager, ints), sampling.race(eager, ints))


def test_the_noise_never_draws_a_token_of_probability_zero():
    """A uniform comes from 32 random bits; the largest such number must stay below 1 in
    float32, or its noise -log(u) is 0 and a token of probability 0 (masked by a grammar, cut
    by min_p) scores 0 / 0 = NaN, which argmax takes. A (seed, draw) whose row of the noise
    holds that largest number is searched for, and a one-hot row is drawn with it."""
    import torch

    from engines.torch_engine.sampling import _bits, _row_keys, race, race_among, unit

    width = 1 << 16
    columns = torch.arange(width)
    for seed in range(4096):  # one row in 2**24 / width holds it: found within a few hundred
        bits = _bits(_row_keys(torch.tensor([seed]), torch.tensor([0]))[:, None], columns[None, :])
        hit = torch.nonzero((bits[0] >> 8) == (1 << 24) - 1)
        if len(hit):
            break
    else:
        pytest.fail("no row holds the largest bits")
    column = int(hit[0, 0])
    assert 0.0 < float(unit(bits[0, column])) < 1.0
    hot = 1 if column == 0 else 0
    probs = torch.zeros(1, width)
    probs[0, hot] = 1.0
    ints = torch.tensor([[seed, 0, width]])
    assert int(race(probs, ints)[0]) == hot
    assert int(race_among(probs, ints)[0]) == hot
    extreme = torch.tensor([0, 0xFFFFFFFF])  # the smallest and the largest bits
    assert torch.all((unit(extreme) > 0) & (unit(extreme) < 1) & (-torch.log(unit(extreme)) > 0))
