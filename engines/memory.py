"""What a model takes in memory, before and after it loads: its weights and its KV cache.

The server's memory budget (server/registry.py) is checked against the estimate before a load
and kept with what the engine reports once loaded (EngineInfo.weights_bytes, kv_cache_bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

from .quantization import Quantization

_FLOAT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Estimate:
    """A model's memory on an engine, before loading it."""

    weights_bytes: int
    kv_bytes_per_token: int
    context_length: int

    @property
    def smallest_bytes(self) -> int:
        """Weights and one full context: the least it can serve with."""
        return self.weights_bytes + self.kv_bytes_per_token * self.context_length


def kv_bytes_per_token(cfg: dict, dtype: str) -> int:
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * _FLOAT_BYTES.get(dtype, 2)


def weights_bytes(cfg: dict, dtype: str, quant: Quantization | None, ranks: int = 1) -> int:
    """A Llama-family model's weights in dtype, its linear layers in quant's format (with
    their scales); the embedding stays in dtype, and an int4 model's head is int8. ranks > 1:
    one rank's of a tensor-parallel split (its share of the layers, the embedding and the
    head whole)."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    vocab, layers = cfg["vocab_size"], cfg["num_hidden_layers"]
    per_layer = (hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
                 + 3 * hidden * inter)
    size = _FLOAT_BYTES.get(dtype, 2)
    embed = vocab * hidden * size
    tied = cfg.get("tie_word_embeddings", False)
    if quant is None:
        return embed + layers * per_layer * size // ranks + (0 if tied else vocab * hidden * size)
    body = {"int8": 1.0, "fp8": 1.0, "int4": 0.5 + 4 / quant.group_size}[quant.format]
    head = 1.0 if quant.format == "int4" else body
    return int(embed + layers * per_layer * body / ranks + vocab * hidden * head)
