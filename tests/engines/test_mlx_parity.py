"""The MLX engine (mlx-lm on MLX's CPU backend here) against the PyTorch engine."""

import numpy as np
import pytest

pytest.importorskip("mlx_lm", reason="the mlx extra is installed by scripts/setup.sh")

from engines.base import RequestStats, SamplingParams, Step  # noqa: E402
from engines.mlx_engine import MLXEngine  # noqa: E402
from engines.torch_engine import TorchEngine  # noqa: E402
from tests.tiny_models import FAMILIES  # noqa: E402

PROMPT = [5, 70, 80, 90, 33, 44, 55, 66, 120, 7, 200]


@pytest.mark.parametrize("family", FAMILIES)
def test_mlx_logits_match_torch_engine(tiny_dirs, family):
    path, _ = tiny_dirs[family]
    mlx_engine = MLXEngine(path, context_length=128, dtype="float32")
    torch_engine = TorchEngine(path, context_length=128, dtype="float32", device="cpu")
    prompt = PROMPT
    if family == "mistral_window":
        # mlx-lm attends over the whole cache: the engine serves no more than the window of 4
        # tokens, within which that is the same attention.
        assert mlx_engine.context_length == mlx_engine.info.context_length == 4
        prompt = PROMPT[:4]
    np.testing.assert_allclose(
        mlx_engine.logits(prompt), torch_engine.logits(prompt), atol=1e-4, rtol=1e-4
    )


def test_mlx_greedy_tokens_match_torch_and_report_stats(tiny_dirs):
    path, _ = tiny_dirs["llama"]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    runs = {}
    for engine in (
        MLXEngine(path, context_length=128, dtype="float32"),
        TorchEngine(path, context_length=128, dtype="float32", device="cpu"),
    ):
        events = list(engine.generate(PROMPT, params))
        stats = events[-1]
        assert isinstance(stats, RequestStats)
        assert stats.engine == engine.name and stats.completion_tokens == 10
        assert stats.prompt_tokens == len(PROMPT) and stats.finish_reason == "length"
        assert stats.kv_cache_bytes > 0 and stats.peak_memory_bytes > 0
        assert stats.decode_tokens_per_s > 0 and stats.ttft_s > 0
        runs[engine.name] = [e.token_id for e in events if isinstance(e, Step) and e.finish_reason is None]
    assert runs["mlx"] == runs["torch"]
