"""A deterministic engine without any backend, for fast server tests.

Tokens are UTF-8 bytes (so multi-byte characters really do arrive split over tokens), the
reply is scripted, and a per-token delay lets tests observe queuing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence

from .base import (
    ClassificationResult,
    ClassifyParams,
    ContinuationScores,
    EngineInfo,
    InputClassification,
    LabelScore,
    RequestStats,
    SamplingParams,
    check_stop,
)
from .generation import MemoryMeter, TokenLoopEngine

EOS = 256


class ByteTokenizer:
    eos_token_ids = frozenset({EOS})
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    encode_prompt = encode

    def apply_chat_template(
        self, messages: Sequence[dict], add_generation_prompt: bool = True
    ) -> list[int]:
        text = "".join(f"<{m['role']}>{m.get('content') or ''}\n" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class FixedMeter(MemoryMeter):
    """Reports a set peak, so tests can follow the figure from the engine to the response."""

    def __init__(self, peak: int) -> None:
        self.peak = peak

    def peak_bytes(self) -> int:
        return self.peak


class FakeEngine(TokenLoopEngine):
    def __init__(
        self,
        name: str = "fake",
        *,
        reply: str = "Hello from the fake engine! 你好 🙂",
        context_length: int = 512,
        token_delay_s: float = 0.0,
        trace: list | None = None,
        peak_memory_bytes: int = 0,
        kv_bytes_per_token: int = 0,
    ):
        self.name = name
        self.reply = reply
        self.context_length = context_length
        self.token_delay_s = token_delay_s
        self.tokenizer = ByteTokenizer()
        self.calls: list[list[int]] = []
        # (request number, token) in the order tokens were produced, to check for interleaving.
        self.trace = trace if trace is not None else []
        self.device = "cpu"
        self._meter = FixedMeter(peak_memory_bytes)
        self.kv_bytes_per_token = kv_bytes_per_token
        self._cached_tokens = 0
        self.info = EngineInfo(
            engine=name, device="cpu", dtype="none", context_length=context_length,
            backend_version="fake 0",
        )

    def _token_ids(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[int]:
        self.calls.append(list(prompt_ids))
        request_no = len(self.calls) - 1
        self._cached_tokens = len(prompt_ids)
        for token in [*self.tokenizer.encode(self.reply), EOS]:
            if self.token_delay_s:
                time.sleep(self.token_delay_s)
            self.trace.append((request_no, token))
            self._cached_tokens += 1
            yield token

    def _kv_cache_bytes(self) -> int:
        return self.kv_bytes_per_token * self._cached_tokens

    def score_continuations(self, prompts, continuations, should_stop=None) -> ContinuationScores:
        """Every token costs -1; a continuation gains 3 for each time its text (its bytes up
        to the newline the template adds) occurs in the prompt, on its first token. So a label
        named in the text wins, and the label list every prompt carries calibrates away."""
        out = []
        for n, prompt in enumerate(prompts):
            check_stop(should_stop)
            self.calls.append(list(prompt))
            if self.token_delay_s:
                time.sleep(self.token_delay_s)
            self.trace.append((len(self.calls) - 1, "score"))
            text = bytes(prompt).decode("utf-8", errors="replace")
            rows = []
            for cont in continuations:
                label = bytes(t for t in cont if t < 256).decode("utf-8", "replace").strip()
                bonus = 3.0 * text.count(label) if label else 0.0
                rows.append(tuple([-1.0 + bonus] + [-1.0] * (len(cont) - 1)))
            out.append(tuple(rows))
        return ContinuationScores(tuple(out), prefill_s=1e-3, score_s=1e-3)

    def logits(self, prompt_ids: Sequence[int]):
        import numpy as np

        return np.zeros((len(prompt_ids), self.tokenizer.vocab_size), dtype=np.float32)

    def close(self) -> None:
        pass


class FakeClassifier:
    """A stand-in for a sequence-classification checkpoint: texts with a '!' are 'positive'
    with probability 0.9, the rest 'negative' with 0.8."""

    labels = ("negative", "positive")

    def __init__(self, name: str = "torch"):
        self.name = name
        self.calls: list[ClassifyParams] = []
        self.info = EngineInfo(engine=name, device="cpu", dtype="none", context_length=512,
                               backend_version="fake 0", extra={"task": "classify"})

    def classify(self, params: ClassifyParams, should_stop=None) -> ClassificationResult:
        check_stop(should_stop)
        self.calls.append(params)
        results = []
        for text in params.inputs:
            p_pos = 0.9 if "!" in text else 0.2
            probs = (1.0 - p_pos, p_pos)
            scores = tuple(LabelScore(l, p, math.log(p)) for l, p in zip(self.labels, probs))
            results.append(InputClassification(self.labels[probs.index(max(probs))], scores))
        tokens = sum(len(t.encode()) for t in params.inputs)
        stats = RequestStats(
            prompt_tokens=tokens, completion_tokens=0, ttft_s=1e-3, prefill_tokens_per_s=tokens / 1e-3,
            decode_tokens_per_s=0.0, peak_memory_bytes=1, kv_cache_bytes=0, engine=self.name,
            device="cpu", finish_reason="stop", total_s=1e-3,
        )
        return ClassificationResult(tuple(results), stats)

    def close(self) -> None:
        pass
