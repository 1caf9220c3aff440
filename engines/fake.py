"""A deterministic engine without any backend, for fast server tests.

Tokens are UTF-8 bytes (so multi-byte characters really do arrive split over tokens), the
reply is scripted, and a per-token delay lets tests observe queuing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

from .base import ContextLengthExceeded, EngineInfo, GenerationEvent, SamplingParams
from .generation import MemoryMeter, stream_steps

EOS = 256


class ByteTokenizer:
    eos_token_ids = frozenset({EOS})
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    encode_prompt = encode

    def apply_chat_template(self, messages: Sequence[dict]) -> list[int]:
        text = "".join(f"<{m['role']}>{m.get('content') or ''}\n" for m in messages)
        return self.encode(text + "<assistant>")

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class FakeEngine:
    def __init__(
        self,
        name: str = "fake",
        *,
        reply: str = "Hello from the fake engine! 你好 🙂",
        context_length: int = 512,
        token_delay_s: float = 0.0,
        trace: list | None = None,
    ):
        self.name = name
        self.reply = reply
        self.context_length = context_length
        self.token_delay_s = token_delay_s
        self.tokenizer = ByteTokenizer()
        self.calls: list[list[int]] = []
        # (request number, token) in the order tokens were produced, to check for interleaving.
        self.trace = trace if trace is not None else []
        self.info = EngineInfo(
            engine=name, device="cpu", dtype="none", context_length=context_length,
            backend_version="fake 0",
        )

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def apply_chat_template(self, messages: Sequence[dict]) -> list[int]:
        return self.tokenizer.apply_chat_template(messages)

    def _token_ids(self, request_no: int) -> Iterator[int]:
        for token in [*self.tokenizer.encode(self.reply), EOS]:
            if self.token_delay_s:
                time.sleep(self.token_delay_s)
            self.trace.append((request_no, token))
            yield token

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        should_stop: Callable[[], bool] | None = None,
    ) -> Iterator[GenerationEvent]:
        if len(prompt_ids) + params.max_tokens > self.context_length:
            raise ContextLengthExceeded(len(prompt_ids), params.max_tokens, self.context_length)
        self.calls.append(list(prompt_ids))
        return stream_steps(
            self._token_ids(len(self.calls) - 1),
            tokenizer=self.tokenizer,
            params=params,
            prompt_tokens=len(prompt_ids),
            engine=self.name,
            device="cpu",
            meter=MemoryMeter(),
            kv_cache_bytes=lambda: 0,
            should_stop=should_stop,
        )

    def logits(self, prompt_ids: Sequence[int]):
        import numpy as np

        return np.zeros((len(prompt_ids), self.tokenizer.vocab_size), dtype=np.float32)

    def close(self) -> None:
        pass
