"""A deterministic engine without any backend, for fast server tests.

Tokens are UTF-8 bytes (so multi-byte characters really do arrive split over tokens), the
reply is scripted, and a per-token delay lets tests observe queuing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np

from .base import (
    ClassificationResult,
    ClassifyParams,
    ContinuationScores,
    EmbeddingResult,
    EmbedParams,
    EngineInfo,
    InputClassification,
    LabelScore,
    RequestStats,
    TokenLogprobs,
    check_stop,
)
from .generation import GenerationEngine, MemoryMeter
from .runtime.kv import BlockPool
from .runtime.plan import ExecutorTraits, StepOutput, StepPlan

EOS = 256


class ByteTokenizer:
    eos_token_ids = frozenset({EOS})
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    encode_prompt = encode

    template_takes_tools = False
    has_chat_template = True
    _grammar = None  # llguidance's view of the vocabulary, built on first use (not pickled)

    def describe(self) -> dict:
        return {"tokenizer_class": "ByteTokenizer", "vocab_size": self.vocab_size,
                "eos_token_id": EOS, "eos_token_ids": [EOS], "chat_template": None}

    def apply_chat_template(
        self, messages: Sequence[dict], add_generation_prompt: bool = True,
        tools: Sequence[dict] | None = None,
    ) -> list[int]:
        text = "".join(f"<{m['role']}>{m.get('content') or ''}\n" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    @staticmethod
    def token_names(ids: Sequence[int]) -> list[tuple[str, tuple[int, ...]]]:
        spelled = (bytes([i]) if i < 256 else b"" for i in ids)
        return [(raw.decode("utf-8", errors="replace"), tuple(raw)) for raw in spelled]

    def grammar_vocabulary(self):
        from .grammar import byte_vocabulary

        if self._grammar is None:
            self._grammar = byte_vocabulary([bytes([i]) for i in range(256)] + [b"<eos>"], EOS)
        return self._grammar

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_grammar"}


class FixedMeter(MemoryMeter):
    """Reports a set peak, so tests can follow the figure from the engine to the response."""

    def __init__(self, peak: int) -> None:
        self.peak = peak

    def peak_bytes(self) -> int:
        return self.peak


class FakeEngine(GenerationEngine):
    """Each sequence's reply is the script's bytes then EOS. A step takes token_delay_s
    however many sequences it carries, as a batched step would."""

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
        max_batch: int = 1,
        kv_tokens: int | None = None,
        max_prefill_tokens: int | None = None,
        threaded_output: bool = False,
    ):
        """threaded_output: the runtime delivers the requests' output on a thread of its own,
        as it does for the MLX engine."""
        self.name = name
        self.threaded_output = threaded_output
        self.reply = reply
        self.context_length = context_length
        self.token_delay_s = token_delay_s
        self.tokenizer = ByteTokenizer()
        self.calls: list[list[int]] = []
        # (request number, token) in the order tokens were produced, to check for interleaving.
        self.trace = trace if trace is not None else []
        self.device = "cpu"
        self.meter = FixedMeter(peak_memory_bytes)
        self.steps: list[int] = []  # how many rows each step carried
        tokens = kv_tokens if kv_tokens is not None else max_batch * context_length
        self.init_runtime(BlockPool(-(-tokens // 16), 16, kv_bytes_per_token),
                          max_batch=max_batch, max_prefill_tokens=max_prefill_tokens or 512)
        self.info = EngineInfo(
            engine=name, device="cpu", dtype="none", context_length=context_length,
            backend_version="fake 0",
        )

    def executor(self, *, prefix_cache: bool = False) -> FakeExecutor:
        return FakeExecutor(self)

    def script(self, prompt_ids: Sequence[int]) -> list[int]:
        """The tokens a sequence with this prompt is given, in order."""
        return [*self.tokenizer.encode(self.reply), EOS]

    def before_token(self, request_no: int, index: int) -> None:
        """Called before a sequence's index-th token; tests raise here to fail a step."""

    def ended(self, request_no: int, tokens: int) -> None:
        """Called when the runtime lets a sequence go, with how many tokens it was given."""

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


def fake_logprobs(token: int, k: int) -> TokenLogprobs:
    """The scripted token is the likeliest at log(1/2); the next byte values follow, each half
    as likely as the one before."""
    top = tuple(((token + i) % 256, math.log(0.5 ** (i + 1))) for i in range(k))
    return TokenLogprobs(math.log(0.5), top)


class FakeExecutor:
    def __init__(self, engine: FakeEngine):
        self.engine = engine
        self.traits = ExecutorTraits(output_thread=engine.threaded_output)
        self._request_no: dict[int, int] = {}
        self._script: dict[int, list[int]] = {}
        self._made: dict[int, int] = {}

    def launch(self, plan: StepPlan) -> StepOutput:
        e = self.engine
        self.release(plan.released)
        for row in plan.rows:
            if row.seq_id not in self._request_no:
                e.calls.append(list(row.tokens))
                self._request_no[row.seq_id] = len(e.calls) - 1
                self._script[row.seq_id] = e.script(row.tokens)
        if not plan.rows:
            return StepOutput({})
        e.steps.append(len(plan.rows))
        if e.token_delay_s:
            time.sleep(e.token_delay_s)
        out, scored = {}, {}
        for row in plan.rows:
            if row.sample:
                e.before_token(self._request_no[row.seq_id], row.draws)
                script = self._script[row.seq_id]
                token = script[min(row.draws, len(script) - 1)]
                e.trace.append((self._request_no[row.seq_id], token))
                self._made[row.seq_id] = row.draws + 1
                out[row.seq_id] = token
                if row.sampling.logprobs is not None:
                    scored[row.seq_id] = fake_logprobs(token, row.sampling.logprobs)
        return StepOutput(out, scored)

    @staticmethod
    def collect(output: StepOutput) -> StepOutput:
        return output

    def close(self) -> None:
        pass

    def release(self, seq_ids) -> None:
        for seq_id in seq_ids:
            if seq_id in self._request_no:
                self.engine.ended(self._request_no.pop(seq_id), self._made.pop(seq_id, 0))
                self._script.pop(seq_id, None)


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


class FakeEmbedder:
    """A stand-in for an embed model: tokens are UTF-8 bytes framed by 256 and 257 (a [CLS]
    and a [SEP]), at most max_tokens of them; a vector is the normalised count of each byte
    value modulo the dimension, plus one, so that the same text always gets the same vector."""

    vocab_size = 258

    def __init__(self, name: str = "torch", dimension: int = 8, max_tokens: int = 16):
        self.name = name
        self.dimension = dimension
        self.max_tokens = max_tokens
        self.calls: list[EmbedParams] = []
        self.info = EngineInfo(engine=name, device="cpu", dtype="none",
                               context_length=max_tokens, backend_version="fake 0",
                               extra={"task": "embed"})

    def tokens(self, x: str | Sequence[int]) -> list[int]:
        ids = list(x.encode("utf-8")) if isinstance(x, str) else list(x)
        return [256, *ids[: self.max_tokens - 2], 257]

    def vector(self, tokens: Sequence[int]) -> list[float]:
        counts = [1.0] * self.dimension
        for t in tokens:
            counts[t % self.dimension] += 1.0
        norm = math.sqrt(sum(c * c for c in counts))
        return [c / norm for c in counts]

    def embed(self, params: EmbedParams, should_stop=None) -> EmbeddingResult:
        check_stop(should_stop)
        self.calls.append(params)
        tokens = [self.tokens(x) for x in params.inputs]
        vectors = np.array([self.vector(t) for t in tokens], dtype=np.float32)
        n = sum(len(t) for t in tokens)
        stats = RequestStats(
            prompt_tokens=n, completion_tokens=0, ttft_s=1e-3, prefill_tokens_per_s=n / 1e-3,
            decode_tokens_per_s=0.0, peak_memory_bytes=1, kv_cache_bytes=0, engine=self.name,
            device="cpu", finish_reason="stop", total_s=1e-3,
        )
        return EmbeddingResult(vectors, tuple(len(t) for t in tokens), True, stats)

    def close(self) -> None:
        pass
