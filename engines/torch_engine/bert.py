"""A BERT encoder of our own in torch, for embed models: post-norm layers, GELU feed-forward,
scaled_dot_product_attention with the padding masked out of every key."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..base import UnsupportedModel
from ..bert_config import BertShape, duet_name, weight_files


class Embeddings(nn.Module):
    def __init__(self, shape: BertShape):
        super().__init__()
        self.word = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.position = nn.Embedding(shape.max_positions, shape.hidden_size)
        self.token_type = nn.Embedding(shape.type_vocab_size, shape.hidden_size)
        self.norm = nn.LayerNorm(shape.hidden_size, eps=shape.layer_norm_eps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
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
        self.approximate = "tanh" if shape.tanh_gelu else "none"

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """keep: bool [batch, 1, 1, tokens], True where a key is a token, not padding."""
        b, t, h = x.shape
        q, k, v = self._heads(self.query(x)), self._heads(self.key(x)), self._heads(self.value(x))
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=keep,
                                              scale=1.0 / math.sqrt(self.head_dim))
        x = self.attn_norm(x + self.attn_out(attn.transpose(1, 2).reshape(b, t, h)))
        ffn = self.ffn_out(F.gelu(self.ffn_in(x), approximate=self.approximate))
        return self.ffn_norm(x + ffn)


class BertEncoder(nn.Module):
    def __init__(self, shape: BertShape):
        super().__init__()
        self.shape = shape
        self.embeddings = Embeddings(shape)
        self.layers = nn.ModuleList(Layer(shape) for _ in range(shape.num_layers))

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        keep = mask.bool()[:, None, None, :]
        x = self.embeddings(ids)
        for layer in self.layers:
            x = layer(x, keep)
        return x


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path), device="cpu")
    return torch.load(str(path), map_location="cpu", weights_only=True)


def load_weights(model: BertEncoder, model_dir: Path) -> None:
    """The checkpoint's tensors under duet's names; a missing or misshapen one is an error."""
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        for name, tensor in _read_weights(path).items():
            ours = duet_name(name)
            if ours is not None:
                state[ours] = tensor
    missing = sorted(set(model.state_dict()) - set(state))
    if missing:
        raise UnsupportedModel(f"{model_dir}: the checkpoint lacks {', '.join(missing[:4])}"
                               f"{' ...' if len(missing) > 4 else ''}")
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:  # shapes that disagree with config.json
        raise UnsupportedModel(f"{model_dir}: weights do not fit config.json: {exc}") from exc


class TorchBert:
    """The Encoder (engines/embed.py) of the torch engine."""

    def __init__(self, model_dir: Path, shape: BertShape, device: str, dtype: torch.dtype):
        self.device = device
        self.hidden_size = shape.hidden_size
        with torch.device("meta"):
            model = BertEncoder(shape)
        model = model.to_empty(device="cpu")
        load_weights(model, model_dir)
        self.model = model.to(device=device, dtype=dtype).eval()

    @torch.inference_mode()
    def hidden_states(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        ids = torch.from_numpy(input_ids).to(self.device)
        mask = torch.from_numpy(attention_mask).to(self.device)
        return self.model(ids, mask).float().cpu().numpy()
