"""Tokenization shared by both engines, so both count and decode tokens identically."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from .beside import run_beside

log = logging.getLogger("duet.engines.tokenizer")


def _gpt2_byte_map() -> dict[str, int]:
    """GPT-2's printable stand-ins for bytes (byte-level BPE vocabularies spell tokens in them),
    character -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF = _gpt2_byte_map()


def piece_bytes(piece: str | None, byte_level: bool) -> bytes | None:
    """A vocabulary entry's bytes where its spelling says them: byte-level BPE's stand-ins, or
    SentencePiece's <0xNN> byte tokens and its ▁ for a space. None: decode the token instead."""
    if piece is None:
        return None
    if byte_level:
        if all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        return None
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            return None
    if "\u2581" in piece:
        return piece.replace("\u2581", " ").encode()
    return None


# The files AutoTokenizer decides a directory's tokenizer class by (with transformers' version).
_DECIDED_BY = ("tokenizer_config.json", "config.json", "tokenizer.json", "special_tokens_map.json",
               "tokenizer.model")


def load_hf_tokenizer(model_dir: Path):
    """transformers' tokenizer for model_dir, of the class AutoTokenizer chose for it.

    AutoTokenizer itself imports transformers' model and generation code, which import torch's
    compiler (and scikit-learn and SciPy where installed): 8 s of an engine process's start on
    an H100 host, where the tokenizer class's own module takes under 2. So its choice is kept
    (DUET_CACHE_DIR/tokenizers, by transformers' version and the files it decides by) and the
    next start builds that class directly, as AutoTokenizer would."""
    import importlib

    import transformers

    record = _choice_record(model_dir, transformers.__version__)
    if record is not None and record.exists():
        try:
            module, name = json.loads(record.read_text())
            return getattr(importlib.import_module(module), name).from_pretrained(str(model_dir))
        except Exception:  # a record of another install: AutoTokenizer decides again
            log.debug("the kept tokenizer class of %s did not load", model_dir, exc_info=True)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    cls = type(tok)
    if record is not None and cls.__module__.startswith("transformers."):  # no remote code
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            partial = record.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(json.dumps([cls.__module__, cls.__name__]))
            partial.replace(record)
        except OSError:  # a read-only cache: AutoTokenizer decides on every start
            log.debug("the tokenizer class of %s could not be kept", model_dir, exc_info=True)
    return tok


def _choice_record(model_dir: Path, version: str) -> Path | None:
    from .models.sources import cache_root

    digest = hashlib.sha256(version.encode())
    try:
        for name in _DECIDED_BY:
            path = model_dir / name
            digest.update(name.encode() + (path.read_bytes() if path.exists() else b"-"))
    except OSError:
        return None
    return cache_root() / "tokenizers" / f"{digest.hexdigest()[:32]}.json"


def import_transformers() -> None:
    """Import the module a ChatTokenizer is most often built and unpickled with, ahead of time
    (transformers' generic fast tokenizer; a class of its own, or AutoTokenizer on a model's
    first start, imports more when it is used)."""
    from transformers import PreTrainedTokenizerFast  # noqa: F401


def build_beside(model_dir: str | Path) -> Callable[[], ChatTokenizer]:
    """Build the model's ChatTokenizer on a thread of its own, beside the caller's load; the
    call returned waits for it (and raises what building it raised). transformers' imports
    for AutoTokenizer are most of its time (10 s on a GPU host: its generation code, and
    scikit-learn where installed), mostly while the load waits on the device or the disk."""
    return run_beside(lambda: ChatTokenizer(model_dir), "tokenizer-build").result


class ChatTokenizer:
    _grammar = None  # llguidance's view of the vocabulary, built on first use (not pickled)

    def __init__(self, model_dir: str | Path):
        self._tok = load_hf_tokenizer(Path(model_dir))
        # The HTTP side encodes while the engine's loop decodes. A Rust tokenizer that one
        # thread reconfigures (truncation, padding) while another reads it fails with "Already
        # borrowed", so every call into it holds this lock (uncontended: ~0.1 us).
        self._lock = threading.Lock()
        self.vocab_size = len(self._tok)
        self.eos_token_ids = self._find_eos_ids(Path(model_dir))
        self.bos_token_id = self._tok.bos_token_id
        self.has_chat_template = bool(getattr(self._tok, "chat_template", None))
        self._byte_level: bool | None = None  # GPT-2's byte-to-character map; found on first use
        # token id -> its name (token_names), filled as logprobs name tokens: a stream asks for
        # six or more a token, and the HTTP side's time per token is what 64 streams of logprobs
        # wait on.
        self._names: dict[int, tuple[str, tuple[int, ...]]] = {}

    def __getstate__(self) -> dict:
        # Sent to the HTTP side when the engine runs in its own process; a lock does not pickle,
        # nor llguidance's vocabulary (the engine's side builds its own).
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_grammar")}

    def grammar_vocabulary(self):
        """llguidance's view of this vocabulary (engines/grammar.py), built once, on first use."""
        with self._lock:
            if self._grammar is None:
                import llguidance.hf

                from .grammar import vocabulary_slices

                eos = sorted(self.eos_token_ids)
                self._grammar = llguidance.hf.from_tokenizer(
                    self._tok, eos_token=eos[0] if len(eos) == 1 else eos,
                    slices=vocabulary_slices())
            return self._grammar

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _find_eos_ids(self, model_dir: Path) -> frozenset[int]:
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

    def describe(self) -> dict:
        """What vLLM's /tokenizer_info tells of a tokenizer: its class, special tokens and chat
        template."""
        tok = self._tok
        template = tok.chat_template if isinstance(tok.chat_template, str) else None
        return {"tokenizer_class": type(tok).__name__, "vocab_size": self.vocab_size,
                "bos_token": tok.bos_token, "bos_token_id": tok.bos_token_id,
                "eos_token": tok.eos_token, "eos_token_id": tok.eos_token_id,
                "eos_token_ids": sorted(self.eos_token_ids), "pad_token": tok.pad_token,
                "chat_template": template}

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template renders `tools` itself (else the server writes them into
        the conversation: server/tool_calls.py)."""
        template = self._tok.chat_template
        if isinstance(template, dict):  # named templates: the default one, or a tool_use one
            return "tool_use" in template or "tools" in str(template.get("default", ""))
        return "tools" in (template or "")

    def apply_chat_template(
        self, messages: Sequence[dict], add_generation_prompt: bool = True,
        tools: Sequence[dict] | None = None,
    ) -> list[int]:
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; use /v1/completions instead")
        with self._lock:
            out = self._tok.apply_chat_template(
                list(messages), add_generation_prompt=add_generation_prompt, tokenize=True,
                return_dict=False, tools=list(tools) if tools else None,
            )
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return [int(t) for t in out]

    def decode(self, ids: Sequence[int]) -> str:
        with self._lock:
            return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_names(self, ids: Sequence[int]) -> list[tuple[str, tuple[int, ...]]]:
        """Each token as OpenAI's logprobs name it: its own bytes decoded (a token may hold
        part of a character: U+FFFD there) and the bytes themselves; kept once made, for every
        request (a request's alternatives are mostly tokens others named before)."""
        known = self._names
        try:
            return [known[i] for i in ids]
        except KeyError:
            pass
        # Only the tokens not named yet: spelling the whole list again on every miss took a
        # third of the HTTP side's time at 64 streams of logprobs (an H100 host, random
        # weights, whose alternatives range over the whole vocabulary).
        new = list(dict.fromkeys(i for i in ids if i not in known))
        known.update(zip(new, ((raw.decode("utf-8", errors="replace"), tuple(raw))
                               for raw in self._spell(new))))
        return [known[i] for i in ids]

    def _spell(self, ids: Sequence[int]) -> list[bytes]:
        with self._lock:
            pieces = self._tok.convert_ids_to_tokens(list(ids))
            if self._byte_level is None:
                decoder = self._tok.backend_tokenizer.decoder if self._tok.is_fast else None
                self._byte_level = decoder is not None and "ByteLevel" in repr(decoder)
            out = []
            for token_id, piece in zip(ids, pieces):
                out.append(piece_bytes(piece, self._byte_level)
                           or self._tok.decode([token_id]).encode())
            return out

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
