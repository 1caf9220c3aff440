"""A BERT encoder of our own in MLX (mlx-lm has none), for embed models: the same layers and
parameter names as the torch one (engines/torch_engine/bert.py), weights read with mx.load."""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx import nn

from ..base import UnsupportedModel
from ..bert_config import BertShape, duet_name, weight_files


class Embeddings(nn.Module):
    def __init__(self, shape: BertShape):
        super().__init__()
        self.word = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.position = nn.Embedding(shape.max_positions, shape.hidden_size)
        self.token_type = nn.Embedding(shape.type_vocab_size, shape.hidden_size)
        self.norm = nn.LayerNorm(shape.hidden_size, eps=shape.layer_norm_eps)

    def __call__(self, ids: mx.array) -> mx.array:
        positions = mx.arange(ids.shape[1])
        # One segment: every token's type is 0.
        x = self.word(ids) + self.position(positions)[None] + self.token_type.weight[0]
        return self.norm(x)


class Layer(nn.Module):
    def __init__(self, shape: BertShape):
        super().__init__()
        h = shape.hidden_size
        self.heads, self.head_dim = shape.num_heads, shape.head_dim
        self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=shape.layer_norm_eps)
        self.ffn_in = nn.Linear(h, shape.intermediate_size)
        self.ffn_out = nn.Linear(shape.intermediate_size, h)
        self.ffn_norm = nn.LayerNorm(h, eps=shape.layer_norm_eps)
        self.gelu = nn.gelu_approx if shape.tanh_gelu else nn.gelu

    def _heads(self, x: mx.array) -> mx.array:
        b, t, _ = x.shape
        return x.reshape(b, t, self.heads, self.head_dim).transpose(0, 2, 1, 3)

    def __call__(self, x: mx.array, bias: mx.array) -> mx.array:
        """bias: additive [batch, 1, 1, tokens], 0 where a key is a token, very negative where
        it is padding."""
        b, t, h = x.shape
        q, k, v = self._heads(self.query(x)), self._heads(self.key(x)), self._heads(self.value(x))
        attn = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0 / math.sqrt(self.head_dim),
                                                    mask=bias)
        x = self.attn_norm(x + self.attn_out(attn.transpose(0, 2, 1, 3).reshape(b, t, h)))
        return self.ffn_norm(x + self.ffn_out(self.gelu(self.ffn_in(x))))


class BertEncoder(nn.Module):
    def __init__(self, shape: BertShape):
        super().__init__()
        self.embeddings = Embeddings(shape)
        self.layers = [Layer(shape) for _ in range(shape.num_layers)]

    def __call__(self, ids: mx.array, mask: mx.array) -> mx.array:
        x = self.embeddings(ids)
        # Additive, in the states' dtype; finite so that no row can turn into NaNs.
        bias = ((1 - mask) * (-1e4 if x.dtype == mx.float16 else -1e9)).astype(x.dtype)
        bias = bias[:, None, None, :]
        for layer in self.layers:
            x = layer(x, bias)
        return x


def load_weights(model: BertEncoder, model_dir: Path) -> None:
    """The checkpoint's tensors under duet's names (safetensors only: mx.load reads them)."""
    weights: dict[str, mx.array] = {}
    for path in weight_files(model_dir):
        if path.suffix != ".safetensors":
            raise UnsupportedModel(f"{model_dir}: the MLX engine reads model.safetensors, and this "
                                   f"checkpoint has only {path.name}")
        for name, tensor in mx.load(str(path)).items():
            ours = duet_name(name)
            if ours is not None:
                weights[ours] = tensor
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:  # a missing tensor, or one that disagrees with config.json
        raise UnsupportedModel(f"{model_dir}: weights do not fit config.json: {exc}") from exc


class MLXBert:
    """The Encoder (engines/embed.py) of the MLX engine."""

    def __init__(self, model_dir: Path, shape: BertShape, dtype: mx.Dtype):
        self.hidden_size = shape.hidden_size
        self.model = BertEncoder(shape)
        load_weights(self.model, model_dir)
        self.model.set_dtype(dtype)
        self.model.eval()
        mx.eval(self.model.parameters())

    def hidden_states(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        states = self.model(mx.array(input_ids.astype(np.int32)),
                            mx.array(attention_mask.astype(np.int32)))
        return np.array(states.astype(mx.float32))
