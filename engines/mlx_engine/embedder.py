"""The MLX engine of an embed model: our BERT encoder behind engines/embed.py's Embedder."""

from __future__ import annotations

import logging
from pathlib import Path

import mlx.core as mx

from ..bert_config import read_bert_shape
from ..embed import Embedder
from ..embed_tokenizer import EmbedTokenizer
from ..sentence_config import read_sentence_config
from .bert import MLXBert
from .engine import _MX_DTYPES, MLXMeter, choose_mlx_dtype, mlx_device

log = logging.getLogger("duet.engines.mlx")


def mlx_embedder(model_dir: str | Path, *, context_length: int, dtype: str = "auto",
                 **_ignored) -> Embedder:
    """An input keeps at most context_length tokens, and never more than the model's
    max_seq_length (sentence_bert_config.json) or its positions."""
    model_dir = Path(model_dir)
    shape = read_bert_shape(model_dir)
    sentence = read_sentence_config(model_dir, shape.max_positions)
    device = mlx_device()
    dtype = choose_mlx_dtype(dtype, device)
    encoder = MLXBert(model_dir, shape, _MX_DTYPES[dtype])
    tokenizer = EmbedTokenizer(model_dir, min(context_length, sentence.max_tokens),
                               sentence.lower_case)
    log.info("embed model %s loaded on MLX %s (%s): %d dimensions, %s pooling%s", model_dir,
             device, dtype, shape.hidden_size, sentence.pooling,
             ", normalised" if sentence.normalize else "")
    embedder = Embedder("mlx", encoder, tokenizer, sentence, vocab_size=shape.vocab_size,
                        device=device, dtype=dtype, backend_version=f"mlx {mx.__version__}",
                        meter=MLXMeter())
    embedder.warm_up()
    return embedder
