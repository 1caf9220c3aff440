"""An embed model's inputs as the token ids its encoder reads.

Texts go through the model's own tokenizer as sentence-transformers sends them: stripped,
lowercased when sentence_bert_config.json says so, with the special tokens ([CLS] ... [SEP])
and truncated to max_tokens. Token-id inputs are a text's tokens without special tokens (what
the tokenizer writes for it with add_special_tokens=False); they get the same frame and the
same truncation, so a text and its ids embed alike."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .base import UnsupportedModel
from .tokenizer import load_hf_tokenizer

_PROBE = "a"


class EmbedTokenizer:
    def __init__(self, model_dir: Path, max_tokens: int, lower_case: bool = False):
        self._tok = load_hf_tokenizer(Path(model_dir))
        self.lower_case = lower_case
        self.pad_id = self._tok.pad_token_id if self._tok.pad_token_id is not None else 0
        self.prefix, self.suffix = self._frame()
        if max_tokens <= len(self.prefix) + len(self.suffix):
            raise UnsupportedModel(f"max_tokens {max_tokens} leaves no room for a text")
        self.max_tokens = max_tokens

    def _frame(self) -> tuple[list[int], list[int]]:
        """The special tokens the tokenizer puts before and after a text's own tokens."""
        bare = self._tok(_PROBE, add_special_tokens=False)["input_ids"]
        framed = self._tok(_PROBE, add_special_tokens=True)["input_ids"]
        n = len(bare)
        at = [i for i in range(len(framed) - n + 1) if framed[i:i + n] == bare]
        if n == 0 or len(at) != 1:
            raise UnsupportedModel("cannot tell which special tokens the tokenizer adds")
        return framed[:at[0]], framed[at[0] + n:]

    def encode_texts(self, texts: Sequence[str]) -> list[list[int]]:
        texts = [t.strip().lower() if self.lower_case else t.strip() for t in texts]
        return self._tok(texts, add_special_tokens=True, truncation=True,
                         max_length=self.max_tokens)["input_ids"]

    def frame_ids(self, ids: Sequence[int]) -> list[int]:
        room = self.max_tokens - len(self.prefix) - len(self.suffix)
        return [*self.prefix, *ids[:room], *self.suffix]

    def encode(self, inputs: Sequence[str | Sequence[int]]) -> list[list[int]]:
        """Every input's ids, in order; the texts are tokenized in one call."""
        text_at = [i for i, x in enumerate(inputs) if isinstance(x, str)]
        out: list[list[int]] = [[] for _ in inputs]
        for i, ids in zip(text_at, self.encode_texts([inputs[i] for i in text_at])
                          if text_at else []):
            out[i] = list(ids)
        for i, x in enumerate(inputs):
            if not isinstance(x, str):
                out[i] = self.frame_ids(x)
        return out
