"""The torch engine of an embed model: our BERT encoder behind engines/embed.py's Embedder."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..bert_config import read_bert_shape
from ..device import choose_device, choose_dtype, memory_meter, torch_dtype
from ..embed import Embedder
from ..embed_tokenizer import EmbedTokenizer
from ..sentence_config import read_sentence_config
from .bert import TorchBert

log = logging.getLogger("duet.engines.torch")


def torch_embedder(model_dir: str | Path, *, context_length: int, dtype: str = "auto",
                   device: str = "auto", **_ignored) -> Embedder:
    """An input keeps at most context_length tokens, and never more than the model's
    max_seq_length (sentence_bert_config.json) or its positions."""
    model_dir = Path(model_dir)
    shape = read_bert_shape(model_dir)
    sentence = read_sentence_config(model_dir, shape.max_positions)
    device = choose_device(device)
    dtype = choose_dtype(dtype, device)
    encoder = TorchBert(model_dir, shape, device, torch_dtype(dtype))
    tokenizer = EmbedTokenizer(model_dir, min(context_length, sentence.max_tokens),
                               sentence.lower_case)
    log.info("embed model %s loaded on %s (%s): %d dimensions, %s pooling%s", model_dir,
             device, dtype, shape.hidden_size, sentence.pooling,
             ", normalised" if sentence.normalize else "")
    embedder = Embedder("torch", encoder, tokenizer, sentence, vocab_size=shape.vocab_size,
                        device=device, dtype=dtype, backend_version=f"torch {torch.__version__}",
                        meter=memory_meter(device))
    embedder.warm_up()
    return embedder
