"""Zero-shot scoring on tiny random models: the torch engine against a plain transformers
forward pass of prompt + label, and the MLX engine against the torch engine."""

import numpy as np
import pytest
import torch

from engines import classify
from engines.base import Cancelled, ClassifyParams
from engines.classify import shared_prefix_len
from engines.torch_engine import TorchEngine

# Prompts that share a prefix and differ in length; continuations of 1 to 4 tokens.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 40, 41], [5, 6, 7, 8, 9, 12, 13, 14, 15], [90, 91]]
CONTINUATIONS = [[20], [21, 22, 23, 24], [25, 26]]


def reference_logprobs(model, prompt, continuation):
    """One full forward pass of prompt + continuation: no cache, no batching, no padding."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + continuation])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[len(prompt) - 1 + k, t].item() for k, t in enumerate(continuation)]


def test_label_probabilities_survive_large_scores():
    """The softmax over label scores shifts by the best score: sums of many log-probabilities
    (or their differences with the prior) may be far outside exp()'s range."""
    probs = classify._softmax([-2000.0, -2001.0, -2003.0])
    assert probs == pytest.approx([0.7054, 0.2595, 0.0351], abs=1e-4)
    assert classify._softmax([800.0, 800.0]) == [0.5, 0.5]


def test_shared_prefix_leaves_every_prompt_a_token():
    assert shared_prefix_len([[1, 2, 3], [1, 2, 4]]) == 2
    assert shared_prefix_len([[1, 2], [1, 2, 3]]) == 1
    assert shared_prefix_len([[1, 2, 3]]) == 2
    assert shared_prefix_len([[1], [2]]) == 0


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_torch_scores_match_a_transformers_forward_pass(tiny_dirs, family):
    path, reference = tiny_dirs[family]
    engine = TorchEngine(path, context_length=64, dtype="float32", device="cpu")
    scored = engine.score_continuations(PROMPTS, CONTINUATIONS)
    for i, prompt in enumerate(PROMPTS):
        for j, cont in enumerate(CONTINUATIONS):
            np.testing.assert_allclose(
                scored.token_logprobs[i][j], reference_logprobs(reference, prompt, cont),
                atol=2e-5, rtol=1e-4,
            )
    assert scored.prefill_s > 0 and scored.score_s > 0


def test_scoring_leaves_generation_intact(tiny_dirs):
    from engines.base import SamplingParams, Step

    engine = TorchEngine(tiny_dirs["llama"][0], context_length=64, dtype="float32", device="cpu")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ids = lambda: [e.token_id for e in engine.generate(PROMPTS[0], params) if isinstance(e, Step)]
    before = ids()
    engine.score_continuations(PROMPTS, CONTINUATIONS)
    assert ids() == before


def test_zero_shot_probabilities_and_stats(tiny_dirs):
    engine = TorchEngine(tiny_dirs["smollm"][0], context_length=256, dtype="float32", device="cpu")
    params = ClassifyParams(inputs=("I love it", "awful!"), labels=("good", "bad", "so-so"))
    result = engine.classify(params)
    for r in result.results:
        probs = [s.probability for s in r.scores]
        assert sum(probs) == pytest.approx(1.0) and r.label == r.scores[int(np.argmax(probs))].label
    stats = result.stats
    # 2 inputs + the content-free one, each with the labels in two orders
    assert stats.prompt_tokens > 0 and stats.completion_tokens > 0
    assert stats.engine == "torch" and stats.total_s > 0 and stats.peak_memory_bytes > 0
    uncalibrated = engine.classify(ClassifyParams(inputs=params.inputs, labels=params.labels,
                                                  calibrate=False))
    assert uncalibrated.stats.prompt_tokens < stats.prompt_tokens
    assert [s.probability for s in uncalibrated.results[0].scores] != [
        s.probability for s in result.results[0].scores]


def test_mlx_and_torch_probabilities_agree(tiny_dirs):
    pytest.importorskip("mlx_lm", reason="the mlx extra is installed by scripts/setup.sh")
    from engines.mlx_engine import MLXEngine

    path = tiny_dirs["llama"][0]
    torch_engine = TorchEngine(path, context_length=256, dtype="float32", device="cpu")
    mlx_engine = MLXEngine(path, context_length=256, dtype="float32")
    np.testing.assert_allclose(
        np.array(mlx_engine.score_continuations(PROMPTS, CONTINUATIONS).token_logprobs[0][1]),
        np.array(torch_engine.score_continuations(PROMPTS, CONTINUATIONS).token_logprobs[0][1]),
        atol=1e-4,
    )
    for scoring in ("sum", "mean"):
        params = ClassifyParams(inputs=("I love it", "awful!", "meh"),
                                labels=("good", "bad", "somewhere in between"),
                                label_scoring=scoring)
        a, b = torch_engine.classify(params), mlx_engine.classify(params)
        for ra, rb in zip(a.results, b.results):
            assert ra.label == rb.label
            np.testing.assert_allclose([s.probability for s in ra.scores],
                                       [s.probability for s in rb.scores], atol=1e-3)
        assert a.stats.prompt_tokens == b.stats.prompt_tokens


def _engines(tiny_dirs, which):
    path = tiny_dirs["llama"][0]
    if which == "torch":
        return TorchEngine(path, context_length=256, dtype="float32", device="cpu")
    pytest.importorskip("mlx_lm", reason="the mlx extra is installed by scripts/setup.sh")
    from engines.mlx_engine import MLXEngine

    return MLXEngine(path, context_length=256, dtype="float32")


def test_mlx_scoring_projects_only_each_prompts_last_token(tiny_dirs):
    """MLX computes what is evaluated: a forward's logits are every position's, and the last
    row sliced out of them still projects every position onto the vocabulary (most of a long
    prompt's scoring on MLX's CPU backend). Each prompt's prefill ends with its last token
    alone, its pieces before that filling the cache; the scores stay those of one forward."""
    engine = _engines(tiny_dirs, "mlx")
    whole = engine.score_continuations(PROMPTS, CONTINUATIONS).token_logprobs
    calls = []

    class Spy:  # the model, its forwards recorded
        def __init__(self, model):
            self.model = model

        def __getattr__(self, name):
            return getattr(self.model, name)

        def __call__(self, inputs, cache=None):
            calls.append((tuple(inputs.shape), cache))
            return self.model(inputs, cache=cache)

    engine.model = Spy(engine.model)
    scored = engine.score_continuations(PROMPTS, CONTINUATIONS).token_logprobs
    prompt_cache = calls[0][1]
    ends = [shape for (shape, cache), (_, after) in zip(calls, calls[1:] + [(None, None)])
            if cache is prompt_cache and after is not prompt_cache]
    assert ends == [(1, 1)] * len(PROMPTS)  # each prompt's last forward before its labels
    for a, b in zip(whole, scored):
        for x, y in zip(a, b):
            np.testing.assert_allclose(x, y, atol=1e-5)


def small_pieces(monkeypatch):
    monkeypatch.setattr(classify, "PIECE_TOKENS_FIRST", 2)
    monkeypatch.setattr(classify, "PIECE_TOKENS_MAX", 2)


def test_the_pacer_sizes_pieces_from_the_speed_so_far(monkeypatch):
    monkeypatch.setattr(classify, "PIECE_SECONDS", 0.5)
    monkeypatch.setattr(classify, "PIECE_TOKENS_FIRST", 16)
    clock = iter([0.0, 0.1, 1.0, 3.0])  # a piece of 16 tokens in 0.1 s, then 80 in 2 s
    monkeypatch.setattr(classify.time, "perf_counter", lambda: next(clock))
    pacer = classify.Pacer()
    assert pacer.size == classify.PIECE_TOKENS_FIRST == 16
    with pacer.piece(16):
        pass
    assert pacer.size == 80  # 160 tokens/s x 0.5 s
    with pacer.piece(80):
        pass
    assert pacer.size == 20  # 40 tokens/s x 0.5 s


def test_the_pacer_grows_pieces_back_where_a_fixed_cost_dominates(monkeypatch):
    """Each forward costs 0.4 s whatever its size, and 0.01 s a token: sized in proportion,
    pieces would shrink to one token (0.41 s each); two sizes timed show the fixed cost, and
    the pieces grow to spend as long on tokens as on it (40 tokens)."""
    monkeypatch.setattr(classify, "PIECE_SECONDS", 0.3)
    monkeypatch.setattr(classify, "PIECE_TOKENS_FIRST", 4)
    now = [0.0]
    monkeypatch.setattr(classify.time, "perf_counter", lambda: now[0])
    pacer = classify.Pacer()
    sizes = []
    for _ in range(6):
        tokens = pacer.size
        with pacer.piece(tokens):
            now[0] += 0.4 + 0.01 * tokens
        sizes.append(pacer.size)
    assert sizes[:2] == [2, 1]  # in proportion while one size (after the first) is known
    assert all(39 <= s <= 40 for s in sizes[2:])  # 0.4 / 0.01, as floats divide
    # Where the fixed cost is small the pieces take PIECE_SECONDS: 0.28 s of tokens.
    pacer, now[0] = classify.Pacer(), 0.0
    for _ in range(6):
        tokens = pacer.size
        with pacer.piece(tokens):
            now[0] += 0.02 + 0.001 * tokens
    assert 279 <= pacer.size <= 280


def test_the_pacer_finds_a_fixed_cost_that_one_token_pieces_hide(monkeypatch):
    """A model split over ranks of a busy CPU: each forward 0.55-0.61 s whatever its size
    (the clock's noise larger than a token's 0.4 ms). In proportion the pieces would stay at
    one token for ever (70 s for one input's classification); timed at two sizes, then
    doubled while the larger piece takes no longer, they grow to hundreds of tokens (a
    piece's tokens then cost about what its fixed cost does)."""
    monkeypatch.setattr(classify, "PIECE_SECONDS", 0.3)
    monkeypatch.setattr(classify, "PIECE_TOKENS_FIRST", 4)
    now = [0.0]
    monkeypatch.setattr(classify.time, "perf_counter", lambda: now[0])
    noise = iter([0.1, 0.06, 0.0] + [0.03, 0.0] * 10)  # the first: the warm-up's
    pacer, sizes = classify.Pacer(), []
    for _ in range(10):
        tokens = pacer.size
        with pacer.piece(tokens):
            now[0] += 0.55 + next(noise) + 0.0004 * tokens
        sizes.append(pacer.size)
    assert sizes[:3] == [1, 2, 4]  # one token, then two, which took no longer: doubled
    assert sizes == sorted(sizes) and sizes[-1] >= 500  # never back to one token


@pytest.mark.parametrize("which", ["torch", "mlx"])
def test_scoring_in_small_pieces_gives_the_same_scores(tiny_dirs, monkeypatch, which):
    """Prefill and continuation batches cut into pieces of 2 tokens (so that a stop is heard
    between them; a continuation cut along its tokens too) score exactly as one piece does."""
    engine = _engines(tiny_dirs, which)
    whole = engine.score_continuations(PROMPTS, CONTINUATIONS).token_logprobs
    small_pieces(monkeypatch)
    pacer = classify.Pacer()
    assert list(pacer.spans(5)) == [(0, 2), (2, 4), (4, 5)]
    assert list(pacer.row_groups(3, 4)) == [(0, 1), (1, 2), (2, 3)]  # a row is 4 tokens
    assert list(pacer.spans(3, 1)) == [(0, 2), (2, 3)]  # and is cut along its tokens
    pieces = engine.score_continuations(PROMPTS, CONTINUATIONS).token_logprobs
    for a, b in zip(whole, pieces):
        for x, y in zip(a, b):
            np.testing.assert_allclose(x, y, atol=2e-5)


@pytest.mark.parametrize("which", ["torch", "mlx"])
def test_a_stop_ends_scoring_at_the_next_piece(tiny_dirs, monkeypatch, which):
    engine = _engines(tiny_dirs, which)
    small_pieces(monkeypatch)
    asked = []

    def should_stop():  # says stop on the fourth question
        asked.append(1)
        return len(asked) >= 4

    with pytest.raises(Cancelled):
        engine.score_continuations(PROMPTS, CONTINUATIONS, should_stop)
    assert len(asked) == 4  # asked between pieces, and nothing ran after the stop
    with pytest.raises(Cancelled):
        engine.classify(ClassifyParams(inputs=("a", "b"), labels=("x", "y")), lambda: True)
    # The engine is fine afterwards.
    assert engine.score_continuations(PROMPTS, CONTINUATIONS).token_logprobs


def test_the_peak_memory_outlives_the_steps_run_between_pieces():
    """Beside a running batch the runtime's steps reset the engine's meter between two pieces
    of a classification: its peak is still the largest the meter saw."""
    from engines.fake import FakeEngine
    from engines.generation import MemoryMeter

    class Readings(MemoryMeter):  # the memory in use at each sample, in turn
        def __init__(self, values):
            self.values, self.peak = iter(values), 0

        def reset(self):
            self.peak = 0

        def sample(self):
            self.peak = max(self.peak, next(self.values))

        def peak_bytes(self):
            return self.peak

    engine = FakeEngine()
    params = ClassifyParams(inputs=("a", "b", "c"), labels=("x", "y"), calibrate=False)
    engine.meter = Readings([100, 300, 200, 50])  # three pieces, then the end
    result = classify.zero_shot(engine, params, lambda: engine.meter.reset() or False)
    assert result.stats.peak_memory_bytes == 300  # not 50: what the last reset left
    engine.meter = Readings([100, 300, 200, 50])
    assert classify.zero_shot(engine, params).stats.peak_memory_bytes == 300


def test_prompts_are_scored_per_label_listing_only_when_that_prefills_less():
    head, texts = list(range(1, 11)), [[7], [8, 9], [10]]
    long_a, long_b = list(range(20, 60)), list(range(60, 100))  # two orders of a long list
    prompts = [head + long_a + t for t in texts] + [head + long_b + t for t in texts]
    assert classify._prefix_groups(prompts, 2) == [prompts[:3], prompts[3:]]
    short = [head + [20] + t for t in texts] + [head + [21] + t for t in texts]
    assert classify._prefix_groups(short, 2) == [short]


@pytest.mark.parametrize("calibrate, scoring", [(True, "sum"), (True, "mean"), (False, "sum")])
def test_zero_shot_maths_against_a_hand_computation(tiny_dirs, calibrate, scoring):
    """Each label's score is its log-likelihood averaged over the two listings of the labels
    (given order and reversed), less the same average for the empty text when calibrating;
    the probabilities are a softmax of that. Recomputed here from single scoring calls."""
    engine = TorchEngine(tiny_dirs["smollm"][0], context_length=256, dtype="float32", device="cpu")
    labels, inputs = ("good", "bad", "so-so"), ("I love it", "awful!")
    conts = classify.label_continuations(engine, "Judge it.", labels)

    def scores(order, text):
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": classify.user_message("Judge it.", order, text)}])
        rows = engine.score_continuations([prompt], conts).token_logprobs[0]
        return np.array([sum(r) / (len(r) if scoring == "mean" else 1) for r in rows])

    def label_scores(text):
        if not calibrate:
            return scores(labels, text)
        return (scores(labels, text) + scores(labels[::-1], text)) / 2

    prior = label_scores("") if calibrate else np.zeros(len(labels))
    result = engine.classify(ClassifyParams(inputs=inputs, labels=labels, instruction="Judge it.",
                                            calibrate=calibrate, label_scoring=scoring))
    for text, got in zip(inputs, result.results):
        raw = label_scores(text)
        expected = np.exp(raw - prior - (raw - prior).max())
        expected /= expected.sum()
        np.testing.assert_allclose([s.logprob for s in got.scores], raw, atol=1e-4)
        np.testing.assert_allclose([s.probability for s in got.scores], expected, atol=1e-5)
        assert [s.label for s in got.scores] == list(labels)
        assert got.label == labels[int(np.argmax(expected))]
    # The listings differ enough on this model for the averaging to show.
    assert np.abs(scores(labels, inputs[0]) - scores(labels[::-1], inputs[0])).max() > 0.01


def test_labels_under_a_template_that_rewrites_earlier_turns(tiny_dirs, tmp_path):
    """Some templates render a turn differently once a reply follows it; the reply then cannot
    be cut from the full conversation, and a label is scored as its own tokens and the end of
    sequence. A template that keeps earlier turns gets the reply it renders."""
    import shutil
    from types import SimpleNamespace

    from engines.tokenizer import ChatTokenizer

    path = tmp_path / "model"
    shutil.copytree(tiny_dirs["llama"][0], path)
    labels = ("good", "so-so")
    kept = SimpleNamespace(tokenizer=ChatTokenizer(path))
    im_end = 2
    assert classify.label_continuations(kept, None, labels) == [
        kept.tokenizer.encode(label) + [im_end] for label in labels]
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}"
        "{% if m['role'] == 'user' and not loop.last %} (answered){% endif %}\n"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    rewriting = SimpleNamespace(tokenizer=ChatTokenizer(path))
    rewriting.tokenizer.eos_token_ids = frozenset({im_end, 40})
    assert classify.label_continuations(rewriting, None, labels) == [
        rewriting.tokenizer.encode(label) + [im_end] for label in labels]
    # The reply's own end, not the smallest end id, when the template keeps earlier turns.
    kept.tokenizer.eos_token_ids = frozenset({im_end, 1})
    assert classify.label_continuations(kept, None, labels) == [
        kept.tokenizer.encode(label) + [im_end] for label in labels]
