"""Sentence embeddings, the same on every engine: tokenize, batch, encode, pool, normalise.

An engine supplies only an Encoder (the BERT forward pass, engines/torch_engine/bert.py or
engines/mlx_engine/bert.py); the Embedder here is the engine the server calls. Inputs are
sorted longest first and run in batches padded to their longest row (an attention mask keeps
the padding out), each batch sized from the speed measured so far to take about
BATCH_SECONDS (larger batches run faster on a CPU), with the caller's stop flag asked between
two batches. Pooling and normalisation run in float32
numpy, whatever the encoder's dtype. One request runs at a time: a lock keeps calls from
several threads from interleaving.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from .base import (
    EmbeddingResult,
    EmbedParams,
    EngineInfo,
    RequestStats,
    StopCheck,
    check_stop,
)
from .bert_config import BertShape, read_bert_shape
from .classify import Pacer
from .embed_tokenizer import EmbedTokenizer
from .generation import MemoryMeter
from .sentence_config import Pooling, SentenceConfig, read_sentence_config

log = logging.getLogger("duet.engines.embed")

# Padded tokens in the first batch, before any speed is known, and in any batch at most.
BATCH_TOKENS_FIRST = 256
BATCH_TOKENS_MAX = 16384
BATCH_ROWS_MAX = 256
BATCH_SECONDS = 0.5


class Encoder(Protocol):
    """A BERT forward pass: token ids and their attention mask (1 = a token, 0 = padding),
    both int [batch, tokens], to the last layer's states, float32 numpy [batch, tokens,
    hidden]."""

    hidden_size: int

    def hidden_states(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray: ...


def pool(states: np.ndarray, mask: np.ndarray, mode: Pooling) -> np.ndarray:
    """One vector per row: the first token's state ('cls') or the mean of the states of its
    tokens, padding left out ('mean', as sentence-transformers computes it)."""
    if mode == "cls":
        return states[:, 0].astype(np.float32)
    weights = mask.astype(np.float32)[:, :, None]
    summed = (states * weights).sum(axis=1, dtype=np.float32)
    return summed / np.maximum(weights.sum(axis=1), 1e-9)


def l2_normalize(vectors: np.ndarray) -> np.ndarray:
    """Each row scaled to length 1 (a zero row stays zero), as torch's F.normalize does."""
    norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
    return (vectors / np.maximum(norms, 1e-12)).astype(np.float32)


def padded(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded ids and their mask, int64 [len(rows), longest]."""
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
        mask[i, :len(r)] = 1
    return ids, mask


class Embedder:
    """The engine of an embed model (engines.base.Embedder)."""

    def __init__(self, name: str, encoder: Encoder, tokenizer: EmbedTokenizer,
                 sentence: SentenceConfig, *, vocab_size: int, device: str, dtype: str,
                 backend_version: str, meter: MemoryMeter):
        self.name = name
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.sentence = sentence
        self.dimension = encoder.hidden_size
        self.vocab_size = vocab_size
        self.max_tokens = tokenizer.max_tokens
        self.device = device
        self.meter = meter
        self._lock = threading.Lock()
        self.info = EngineInfo(
            engine=name, device=device, dtype=dtype, context_length=self.max_tokens,
            backend_version=backend_version,
            extra={"task": "embed", "dimension": str(self.dimension),
                   "pooling": sentence.pooling, "normalize": str(sentence.normalize).lower()},
        )

    def warm_up(self) -> float:
        """Embed one short text, so that the first request does not pay for lazy set-up (the
        backend's first run is several times slower). Returns seconds taken."""
        started = time.perf_counter()
        self.embed(EmbedParams(("Hello, world",)))
        return time.perf_counter() - started

    def embed(self, params: EmbedParams, should_stop: StopCheck | None = None
              ) -> EmbeddingResult:
        with self._lock:
            return self._embed(params, should_stop)

    def _embed(self, params: EmbedParams, should_stop: StopCheck | None) -> EmbeddingResult:
        start = time.perf_counter()
        self.meter.reset()
        ids = self.tokenizer.encode(params.inputs)
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        out = np.empty((len(ids), self.dimension), dtype=np.float32)
        pacer = Pacer(BATCH_TOKENS_FIRST, BATCH_TOKENS_MAX, BATCH_SECONDS)
        at = 0
        while at < len(order):
            check_stop(should_stop)
            width = len(ids[order[at]])  # the longest left: rows are sorted longest first
            rows = order[at:at + max(1, min(BATCH_ROWS_MAX, pacer.size // width))]
            batch, mask = padded([ids[i] for i in rows], self.tokenizer.pad_id)
            with pacer.piece(batch.size):
                states = self.encoder.hidden_states(batch, mask)
            self.meter.sample()
            vectors = pool(np.asarray(states, dtype=np.float32), mask, self.sentence.pooling)
            out[rows] = l2_normalize(vectors) if self.sentence.normalize else vectors
            at += len(rows)
        total = time.perf_counter() - start
        tokens = tuple(len(x) for x in ids)
        n = sum(tokens)
        stats = RequestStats(
            prompt_tokens=n, completion_tokens=0, ttft_s=total,
            prefill_tokens_per_s=n / total if total > 0 else 0.0, decode_tokens_per_s=0.0,
            peak_memory_bytes=self.meter.peak_bytes(), kv_cache_bytes=0, engine=self.name,
            device=self.device, finish_reason="stop", total_s=total,
        )
        return EmbeddingResult(out, tokens, self.sentence.normalize, stats)

    def close(self) -> None:
        self.encoder = None


def load_embedder(name: str, model_dir: str | Path, *, context_length: int, device: str,
                  dtype: str, backend_version: str, meter: MemoryMeter,
                  encoder: Callable[[Path, BertShape], Encoder]) -> Embedder:
    """An engine's Embedder for the model in model_dir, warmed up; encoder(model_dir, shape)
    makes the engine's BERT. An input keeps at most context_length tokens, and never more than
    the model's max_seq_length (sentence_bert_config.json) or its positions."""
    model_dir = Path(model_dir)
    shape = read_bert_shape(model_dir)
    sentence = read_sentence_config(model_dir, shape.max_positions)
    tokenizer = EmbedTokenizer(model_dir, min(context_length, sentence.max_tokens),
                               sentence.lower_case)
    log.info("embed model %s loaded on %s %s (%s): %d dimensions, %s pooling%s", model_dir,
             name, device, dtype, shape.hidden_size, sentence.pooling,
             ", normalised" if sentence.normalize else "")
    embedder = Embedder(name, encoder(model_dir, shape), tokenizer, sentence,
                        vocab_size=shape.vocab_size, device=device, dtype=dtype,
                        backend_version=backend_version, meter=meter)
    embedder.warm_up()
    return embedder
