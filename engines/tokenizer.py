"""Tokenization shared by both engines, so both count and decode tokens identically."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path


class ChatTokenizer:
    def __init__(self, model_dir: str | Path):
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(str(model_dir))
        # The HTTP side encodes while the engine's loop decodes. A Rust tokenizer that one
        # thread reconfigures (truncation, padding) while another reads it fails with "Already
        # borrowed", so every call into it holds this lock (uncontended: ~0.1 us).
        self._lock = threading.Lock()
        self.vocab_size = len(self._tok)
        self.eos_token_ids = self._find_eos_ids(Path(model_dir))
        self.bos_token_id = self._tok.bos_token_id
        self.has_chat_template = bool(getattr(self._tok, "chat_template", None))

    def __getstate__(self) -> dict:
        # Sent to the HTTP side when the engine runs in its own process; a lock does not pickle.
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _find_eos_ids(self, model_dir: Path) -> frozenset[int]:
        import json

        ids: set[int] = set()
        if self._tok.eos_token_id is not None:
            ids.add(self._tok.eos_token_id)
        # Llama 3 and others list several end tokens in the generation config or config.
        for name in ("generation_config.json", "config.json"):
            path = model_dir / name
            if path.exists():
                value = json.loads(path.read_text()).get("eos_token_id")
                if isinstance(value, int):
                    ids.add(value)
                elif isinstance(value, list):
                    ids.update(int(v) for v in value)
        return frozenset(ids)

    def encode(self, text: str) -> list[int]:
        with self._lock:
            return list(self._tok.encode(text, add_special_tokens=False))

    def encode_prompt(self, text: str) -> list[int]:
        """A raw completion prompt: the model's BOS token, when it uses one, then the text."""
        with self._lock:
            return list(self._tok.encode(text, add_special_tokens=True))

    def apply_chat_template(
        self, messages: Sequence[dict], add_generation_prompt: bool = True
    ) -> list[int]:
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; use /v1/completions instead")
        with self._lock:
            out = self._tok.apply_chat_template(
                list(messages), add_generation_prompt=add_generation_prompt, tokenize=True,
                return_dict=False,
            )
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return [int(t) for t in out]

    def decode(self, ids: Sequence[int]) -> str:
        with self._lock:
            return self._tok.decode(list(ids), skip_special_tokens=True)

    def decode_stream(self) -> Callable[[int], str | None] | None:
        """A token-at-a-time decoder in Rust (tokenizers' DecodeStream: ~1.5 us a token
        against ~10 for two windowed decodes), or None where it would not give decode()'s text:
        no Rust tokenizer, or transformers' space clean-up on top of it."""
        rust = getattr(self._tok, "_tokenizer", None)
        if rust is None or getattr(self._tok, "clean_up_tokenization_spaces", False):
            return None
        try:
            from tokenizers.decoders import DecodeStream
        except ImportError:
            return None
        stream = DecodeStream(skip_special_tokens=True)

        def step(token_id: int) -> str | None:
            with self._lock:
                return stream.step(rust, token_id)

        return step


class IncrementalDetokenizer:
    """Turns token ids into text deltas that never end inside a UTF-8 character.

    Byte-level BPE splits one emoji or CJK character over several tokens; decoding each token
    alone gives U+FFFD. We decode a short window and only release text once it is complete,
    the way vLLM and TGI do (prefix/read offsets).
    """

    def __init__(self, tokenizer: ChatTokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        # The Rust stream does the same windowing natively; flush() still uses the windows.
        stream = getattr(tokenizer, "decode_stream", None)
        self._stream = stream() if stream is not None else None

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        if self._stream is not None:
            text = self._stream(token_id)
            if text:
                self._prefix, self._read = len(self._ids) - 1, len(self._ids)
            return text or ""
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        full_text = self._tok.decode(self._ids[self._prefix :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text) :]
            self._prefix = self._read
            self._read = len(self._ids)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back when generation ends (an incomplete character)."""
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        full_text = self._tok.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return full_text[len(prefix_text) :]


class StopMatcher:
    """Withholds text that could be the start of a stop string, so a stop is never emitted,
    even when it arrives split over several tokens."""

    def __init__(self, stops: Sequence[str]):
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def feed(self, text: str, final: bool = False) -> str:
        if not self._stops:
            return text
        buf = self._held + text
        cut = min((i for i in (buf.find(s) for s in self._stops) if i >= 0), default=-1)
        # Where the earliest stop that may still complete begins: a complete stop only wins
        # once no other stop starting before it can still arrive.
        pending = len(buf) if final else len(buf) - self._longest_partial(buf)
        if 0 <= cut <= pending:
            self._held = ""
            self.stopped = True
            return buf[:cut]
        self._held = buf[pending:]
        return buf[:pending]

    def flush(self) -> str:
        """The end of the text: release what was held back, up to a stop if one completed."""
        return self.feed("", final=True)

    def _longest_partial(self, buf: str) -> int:
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best
