"""A deterministic engine without any backend, for fast server tests.

Tokens are UTF-8 bytes (so multi-byte characters really do arrive split over tokens), the
reply is scripted, and a per-token delay lets tests observe queuing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from .base import EngineInfo, SamplingParams
from .generation import MemoryMeter, TokenLoopEngine

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


class FakeEngine(TokenLoopEngine):
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
        self.device = "cpu"
        self._meter = MemoryMeter()
        self.info = EngineInfo(
            engine=name, device="cpu", dtype="none", context_length=context_length,
            backend_version="fake 0",
        )

    def _token_ids(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[int]:
        self.calls.append(list(prompt_ids))
        request_no = len(self.calls) - 1
        for token in [*self.tokenizer.encode(self.reply), EOS]:
            if self.token_delay_s:
                time.sleep(self.token_delay_s)
            self.trace.append((request_no, token))
            yield token

    def logits(self, prompt_ids: Sequence[int]):
        import numpy as np

        return np.zeros((len(prompt_ids), self.tokenizer.vocab_size), dtype=np.float32)

    def close(self) -> None:
        pass
